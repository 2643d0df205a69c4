#!/usr/bin/env bash
# After merging expert parallelism (fused-MoE sentinel path), DP attention and speculative decoding: the GPU tests
# of the touched parts, then one-batch V2-Lite and V3 4-layer FP8 beside benchmarks/results/hardening-h100.md.
# Usage (repo root, on the GPU machine, carry .whl): bash benchmarks/gpu_merge_check.sh
set -uo pipefail
[ -d .whl ] && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site MLASERVE_CACHE=/tmp/mlaserve-cache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/env.txt"
timeout 330 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_fused_moe.py tests/models/test_gpu_fastpath.py \
  tests/engine/test_spec.py -k "gpu or cuda or test_fused_moe or test_gpu_fastpath" 2>&1 | tail -8 | tee "$OUT/tests.txt"
B="python3 -m mlaserve.cli bench one-batch --load-format dummy"
python3 -c "import json; d=json.load(open('mlaserve/tools/configs/deepseek-v3.json')); d['num_hidden_layers']=4; json.dump(d, open('/tmp/v3_4l.json','w'))"
timeout 120 $B --model-config mlaserve/tools/configs/deepseek-v2-lite.json --batch-size 1 16 64 --input-len 256 \
  --output-len 32 --output-file "$OUT/one_batch.md" 2>&1 | grep "^|" | tail -4
timeout 150 $B --model-config /tmp/v3_4l.json --batch-size 1 64 --input-len 256 --output-len 32 \
  --output-file "$OUT/one_batch.md" 2>&1 | grep "^|" | tail -3
