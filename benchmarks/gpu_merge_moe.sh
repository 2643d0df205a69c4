#!/usr/bin/env bash
# Issue 15: the fused MoE's two GEMMs tiled apart at decode sizes, one GPU (carry .whl; `sampler` also .old).
#   tests:   the kernel tests (MLA absorb / decode, the Triton attention backend, fused MoE) and the fast path
#            against the reference path on the GPU
#   sweep:   benchmarks/sweep_moe_small.py at 1 / 2 / 4 / 8 tokens -> $OUT/moe_table.json
#   (abmerge, MLASERVE_MERGE_WUV=0 / 1 alternated twice, ran at dcf9a7e and went with the merge: merge-moe-h200.md)
#   abmoe:   bench one-batch V2-Lite bs 1 / 4 / 8, the shipped MoE table and $MOE_TABLE (default: the sweep's
#            $OUT/moe_table.json) alternated twice
#   (prefetch, the one-token MoE's shared-expert L2 prefetch, MLASERVE_MOE_PREFETCH=0 / 1 alternated twice, ran at
#   6a0ca60 and went with the prefetch: merge-moe-h200.md)
#   v3:      bench one-batch V3 4 layers FP8 bs 1 / 16 / 64
#   profile: benchmarks/profile_decode.py V2-Lite bs 1
#   sampler: benchmarks/bench_sampler.py from .old (the one-program-a-row seeded sampler) and from this tree
#   combos:  the single-GPU rows of tests/test_combinations.py (demo model), output as it comes
#   bash benchmarks/gpu_merge_moe.sh PART...
source benchmarks/gpu_v2l_env.sh
cat "$OUT/env.txt"
ob() {  # ob TAG CONFIG BATCH_SIZES...
  local tag=$1 cfg=$2; shift 2
  echo "### $tag"
  timeout 200 python3 -m mlaserve.cli bench one-batch --load-format dummy --input-len 256 --output-len 32 \
    --model-config "$cfg" --batch-size "$@" --output-file "$OUT/one_batch_$tag.md" 2>&1 | grep "^|" | tail -3
}
TABLE="mlaserve/kernels/configs/E=64,N=1408,device_name=NVIDIA_H200,dtype=bf16,block_shape=[128, 128].json"
for PART in "$@"; do
  echo "=== $PART $(date +%T)"
  case $PART in
    kernels)
      timeout 300 python3 -m pytest -q -x -p no:cacheprovider tests/kernels/test_fused_moe.py 2>&1 | tail -3 \
        | tee "$OUT/tests_moe.txt" ;;
    tests)
      timeout 300 python3 -m pytest -q -x -p no:cacheprovider tests/kernels/test_mla_absorb.py \
        tests/kernels/test_mla_decode.py tests/attention/test_triton_backend.py tests/kernels/test_fused_moe.py \
        2>&1 | tail -4 | tee "$OUT/tests_kernels.txt"
      timeout 200 python3 -m pytest -q -x -p no:cacheprovider tests/models/test_gpu_fastpath.py 2>&1 | tail -3 \
        | tee "$OUT/tests_fastpath.txt" ;;
    sweep)
      (cd benchmarks && timeout 300 python3 sweep_moe_small.py --tokens 1 2 4 8 --out-table "$OUT/moe_table.json") \
        2>&1 | tee "$OUT/sweep_moe.txt" | grep -v "^  skip" ;;
    abmoe)
      new=${MOE_TABLE:-$OUT/moe_table.json}
      cp "$TABLE" /tmp/moe_table_shipped.json
      for i in 1 2; do
        cp /tmp/moe_table_shipped.json "$TABLE"; ob v2l_moe_shipped$i "$V2L" 1 4 8
        cp "$new" "$TABLE"; ob v2l_moe_new$i "$V2L" 1 4 8
      done
      cp /tmp/moe_table_shipped.json "$TABLE" ;;
    v3)
      ob v3 "$V3_4L" 1 16 64 ;;
    profile)
      timeout 150 python3 benchmarks/profile_decode.py --bs 1 > "$OUT/prof_v2l_bs1.txt" 2>&1
      grep -v "loading weights" "$OUT/prof_v2l_bs1.txt" | head -22 ;;
    sampler)
      (cd .old && PYTHONPATH=$PWD:/tmp/site timeout 100 python3 ../benchmarks/bench_sampler.py 2>&1 | tail -6) \
        | tee "$OUT/sampler_old.txt"
      timeout 100 python3 benchmarks/bench_sampler.py 2>&1 | tail -6 | tee "$OUT/sampler_new.txt" ;;
    combos)
      timeout 560 python3 -m pytest -v -p no:cacheprovider tests/test_combinations.py -k gpu_graphs_and_compile \
        > "$OUT/tests_combos.txt" 2>&1
      tail -5 "$OUT/tests_combos.txt" ;;
  esac
done
