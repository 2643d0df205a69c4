#!/usr/bin/env bash
# Session of 2026-12-07 (second), one H100 or H200 (carry .whl: ../shared/device/wheels.sh), all in one call:
#   tests:     tests/kernels/test_mla_prefill.py (the cuDNN prefill path against the reference and the Triton kernel)
#   ab:        benchmarks/ab_cudnn_prefill.py at V3 4L 4096 / 16384 and V2-Lite 4096, alternated in one runner
#   mixedspec: the GPU rows of tests/test_combinations.py with --enable-mixed-chunk
#   bash benchmarks/gpu_session59.sh PART...
source benchmarks/gpu_v2l_env.sh
cat "$OUT/env.txt"
for PART in "$@"; do
  echo "=== $PART $(date +%T)"
  case $PART in
    tests)
      timeout 150 python3 -m pytest -q -x tests/kernels/test_mla_prefill.py > "$OUT/tests.txt" 2>&1; tail -4 "$OUT/tests.txt" ;;
    ab)
      for run in "$V3_4L 4096" "$V2L 4096" "$V3_4L 16384"; do
        set -- $run
        timeout 110 python3 benchmarks/ab_cudnn_prefill.py --model-config $1 --len $2 2>&1 | grep -a "^|\|logits\|Error" \
          | tee -a "$OUT/ab.md"
      done ;;
    mixedspec)
      timeout 300 python3 -m pytest -q -rs tests/test_combinations.py -k "mixed" > "$OUT/mixedspec.txt" 2>&1
      tail -8 "$OUT/mixedspec.txt" ;;
    *) echo "unknown part $PART" ;;
  esac
done
echo "=== done $(date +%T)"
