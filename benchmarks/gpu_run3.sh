#!/usr/bin/env bash
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 120 python3 benchmarks/diag_poison.py 2>&1 | tee "$OUT/poison.txt"
timeout 400 python3 -m mlaserve.cli bench one-batch --load-format dummy --model-config mlaserve/tools/configs/deepseek-v2-lite.json \
  --batch-size 1 16 64 --input-len 256 --output-len 32 --hf-peer --output-file "$OUT/one_batch.md" 2>&1 | grep -v "^loading\|Loading" | tail -30
