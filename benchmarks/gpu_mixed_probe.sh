#!/usr/bin/env bash
# Device call (H100, < 6 min): per-step times when prompts arrive during 64 decodes (benchmarks/probe_mixed_step.py),
# full-width V2-Lite dummy weights, with and without --enable-mixed-chunk, and torch-profiler tables of the first
# step after the arrivals. Prints everything (no files needed). Carry .whl.
set -uo pipefail
[ -d .whl ] && python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v "Target directory"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site
M=/tmp/v2l; mkdir -p $M; cp mlaserve/tools/configs/deepseek-v2-lite.json $M/config.json
python3 -m mlaserve.tools.tokenizer $M > /dev/null
nvidia-smi --query-gpu=name --format=csv,noheader
p() { echo "### $*"; timeout 150 python3 benchmarks/probe_mixed_step.py --model-path $M "$@" 2>&1 | tr '\r' '\n' | grep -v "loading weights" | tail -${TAILN:-2}; }
p --arrive 4
p --arrive 4 --mixed
p --arrive 4 --mixed --chunk 512
p --arrive 16 --mixed --chunk 2048
p --arrive 16 --chunk 2048
TAILN=30 p --arrive 4 --mixed --chunk 512 --profile
