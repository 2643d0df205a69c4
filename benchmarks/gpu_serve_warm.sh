#!/usr/bin/env bash
# Device call (H100, < 9 min): serving figures with a cold and a warm pass on the same server, to separate JIT
# compiles of new batch shapes (first pass) from the steady state (second pass).
#  1. Full-width V2-Lite (dummy weights, own tokenizer): `bench one-batch` bs 1 in 256 (the prefill TTFT is held
#     against); then per server (default, --enable-mixed-chunk): concurrency 1 (16 prompts, TTFT), concurrency 64
#     twice (192 prompts, in 256 / out 128).
#     V2L_RUNS picks the servers (default "default mixed"; mixedN adds --chunked-prefill-size N); DEMO_REPS=""
#     skips part 2.
#  2. The demo model, plain and EAGLE (3, 1, 4) alternating twice: concurrency 16 twice each (in 128 / out 512).
# Carry .whl. Returns serving.tgz and summary.txt (one line per pass).
set -uo pipefail
[ -d .whl ] && python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v "Target directory"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; W=/tmp/w; mkdir -p $W
nvidia-smi --query-gpu=name --format=csv,noheader > $W/gpu.txt
M=/tmp/v2l; mkdir -p $M; cp mlaserve/tools/configs/deepseek-v2-lite.json $M/config.json
python3 -m mlaserve.tools.tokenizer $M > /dev/null
[ "${ONE_BATCH:-1}" = 1 ] && timeout 240 python3 -m mlaserve.cli bench one-batch --load-format dummy --model-config $M/config.json --batch-size 1 \
  --input-len 256 --output-len 8 > $W/v2l_one_batch.txt 2>&1; tail -6 $W/v2l_one_batch.txt
bench() {  # $1 label, $2 conc, $3 prompts, $4 in, $5 out, rest: extra bench flags
  local label=$1 conc=$2 n=$3 in=$4 out=$5; shift 5
  timeout 150 python3 -m mlaserve.cli bench serving --backend mlaserve --num-prompts $n --random-input-len $in \
    --random-output-len $out --random-range-ratio 1.0 --request-rate inf --max-concurrency $conc --disable-tqdm \
    --output-file $W/serving_$label.jsonl "$@" > $W/bench_$label.txt 2>&1
  python3 benchmarks/serving_summary.py --last $W/serving_$label.jsonl $label | tee -a $W/summary.txt
}
server() {  # $1 label, rest: serve flags; waits for the first served token
  local label=$1; shift
  python3 -m mlaserve.cli serve --port 30000 --log-level warning "$@" > $W/serve_$label.log 2>&1 &
  SPID=$!
  local i; for i in $(seq 1 240); do
    curl -sf -m 60 http://127.0.0.1:30000/generate -H 'Content-Type: application/json' \
      -d '{"text": "Hello", "sampling_params": {"max_new_tokens": 1}}' > /dev/null 2>&1 && break
    sleep 0.5
  done
}
stop() { curl -s -m 10 http://127.0.0.1:30000/get_server_info > $W/info_$1.json; kill -TERM $SPID; wait $SPID; }
for run in ${V2L_RUNS:-default mixed}; do
  case $run in
    default) flags="" ;; mixed) flags="--enable-mixed-chunk" ;;
    mixed[0-9]*) flags="--enable-mixed-chunk --chunked-prefill-size ${run#mixed}" ;;   # e.g. mixed2048
  esac
  server v2l_$run --model-path $M --load-format dummy $flags
  bench v2l_${run}_c1 1 16 256 128 --tokenizer $M
  bench v2l_${run}_c64a 64 192 256 128 --tokenizer $M
  bench v2l_${run}_c64b 64 192 256 128 --tokenizer $M
  stop v2l_$run
done
for rep in ${DEMO_REPS-1 2}; do
  for run in plain eagle; do
    flags=""; [ $run = eagle ] && flags="--speculative-algorithm EAGLE"
    server demo_${run}$rep --cuda-graph-max-bs 16 $flags
    bench demo_${run}${rep}_c16a 16 64 128 512
    bench demo_${run}${rep}_c16b 16 64 128 512
    stop demo_${run}$rep
  done
done
(cd $W && tar czf "$OUT/serving.tgz" .) && cp $W/summary.txt $W/v2l_one_batch.txt "$OUT/"
