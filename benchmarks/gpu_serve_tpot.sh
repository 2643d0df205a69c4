#!/usr/bin/env bash
# Issue 15's TPOT target at concurrency 64 (carry .whl): `bench serving` with fresh text prompts against the server
# with piecewise graphs + mixed chunk (the load of gpu_serve_itl.sh, run 1), then the one-batch bs-64 step it is
# compared with, in the same call. V2-Lite dummy weights.
source benchmarks/gpu_v2l_env.sh
SERVE_TAG=mixed serve_and_wait --log-level warning --enable-piecewise-cuda-graph --enable-metrics --enable-mixed-chunk
python3 benchmarks/probe_stream_client.py --num 64 --conc 64 > /dev/null          # warm-up: the load's shapes
serving_run mixed
pkill -TERM -f "mlaserve.cli serve"; sleep 4
timeout 100 python3 -m mlaserve.cli bench one-batch --load-format dummy --input-len 256 --output-len 32 \
  --model-config $V2L --batch-size 64 --output-file "$OUT/one_batch_bs64.md" 2>&1 | grep "^| mlaserve"
