#!/usr/bin/env bash
# Second device call: mixed chunks on the GPU (tests, then V2-Lite serving at concurrency 64 with and without
# --enable-mixed-chunk, and concurrency 1 / 16), then chain speculation on the demo model, plain vs (3, 1, 4)
# alternating twice at bs 1 (512 new tokens). Usage (repo root, carry .whl): bash benchmarks/gpu_final_b.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
RUNS="default mixed mixed-chunk512 levels" bash benchmarks/gpu_mixed.sh 2>&1 | grep -v "Target directory" | tail -12
export PYTHONPATH=$PWD:/tmp/site
for i in 1 2; do
  for spec in none 3,1,4; do
    timeout 60 python3 benchmarks/spec_decode.py demo-one 1 $spec 512 2>&1 | grep '^{' | python3 -c \
      "import json,sys; r=json.loads(sys.stdin.read()); r.pop('ids'); print(json.dumps(r))" | tee -a "$OUT/spec_demo.jsonl"
  done
done
