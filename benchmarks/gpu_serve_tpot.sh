#!/usr/bin/env bash
# Issue 15's TPOT target at concurrency 64 (carry .whl): `bench serving` with fresh text prompts against the server
# with piecewise graphs + mixed chunk (the load of gpu_serve_itl.sh, run 1), then the one-batch bs-64 step it is
# compared with, in the same call. V2-Lite dummy weights.
source benchmarks/gpu_v2l_env.sh
SERVE_TAG=mixed serve_and_wait --log-level warning --enable-piecewise-cuda-graph --enable-metrics --enable-mixed-chunk
python3 benchmarks/probe_stream_client.py --num 64 --conc 64 > /dev/null          # warm-up: the load's shapes
curl -s http://127.0.0.1:30000/metrics > /tmp/m0
timeout 170 python3 -m mlaserve.cli bench serving --backend mlaserve --num-prompts 192 \
  --random-input-len 256 --random-output-len 128 --random-range-ratio 0.5 --request-rate inf --max-concurrency 64 \
  --tokenizer $M --disable-tqdm --output-file "$OUT/serving_mixed.jsonl" > /dev/null 2>&1
curl -s http://127.0.0.1:30000/metrics > /tmp/m1
python3 benchmarks/serving_summary.py --last "$OUT/serving_mixed.jsonl" "bench serving mixed"
python3 benchmarks/probe_stream_client.py --metrics-diff /tmp/m0 /tmp/m1
pkill -TERM -f "mlaserve.cli serve"; sleep 4
timeout 100 python3 -m mlaserve.cli bench one-batch --load-format dummy --input-len 256 --output-len 32 \
  --model-config $V2L --batch-size 64 --output-file "$OUT/one_batch_bs64.md" 2>&1 | grep "^| mlaserve"
