#!/usr/bin/env bash
# Device call (one GPU) for this session's merged work: the tensor-parallel tests (gloo ranks, pinned to the CPU, on
# a GPU machine) and the one-line refusal of more ranks than GPUs; structured output on the GPU (grammar tests,
# sync-free drain with grammars) and its decode-step overhead on the demo model and on V2-Lite shapes.
# Usage (repo root, on the GPU machine, carry .whl: server, test and xgrammar wheels): bash benchmarks/gpu_features.sh
set -uo pipefail
[ -d .whl ] && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD MLASERVE_CACHE=/tmp/mlaserve-cache OMP_NUM_THREADS=4
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/env.txt"
T="timeout ${TEST_TIMEOUT:-330} python3 -m pytest -v -p no:cacheprovider --timeout 300 -rfEs"
$T tests/distributed tests/bench/test_one_batch.py > "$OUT/tests_tp.txt" 2>&1 &
$T tests/server/test_parallel_server.py > "$OUT/tests_tp_server.txt" 2>&1 &
$T tests/scheduler/test_grammar.py tests/scheduler/test_overlap_sync.py tests/server/test_structured_output.py \
  tests/server/test_structured.py > "$OUT/tests_grammar.txt" 2>&1 &
wait
grep -hE "(FAILED|ERROR)|passed|failed" "$OUT"/tests_*.txt | grep -v "^tests/.*PASSED" | tail -30
M=/tmp/v2l; mkdir -p $M; cp mlaserve/tools/configs/deepseek-v2-lite.json $M/config.json
timeout 120 python3 benchmarks/grammar_overhead.py --batch-size 1 32 2>&1 | tee "$OUT/grammar_demo.txt" | tail -6
timeout 150 python3 benchmarks/grammar_overhead.py --model-path $M --load-format dummy --tokenizer-path mlaserve/demo \
  --batch-size 1 32 2>&1 | tee "$OUT/grammar_v2lite.txt" | tail -6
