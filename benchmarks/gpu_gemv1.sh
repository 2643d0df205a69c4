#!/usr/bin/env bash
# Issue 15: one-row linears in registers before the PDL wait (`gemv1`) and the two-launch greedy argmax, one GPU
# (carry .whl).
#   tests:   the gemv / sampling kernel tests and the fast path's greedy equality on the GPU
#   bench:   benchmarks/bench_gemv1.py (gemv1 / gemv / cuBLAS at the projections' shapes; argmax_rows / torch)
#   ab:      bench one-batch V2-Lite bs 1 / 16 / 64 with MLASERVE_GEMV1=0 and 1, alternated twice
#   profile: benchmarks/profile_decode.py V2-Lite bs 1 (where the step goes now)
#   v3:      bench one-batch V3 4 layers FP8 bs 1 / 16 / 64
#   mlatests: the MLA decode kernel tests on the GPU (first tile before the PDL wait)
#   (abmla, the MLA first-tile prefetch's A/B, ran at 1e943f1 and went with the prefetch: gemv1-h200.md)
#   abv3:    bench one-batch V3 4 layers FP8, the session's first tree (.old, carried: a `git archive` without
#            mlaserve/demo and benchmarks/results) and this one
#   (sampler, the seeded sampler's timing, moved to gpu_merge_moe.sh, where it ran: merge-moe-h200.md)
#   combos:  the single-GPU rows of tests/test_combinations.py (demo model: graphs, compile, spec, tree, mixed, piecewise)
#   bash benchmarks/gpu_gemv1.sh [tests|bench|ab|profile|v3]...
source benchmarks/gpu_v2l_env.sh
cat "$OUT/env.txt"
ob() {  # ob TAG CONFIG BATCH_SIZES... (from the tree in $TREE, default this one)
  local tag=$1 cfg=$2; shift 2
  echo "### $tag"
  (cd "${TREE:-.}" && PYTHONPATH=$PWD:/tmp/site timeout 200 python3 -m mlaserve.cli bench one-batch --load-format dummy --input-len 256 --output-len 32 \
    --model-config "$cfg" --batch-size "$@" --output-file "$OUT/one_batch_$tag.md" 2>&1 | grep "^|" | tail -3)
}
for PART in "$@"; do
  case $PART in
    tests)
      timeout 200 python3 -m pytest -q -x -p no:cacheprovider tests/kernels/test_gemv.py tests/kernels/test_sampling.py \
        2>&1 | tail -4 | tee "$OUT/tests_kernels.txt"
      timeout 200 python3 -m pytest -q -x -p no:cacheprovider tests/models/test_gpu_fastpath.py 2>&1 | tail -3 \
        | tee "$OUT/tests_fastpath.txt" ;;
    bench)
      timeout 150 python3 benchmarks/bench_gemv1.py 2>&1 | tee "$OUT/bench_gemv1.txt" | tail -16 ;;
    ab)
      for i in 1 2; do
        MLASERVE_GEMV1=0 ob v2l_off$i "$V2L" 1 16 64
        MLASERVE_GEMV1=1 ob v2l_on$i "$V2L" 1 16 64
      done ;;
    profile)
      timeout 150 python3 benchmarks/profile_decode.py --bs 1 > "$OUT/prof_v2l_bs1.txt" 2>&1
      grep -v "loading weights" "$OUT/prof_v2l_bs1.txt" | head -22 ;;
    v3)
      ob v3 "$V3_4L" 1 16 64 ;;
    mlatests)
      timeout 200 python3 -m pytest -q -x -p no:cacheprovider tests/kernels/test_mla_decode.py 2>&1 | tail -3 \
        | tee "$OUT/tests_mla.txt" ;;
    abv3)
      TREE=.old ob v3_old "$V3_4L" 1 16 64
      ob v3_new "$V3_4L" 1 16 64 ;;
    combos)
      timeout 400 python3 -m pytest -q -p no:cacheprovider tests/test_combinations.py -k gpu_graphs_and_compile \
        2>&1 | tail -4 | tee "$OUT/tests_combos.txt" ;;
  esac
done
