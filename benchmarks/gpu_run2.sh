#!/usr/bin/env bash
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 120 python3 benchmarks/diag_decode.py 2>&1 | grep -v Loading | tee "$OUT/diag.txt"
timeout 200 python3 -m pytest -q -p no:cacheprovider --timeout 100 --tb=short \
  tests/kernels/test_fp8_gemm.py tests/kernels/test_fused_moe.py tests/kernels/test_mla_prefill.py tests/kernels/test_moe_topk.py \
  2>&1 | grep -E "^E |Error|^FAILED|passed|failed|^tests/" | head -120 > "$OUT/kernel_fail.txt"
tail -5 "$OUT/kernel_fail.txt"
