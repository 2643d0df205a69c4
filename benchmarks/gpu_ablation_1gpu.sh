#!/usr/bin/env bash
# Issue 17 on ONE GPU (no two-GPU machine was lent): the single-query table's rows that need no EP / DP attention,
# on DeepSeek-V3 full width, 4 layers + its MTP layer, block FP8, dummy weights, our own tokenizer.
# Usage (repo root, carry .whl): bash benchmarks/gpu_ablation_1gpu.sh
set -uo pipefail
[ -d .whl ] && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
M=/tmp/v3_4l; mkdir -p $M
python3 -c "import json; d=json.load(open('mlaserve/tools/configs/deepseek-v3.json')); d['num_hidden_layers']=4; json.dump(d, open('$M/config.json','w'))"
python3 -m mlaserve.tools.tokenizer $M > /dev/null
timeout ${LIMIT:-520} python3 benchmarks/ablation.py --model-path $M --tp 1 --table single --single-new 256 \
  --start-timeout 240 --serve-args "--load-format dummy" 2>&1 | grep -v "Warn\|warn" | tee "$OUT/ablation_1gpu.md"
