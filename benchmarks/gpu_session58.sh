#!/usr/bin/env bash
# Session of 2026-12-07, one H100 or H200 (carry .whl: ../shared/device/wheels.sh):
#   mixedspec: the GPU rows of tests/test_combinations.py with --enable-mixed-chunk (MTP drafts eager beside CUDA
#              graphs; piecewise graphs + torch.compile), and the plain mixed-chunk rows beside them
#   any part of benchmarks/gpu_session56.sh (sdpa, tests, ab, onebatch: the prefill's attention on cuDNN)
#   bash benchmarks/gpu_session58.sh PART...
source benchmarks/gpu_v2l_env.sh
for PART in "$@"; do
  case $PART in
    mixedspec)
      echo "=== $PART $(date +%T)"
      timeout 420 python3 -m pytest -q -rs tests/test_combinations.py -k "mixed" > "$OUT/mixedspec.txt" 2>&1
      tail -6 "$OUT/mixedspec.txt" ;;
    *) bash benchmarks/gpu_session56.sh "$PART" ;;
  esac
done
echo "=== done $(date +%T)"
