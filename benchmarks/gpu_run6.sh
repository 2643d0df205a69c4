#!/usr/bin/env bash
# Device call: greedy diagnosis, GPU tests, one-batch V2-Lite (bf16) and V3 4-layer (FP8), full width, dummy weights.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 150 python3 benchmarks/diag_greedy.py 2>&1 | tr "\r" "\n" | grep "vs cpu\|Error\|error" | tee "$OUT/diag_greedy.txt"
timeout 200 python3 -m pytest -q -p no:cacheprovider --timeout 150 --tb=line tests/models/test_gpu_fastpath.py 2>&1 | tail -15 | tee "$OUT/gpu_fastpath.txt"
B="python3 -m mlaserve.cli bench one-batch --load-format dummy"
timeout 200 $B --model-config mlaserve/tools/configs/deepseek-v2-lite.json --batch-size 1 16 64 --input-len 256 --output-len 32 \
  --output-file "$OUT/one_batch.md" 2>&1 | grep "^|" | tail -3
timeout 100 $B --model-config mlaserve/tools/configs/deepseek-v2-lite.json --batch-size 1 --input-len 4096 --output-len 4 \
  --output-file "$OUT/one_batch.md" 2>&1 | grep "^|" | tail -1
python3 -c "import json; d=json.load(open('mlaserve/tools/configs/deepseek-v3.json')); d['num_hidden_layers']=4; json.dump(d, open('/tmp/v3_4l.json','w'))"
timeout 200 $B --model-config /tmp/v3_4l.json --batch-size 1 16 64 --input-len 256 --output-len 32 \
  --output-file "$OUT/one_batch.md" 2>&1 | grep "^|\|Error" | tail -4
