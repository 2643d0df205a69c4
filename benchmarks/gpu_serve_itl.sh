#!/usr/bin/env bash
# Issue 15 serving targets at concurrency 64 (carry .whl): is the gap between the in-process scheduler
# (benchmarks/probe_closed_loop.py) and `bench serving` in the server or in the client? V2-Lite dummy weights, served
# with piecewise graphs (+ mixed chunk); the same closed-loop load (192 prompts of 128-256, 64-128 new, conc 64) from
# the bare asyncio client (benchmarks/probe_stream_client.py) and from `bench serving` (httpx), each beside the
# server's own inter-token histogram over its run.
#   bash benchmarks/gpu_serve_itl.sh [SERVER CONFIG NAMES: mixed plain]
source benchmarks/gpu_v2l_env.sh
for cfgname in ${@:-mixed plain}; do
  flags="--enable-piecewise-cuda-graph --enable-metrics"
  [ "$cfgname" = mixed ] && flags="$flags --enable-mixed-chunk"
  SERVE_TAG=$cfgname serve_and_wait --log-level warning $flags
  echo "### $cfgname ($flags)"
  python3 benchmarks/probe_stream_client.py --num 64 --conc 64 > /dev/null          # warm-up: the load's shapes
  for r in 1 2; do
    python3 benchmarks/probe_stream_client.py | tee -a "$OUT/bare_$cfgname.jsonl"
    curl -s http://127.0.0.1:30000/metrics > /tmp/m0
    timeout 170 python3 -m mlaserve.cli bench serving --backend mlaserve --num-prompts 192 \
      --random-input-len 256 --random-output-len 128 --random-range-ratio 0.5 --request-rate inf --max-concurrency 64 \
      --tokenizer $M --disable-tqdm --output-file "$OUT/serving_$cfgname.jsonl" > /dev/null 2>&1
    curl -s http://127.0.0.1:30000/metrics > /tmp/m1
    python3 benchmarks/serving_summary.py --last "$OUT/serving_$cfgname.jsonl" "bench serving $cfgname"
    python3 benchmarks/probe_stream_client.py --metrics-diff /tmp/m0 /tmp/m1
  done
  pkill -TERM -f "mlaserve.cli serve"; sleep 4
done
