#!/usr/bin/env bash
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 200 python3 benchmarks/diag_decode2.py 2>&1 | grep -v "oading" | tee "$OUT/diag2.txt"
for bs in 1 16; do
timeout 200 python3 -m mlaserve.cli bench one-batch --load-format dummy --model-config mlaserve/tools/configs/deepseek-v2-lite.json \
  --batch-size $bs --input-len 256 --output-len 16 --profile --profile-dir "$OUT" 2>&1 | grep "^|" | tail -2
rm -f "$OUT"/*.json
done
