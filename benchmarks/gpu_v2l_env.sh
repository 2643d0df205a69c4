# Sourced by the GPU scripts: the carried wheels on PYTHONPATH, $OUT (with env.txt: the GPU), a Triton cache, $M: a
# V2-Lite checkpoint directory (the full config, for --load-format dummy) with a trained test tokenizer, $V2L and
# $V3_4L: model configs for `bench one-batch` (V3 cut to 4 layers); `serve_and_wait FLAGS...` starts `mlaserve serve`
# on $M (port 30000, log $OUT/serve_$SERVE_TAG.log) and returns once it answers; `serving_run NAME` runs the
# concurrency-64 `bench serving` load against it.
set -uo pipefail
[ -d .whl ] && python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
M=/tmp/v2l; mkdir -p $M; cp mlaserve/tools/configs/deepseek-v2-lite.json $M/config.json
python3 -m mlaserve.tools.tokenizer $M > /dev/null
export MLASERVE_CACHE=${MLASERVE_CACHE:-/tmp/mlaserve-cache}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/env.txt" 2>&1
python3 -c "import xgrammar" > /dev/null 2>&1 || echo "no xgrammar on this machine (carry its wheel and apache-tvm-ffi's" \
  "in .whl): structured-output requests and tests abort" | tee -a "$OUT/env.txt"
V2L=mlaserve/tools/configs/deepseek-v2-lite.json
V3_4L=/tmp/v3_4l.json
python3 -c "import json; d=json.load(open('mlaserve/tools/configs/deepseek-v3.json')); d['num_hidden_layers']=4; json.dump(d, open('$V3_4L','w'))"

serve_and_wait() {
  python3 -m mlaserve.cli serve --model-path $M --load-format dummy --port 30000 "$@" \
    > "$OUT/serve_${SERVE_TAG:-0}.log" 2>&1 &
  for _ in $(seq 1 300); do
    curl -sf -m 60 http://127.0.0.1:30000/generate -H 'Content-Type: application/json' \
      -d '{"text": "Hello", "sampling_params": {"max_new_tokens": 1}}' > /dev/null 2>&1 && return 0
    sleep 0.5
  done
  return 1
}

serving_run() {  # serving_run NAME: bench serving's closed-loop load (conc 64) against the server, beside its own ITLs
  curl -s http://127.0.0.1:30000/metrics > /tmp/m0
  timeout 170 python3 -m mlaserve.cli bench serving --backend mlaserve --num-prompts 192 \
    --random-input-len 256 --random-output-len 128 --random-range-ratio 0.5 --request-rate inf --max-concurrency 64 \
    --tokenizer $M --disable-tqdm --output-file "$OUT/serving_$1.jsonl" > /dev/null 2>&1
  curl -s http://127.0.0.1:30000/metrics > /tmp/m1
  python3 benchmarks/serving_summary.py --last "$OUT/serving_$1.jsonl" "bench serving $1"
  python3 benchmarks/probe_stream_client.py --metrics-diff /tmp/m0 /tmp/m1
}

ab_v3_4l() {  # ab_v3_4l FN A B: FN TAG NAME ARGS... (a bench one-batch run under TAG) for V3 4L 1 x 4096 prefill as
  # A, B, A, B, then V3 4L decode (256 / 32, bs 1 16 64) under A and B once each
  local fn=$1 a=$2 b=$3 i=0 tag
  for tag in $a $b $a $b; do
    i=$((i + 1))
    $fn $tag prefill_v3_$i --model-config $V3_4L --batch-size 1 --input-len 4096 --output-len 4
  done
  for tag in $a $b; do
    $fn $tag decode_v3 --model-config $V3_4L --batch-size 1 16 64 --input-len 256 --output-len 32
  done
}
