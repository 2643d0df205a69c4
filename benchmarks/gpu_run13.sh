#!/usr/bin/env bash
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 200 python3 -m pytest -q -p no:cacheprovider --timeout 150 -rA tests/models/test_gpu_fastpath.py tests/kernels/test_fused_moe.py \
  2>&1 | grep -E "^(PASSED|FAILED|ERROR)|passed|failed" | tee "$OUT/gpu_tests.txt" | tail -3
B="python3 -m mlaserve.cli bench one-batch --load-format dummy"
python3 -c "import json; d=json.load(open('mlaserve/tools/configs/deepseek-v3.json')); d['num_hidden_layers']=4; json.dump(d, open('/tmp/v3_4l.json','w'))"
timeout 120 $B --model-config mlaserve/tools/configs/deepseek-v2-lite.json --batch-size 1 16 64 --input-len 256 --output-len 32 \
  --output-file "$OUT/one_batch.md" 2>&1 | grep "^|" | tail -3
timeout 100 $B --model-config /tmp/v3_4l.json --batch-size 1 16 64 --input-len 256 --output-len 32 \
  --output-file "$OUT/one_batch.md" 2>&1 | grep "^|" | tail -3
