#!/usr/bin/env bash
# Device call: `mlaserve serve` on full-width DeepSeek-V2-Lite (dummy weights, own tokenizer): startup to first
# served token, then `mlaserve bench serving` with the overlap scheduler on and off. Carry .whl (server deps).
set -uo pipefail
[ -d .whl ] && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
M=/tmp/v2l; mkdir -p $M; cp ${CONFIG:-mlaserve/tools/configs/deepseek-v2-lite.json} $M/config.json
python3 -m mlaserve.tools.tokenizer $M > /dev/null
serve_and_bench() {  # $1: label, rest: extra serve flags
  local label=$1; shift
  local t0=$(date +%s.%N)
  python3 -m mlaserve.cli serve --model-path $M --load-format dummy --port 30000 --log-level warning "$@" > "$OUT/serve_$label.log" 2>&1 &
  local pid=$!
  for i in $(seq 1 240); do
    curl -sf -m 60 http://127.0.0.1:30000/v1/completions -H 'Content-Type: application/json' \
      -d '{"model": "m", "prompt": "Hello", "max_tokens": 1}' > /dev/null 2>&1 && break
    sleep 0.5
  done
  echo "$label: startup to first served token $(python3 -c "import time; print(round(time.time() - $t0, 1))") s" | tee -a "$OUT/startup.txt"
  for conc in ${CONCS:-1 16 64}; do
    timeout 150 python3 -m mlaserve.cli bench serving --backend openai --model m --num-prompts $((conc * 4 > 32 ? conc * 4 : 32)) \
      --random-input-len 256 --random-output-len 128 --random-range-ratio 1.0 --request-rate inf --max-concurrency $conc \
      --tokenizer $M --disable-tqdm --output-file "$OUT/serving_$label.jsonl" > /dev/null 2>&1
  done
  kill -TERM $pid; wait $pid; echo "$label: serve exit code $?"
}
serve_and_bench overlap
serve_and_bench no_overlap --disable-overlap-schedule
python3 benchmarks/serving_summary.py "$OUT"
