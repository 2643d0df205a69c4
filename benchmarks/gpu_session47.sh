#!/usr/bin/env bash
# Session of 2026-12-02, one H200 (carry .whl: ../shared/device/wheels.sh, then benchmarks/xgrammar_wheels.sh): the
# compiled decode paths behind core.compile_opaque on a GPU, the one-batch table at this tree, where the V2-Lite bs-1
# step goes now, and the MLA decode's tiles (results in benchmarks/results/mla-short-h200.md).
#   tests:    the model's fast path against the reference (graphs, torch.compile with and without graphs),
#             tests/test_core.py
#   combos:   the single-GPU rows of the combination matrix
#   kernels:  the kernel tests (tests/kernels, the Triton attention backend)
#   table:    bench one-batch V2-Lite and V3 4 layers FP8, bs 1 / 16 / 64, in 256 out 32
#   compile:  the same for V2-Lite bs 1 / 16 with --enable-torch-compile
#   spec:     the speculative GPU rows (graphs, torch.compile inside the draft + verify graphs; carry xgrammar)
#   mlarows:  benchmarks/probe_mla_rows.py (MLA decode variants at short contexts)
#   profile:  benchmarks/profile_decode.py V2-Lite bs 1 (kernels of one step, the host ops of one step)
#   ab:       bench one-batch V2-Lite bs 1 / 16 / 64, the H=16 MLA decode at 4 warps and at this tree's 8,
#             alternated twice (AB_IN, AB_BS, AB_TAGS: input length, batch sizes, order)
#   mlatests: the MLA decode kernel tests, the Triton backend's, the fast path against the reference
#   bash benchmarks/gpu_session47.sh PART...
source benchmarks/gpu_v2l_env.sh
cat "$OUT/env.txt"
ob() {  # ob TAG CONFIG FLAGS... -- BATCH_SIZES...
  local tag=$1 cfg=$2; shift 2
  echo "### $tag"
  timeout 200 python3 -m mlaserve.cli bench one-batch --load-format dummy --input-len 256 --output-len 32 \
    --model-config "$cfg" --output-file "$OUT/one_batch_$tag.md" "$@" 2>&1 | grep "^|" | tail -3
}
for PART in "$@"; do
  echo "=== $PART $(date +%T)"
  case $PART in
    tests)
      timeout 240 python3 -m pytest -q -p no:cacheprovider tests/models/test_gpu_fastpath.py tests/test_core.py \
        > "$OUT/tests_fastpath.txt" 2>&1; tail -3 "$OUT/tests_fastpath.txt" ;;
    combos)
      timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_combinations.py -k gpu_graphs_and_compile \
        > "$OUT/tests_combos.txt" 2>&1; tail -3 "$OUT/tests_combos.txt" ;;
    kernels)
      timeout 300 python3 -m pytest -q -p no:cacheprovider tests/kernels tests/attention/test_triton_backend.py \
        > "$OUT/tests_kernels.txt" 2>&1; tail -3 "$OUT/tests_kernels.txt" ;;
    table)
      ob v2l "$V2L" --batch-size 1 16 64
      ob v3 "$V3_4L" --batch-size 1 16 64 ;;
    compile)
      ob v2l_compile "$V2L" --enable-torch-compile --batch-size 1 16 ;;
    spec)
      timeout 200 python3 -m pytest -q -p no:cacheprovider tests/engine/test_spec.py -k "cuda or gpu" \
        > "$OUT/tests_spec.txt" 2>&1; tail -3 "$OUT/tests_spec.txt" ;;
    mlarows)
      (cd benchmarks && timeout 240 python3 probe_mla_rows.py) 2>&1 | grep -v Warn | tee "$OUT/mla_rows.txt" ;;
    profile)
      timeout 150 python3 benchmarks/profile_decode.py --bs 1 > "$OUT/prof_v2l_bs1.txt" 2>&1
      grep -v "loading weights" "$OUT/prof_v2l_bs1.txt" | head -40 ;;
    ab)   # the H=16 MLA decode at 4 warps (before this session) against this tree's 8, alternated; AB_IN input tokens
      # (default 256), AB_BS batch sizes (default 1 16 64), AB_TAGS the order (default old new old new)
      old="import sys, mlaserve.kernels.mla_decode as m; m.CONFIGS[16] = m.MLADecodeConfig(16, 64, 4, 2)"
      for tag in ${AB_TAGS:-old new old new}; do
        patch="import sys"; [ $tag = old ] && patch="$old"
        echo "### $tag"
        timeout 150 python3 -c "$patch; from mlaserve.cli import main; sys.exit(main())" bench one-batch \
          --load-format dummy --input-len ${AB_IN:-256} --output-len 32 --model-config "$V2L" \
          --batch-size ${AB_BS:-1 16 64} --output-file "$OUT/one_batch_ab_$tag.md" 2>&1 | grep "^| mlaserve" | tail -3
      done ;;
    mlatests)
      timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_mla_decode.py \
        tests/attention/test_triton_backend.py tests/models/test_gpu_fastpath.py -k "not logprobs_through_the_runner" \
        > "$OUT/tests_mla.txt" 2>&1; tail -3 "$OUT/tests_mla.txt" ;;
  esac
done
