#!/usr/bin/env bash
# Session of 2026-12-06 (second), one H100 (`nvidia-h100-x1`; carry .whl: ../shared/device/wheels.sh). The one-row
# block-FP8 linear `fp8_gemv1` (issue 15, V3 bs 1):
#   tests:  its CPU tests on the GPU, and the fast-path model tests (FP8, graphs, compile against the reference path)
#   sweep:  benchmarks/sweep_fp8_gemv1.py (fp8_gemv1 against fp8_gemv at V3's one-row shapes, and the 18-call mix)
#   ab:     bench one-batch V3 full width cut to 4 layers, FP8, bs 1, in 256 / out 32, MLASERVE_FP8_GEMV1=0 / 1 / 0 / 1
#   bash benchmarks/gpu_session54.sh PART...
source benchmarks/gpu_v2l_env.sh
cat "$OUT/env.txt"
B="python3 -m mlaserve.cli bench one-batch --load-format dummy"
for PART in "$@"; do
  echo "=== $PART $(date +%T)"
  case $PART in
    tests)
      timeout 120 python3 -m pytest -q -x tests/kernels/test_fp8_gemv.py tests/kernels/test_fp8_gemm.py > "$OUT/tests_kernels.txt" 2>&1
      tail -1 "$OUT/tests_kernels.txt"
      timeout 300 python3 -m pytest -q -x tests/models/test_gpu_fastpath.py > "$OUT/tests_fastpath.txt" 2>&1
      tail -1 "$OUT/tests_fastpath.txt" ;;
    sweep)
      timeout 240 python3 benchmarks/sweep_fp8_gemv1.py > "$OUT/sweep.txt" 2>&1
      grep -aE "^one-row|^[a-z].*: N |-> " "$OUT/sweep.txt"; sed -n '/^V3 4 layers/,$p' "$OUT/sweep.txt" | head -8
      grep -aiE "error|Traceback" "$OUT/sweep.txt" | head -3 ;;
    ab)
      i=0
      for g in 0 1 0 1; do
        i=$((i + 1))
        MLASERVE_FP8_GEMV1=$g timeout 150 $B --model-config $V3_4L --batch-size 1 --input-len 256 --output-len 32 \
          --output-file "$OUT/one_batch_ab.md" > "$OUT/ab_$i.log" 2>&1
        echo "MLASERVE_FP8_GEMV1=$g $(grep -a '^| mlaserve' "$OUT/ab_$i.log" || tail -2 "$OUT/ab_$i.log")"
      done ;;
    *) echo "unknown part $PART" ;;
  esac
done
echo "=== done $(date +%T)"
