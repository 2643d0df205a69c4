#!/usr/bin/env bash
# Device call (H100, < 8 min): the eager-GEMM row buckets (`kernels/gemv.cublas_linear`), before (OLD, default
# HEAD~1) against after (this tree), full-width V2-Lite dummy weights:
#  1. probe_mixed_step.py: 4 prompts arriving during 64 decodes, mixed 512-token chunks and plain 2048 (after only);
#  2. `mlaserve serve` + `bench serving --backend mlaserve`, prompts of 128-256 tokens (--random-range-ratio 0.5, so
#     lengths vary as in real traffic): concurrency 1 (24 prompts, 16 new tokens: TTFT) and 64 (192 prompts, 128
#     new tokens: ITL), old code then new code. Carry .whl (and .old, see below).
set -uo pipefail
[ -d .whl ] && python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
M=/tmp/v2l; mkdir -p $M; cp mlaserve/tools/configs/deepseek-v2-lite.json $M/config.json
PYTHONPATH=$PWD:/tmp/site python3 -m mlaserve.tools.tokenizer $M > /dev/null
# The old tree: a carried .old (the device's git copy can lack new commits; make it here with
# `mkdir .old && git archive REV mlaserve benchmarks pyproject.toml | tar -x -C .old`), else `git archive $OLD`.
if [ -d .old ]; then rm -rf /tmp/old && cp -r .old /tmp/old && echo "old: the carried .old"
else OLD=${OLD:-HEAD~1}; rm -rf /tmp/old && mkdir -p /tmp/old && git archive $OLD | tar -x -C /tmp/old && echo "old: $OLD"; fi
for a in "--mixed --chunk 512" "--chunk 2048"; do
  [ "${PROBES:-1}" = 1 ] || break
  echo "### new: probe $a"
  PYTHONPATH=$PWD:/tmp/site timeout 150 python3 benchmarks/probe_mixed_step.py --model-path $M --arrive 4 $a 2>&1 | tr '\r' '\n' | grep '^{'
done
for code in old new; do
  dir=$PWD; [ $code = old ] && dir=/tmp/old
  (cd $dir && PYTHONPATH=$dir:/tmp/site python3 -m mlaserve.cli serve --model-path $M --load-format dummy --port 30000 \
     --log-level warning > "$OUT/serve_$code.log" 2>&1) &
  for i in $(seq 1 240); do
    curl -sf -m 60 http://127.0.0.1:30000/generate -H 'Content-Type: application/json' \
      -d '{"text": "Hello", "sampling_params": {"max_new_tokens": 1}}' > /dev/null 2>&1 && break
    sleep 0.5
  done
  for spec in "1 24 16" "64 192 128"; do
    set -- $spec
    PYTHONPATH=$PWD:/tmp/site timeout 150 python3 -m mlaserve.cli bench serving --backend mlaserve --num-prompts $2 \
      --random-input-len 256 --random-output-len $3 --random-range-ratio 0.5 --request-rate inf --max-concurrency $1 \
      --tokenizer $M --disable-tqdm --output-file "$OUT/serving_$code.jsonl" > /dev/null 2>&1
    python3 benchmarks/serving_summary.py --last "$OUT/serving_$code.jsonl" $code
  done
  pkill -TERM -f "mlaserve.cli serve" ; sleep 3
done
