#!/usr/bin/env bash
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 240 python3 benchmarks/diag_greedy.py 2>&1 | grep -v "oading" | tee "$OUT/diag_greedy.txt"
timeout 250 python3 -m mlaserve.cli bench one-batch --load-format dummy --model-config mlaserve/tools/configs/deepseek-v2-lite.json \
  --batch-size 1 16 64 --input-len 256 --output-len 32 2>&1 | grep "^|" | tail -4
