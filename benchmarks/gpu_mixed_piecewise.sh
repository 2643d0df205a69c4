#!/usr/bin/env bash
# Scheduler step times with prompts arriving while 64 requests decode: plain, piecewise, piecewise + mixed chunk,
# mixed chunk (benchmarks/probe_mixed_step.py, V2-Lite dummy weights). Carry .whl.
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD:/tmp/site
M=/tmp/v2l; mkdir -p $M; cp mlaserve/tools/configs/deepseek-v2-lite.json $M/config.json
python3 -m mlaserve.tools.tokenizer $M > /dev/null
for a in "" "--piecewise" "--piecewise --mixed" "--mixed"; do
  for n in 1 4; do
    echo "### $a arrive $n"
    timeout 150 python3 benchmarks/probe_mixed_step.py --model-path $M --arrive $n $a 2>&1 | tr '\r' '\n' | grep '^{'
  done
done
