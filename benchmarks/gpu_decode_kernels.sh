#!/usr/bin/env bash
# Issue 15 decode kernels on one H100 (carry .whl): the FP8 block gemv (mlaserve/kernels/fp8_gemv.py) and the
# one-launch MoE align, checked (GPU kernel tests, the fast path's greedy equality) and timed (their benchmarks),
# then one-batch V3 4L FP8 and V2-Lite with each switched off and on in the same run.
#   bash benchmarks/gpu_decode_kernels.sh [tests|bench|ab|all]
source benchmarks/gpu_v2l_env.sh
PART=${1:-all}
cat "$OUT/env.txt"
if [ "$PART" = tests ] || [ "$PART" = all ]; then
  timeout 240 python3 -m pytest -q -x -p no:cacheprovider tests/kernels/test_fp8_gemv.py tests/kernels/test_fp8_gemm.py \
    tests/kernels/test_fused_moe.py tests/kernels/test_reduce.py 2>&1 | tail -4 | tee "$OUT/tests_kernels.txt"
  timeout 200 python3 -m pytest -q -x -p no:cacheprovider tests/models/test_gpu_fastpath.py 2>&1 | tail -3 \
    | tee "$OUT/tests_fastpath.txt"
fi
if [ "$PART" = bench ] || [ "$PART" = all ]; then
  timeout 150 python3 benchmarks/bench_fp8_gemv.py --sweep > "$OUT/fp8_gemv.txt" 2>&1; grep -v "^{" "$OUT/fp8_gemv.txt" | tail -40
  timeout 100 python3 benchmarks/bench_moe_align.py > "$OUT/moe_align.txt" 2>&1; grep -v "^{" "$OUT/moe_align.txt" | tail -24
fi
ob() {  # ob TAG PATCH CONFIG BATCH_SIZES...: one-batch with module constants patched first (PATCH: python statements)
  local tag=$1 patch=$2 cfg=$3; shift 3
  echo "### $tag"
  timeout 150 python3 -c "import sys; $patch; from mlaserve.cli import main; sys.exit(main())" bench one-batch \
    --load-format dummy --input-len 256 --output-len 32 --model-config $cfg --batch-size "$@" \
    --output-file "$OUT/one_batch_$tag.md" 2>&1 | grep "^|" | tail -3
}
if [ "$PART" = ab ] || [ "$PART" = all ]; then
  OLD_FP8="import mlaserve.kernels.fp8_gemm as f; f.FP8_GEMV_MAX_M = 0"
  OLD_ALIGN="import mlaserve.kernels.fused_moe as m; m.ALIGN_ONE_PROGRAM_MAX_WORK = 16 * 128; m.ALIGN_TWO_LAUNCH_MAX_READS = 0"
  ob v3_old "$OLD_FP8; $OLD_ALIGN" /tmp/v3_4l.json 1 16 64
  ob v3_new "pass" /tmp/v3_4l.json 1 16 64
  ob v2l_old "$OLD_ALIGN" $V2L 1 16 64
  ob v2l_new "pass" $V2L 1 16 64
fi
