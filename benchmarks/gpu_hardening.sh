#!/usr/bin/env bash
# Device call for the hardening issue: the whole test suite on one GPU (kernels, fast path vs the all-reference run,
# float32 vs HF, the scheduler's sync-free drain, the engine, and the server / Engine / fuzz tests, whose scheduler
# runs on the GPU with the overlap scheduler truly asynchronous), then `bench one-batch` for V2-Lite and V3 4-layer FP8.
# Usage (repo root, on the GPU machine, carry .whl: the server and test dependencies the image lacks):
#   bash benchmarks/gpu_hardening.sh [tests|bench|all]
set -uo pipefail
[ -d .whl ] && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD MLASERVE_CACHE=/tmp/mlaserve-cache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PART=${1:-all}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/env.txt"
python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__)' | tee -a "$OUT/env.txt"
git log -1 --format='commit %h %s' 2>/dev/null | tee -a "$OUT/env.txt"
if [ "$PART" != bench ]; then
  # three groups at once (16 cores, one GPU), each logging test by test; schemathesis is not carried (its dependency
  # tree is large): its fuzz test runs in CI on the CPU
  T="timeout 450 python3 -m pytest -v -p no:cacheprovider --timeout 300 -rfEs"
  $T tests/server --ignore=tests/server/test_openapi_fuzz.py > "$OUT/tests_server.txt" 2>&1 &
  $T tests/scheduler tests/engine tests/bench > "$OUT/tests_sched.txt" 2>&1 &
  $T tests --ignore=tests/server --ignore=tests/scheduler --ignore=tests/engine --ignore=tests/bench \
    > "$OUT/tests_rest.txt" 2>&1 &
  wait
  grep -hE "(FAILED|ERROR)|passed|failed" "$OUT"/tests_*.txt | grep -v "^tests/.*PASSED" | tail -40
fi
if [ "$PART" != tests ]; then
  B="python3 -m mlaserve.cli bench one-batch --load-format dummy"
  python3 -c "import json; d=json.load(open('mlaserve/tools/configs/deepseek-v3.json')); d['num_hidden_layers']=4; json.dump(d, open('/tmp/v3_4l.json','w'))"
  timeout 200 $B --model-config mlaserve/tools/configs/deepseek-v2-lite.json --batch-size 1 16 64 --input-len 256 \
    --output-len 32 --hf-peer --output-file "$OUT/one_batch.md" 2>&1 | grep "^|" | tail -6
  timeout 150 $B --model-config /tmp/v3_4l.json --batch-size 1 16 64 --input-len 256 --output-len 32 \
    --output-file "$OUT/one_batch.md" 2>&1 | grep "^|" | tail -3
fi
