#!/usr/bin/env bash
# Device call: GPU tests (kernels + fast path), one-batch with torch.compile, bench offline (V2-Lite dummy).
set -uo pipefail
[ -d .whl ] && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 280 python3 -m pytest -q -p no:cacheprovider --timeout 200 --tb=line tests/kernels tests/models/test_gpu_fastpath.py \
  2>&1 | tail -25 | tee "$OUT/gpu_tests.txt"
M=/tmp/v2l; mkdir -p $M; cp mlaserve/tools/configs/deepseek-v2-lite.json $M/config.json
python3 -m mlaserve.tools.tokenizer $M > /dev/null
timeout 120 python3 -m mlaserve.cli bench offline --model-path $M --load-format dummy --num-prompts 256 --random-input-len 256 \
  --random-output-len 128 --log-level warning --output-file "$OUT/offline.jsonl" 2>&1 | tr '\r' '\n' | grep "^offline"
timeout 200 python3 -m mlaserve.cli bench one-batch --load-format dummy --model-config $M/config.json --batch-size 1 16 \
  --input-len 256 --output-len 32 --enable-torch-compile --output-file "$OUT/one_batch_compile.md" 2>&1 | grep "^|\|Error\|error" | tail -6
