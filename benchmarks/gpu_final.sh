#!/usr/bin/env bash
# The recorded device run: GPU tests, one-batch V2-Lite (+ HF transformers peer) and V3 4-layer FP8, bench kernels.
# Usage (repo root, on the GPU machine; carry .whl for the server dependencies): bash benchmarks/gpu_final.sh
set -uo pipefail
[ -d .whl ] && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/env.txt"
python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__)' | tee -a "$OUT/env.txt"
timeout 240 python3 -m pytest -q -p no:cacheprovider --timeout 200 -rA tests/kernels tests/models/test_gpu_fastpath.py \
  2>&1 | grep -E "^(PASSED|FAILED|ERROR)|passed|failed" | tee "$OUT/gpu_tests.txt" | tail -3
B="python3 -m mlaserve.cli bench one-batch --load-format dummy"
python3 -c "import json; d=json.load(open('mlaserve/tools/configs/deepseek-v3.json')); d['num_hidden_layers']=4; json.dump(d, open('/tmp/v3_4l.json','w'))"
timeout 150 $B --model-config mlaserve/tools/configs/deepseek-v2-lite.json --batch-size 1 16 64 --input-len 256 --output-len 32 \
  --hf-peer --output-file "$OUT/one_batch.md" 2>&1 | grep "^|" | tail -6
timeout 60 $B --model-config mlaserve/tools/configs/deepseek-v2-lite.json --batch-size 1 --input-len 4096 --output-len 4 \
  --output-file "$OUT/one_batch.md" 2>&1 | grep "^|" | tail -1
timeout 100 $B --model-config /tmp/v3_4l.json --batch-size 1 16 64 --input-len 256 --output-len 32 \
  --output-file "$OUT/one_batch.md" 2>&1 | grep "^|" | tail -3
timeout 150 python3 -m mlaserve.cli bench kernels --output "$OUT/kernels.md" > "$OUT/kernels_log.txt" 2>&1; tail -3 "$OUT/kernels.md"
