#!/usr/bin/env bash
# TTFT at concurrency 1 by request path (issue 15): a V2-Lite server (dummy weights, piecewise graphs, metrics) and
# benchmarks/probe_ttft_paths.py (ids / text, streamed or not, 1 / 16 new tokens, greedy / sampled). Carry .whl.
source benchmarks/gpu_v2l_env.sh
python3 -m mlaserve.cli serve --model-path $M --load-format dummy --port 30000 --enable-metrics \
  --enable-piecewise-cuda-graph ${FLAGS:-} > "$OUT/serve.log" 2>&1 &
for k in $(seq 1 300); do
  curl -sf -m 60 http://127.0.0.1:30000/generate -H 'Content-Type: application/json' \
    -d '{"text": "Hello", "sampling_params": {"max_new_tokens": 1}}' > /dev/null 2>&1 && break
  sleep 0.5
done
timeout 200 python3 benchmarks/probe_ttft_paths.py --rounds ${ROUNDS:-12} 2>&1 | tee "$OUT/ttft_paths${TAG:-}.txt"
pkill -f "mlaserve.cli serve"; sleep 2
