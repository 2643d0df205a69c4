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
    serving_run $cfgname
  done
  pkill -TERM -f "mlaserve.cli serve"; sleep 4
done
