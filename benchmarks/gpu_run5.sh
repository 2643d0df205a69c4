#!/usr/bin/env bash
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 240 python3 benchmarks/diag_greedy.py 2>&1 | tr "\r" "\n" | grep "vs cpu\|Error\|error" | tee "$OUT/diag_greedy.txt"
exit 0
  --batch-size 1 16 64 --input-len 256 --output-len 32 2>&1 | grep "^|" | tail -4
