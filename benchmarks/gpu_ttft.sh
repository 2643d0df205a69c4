#!/usr/bin/env bash
# TTFT at concurrency 1 on a fresh server (V2-Lite, dummy weights, --enable-piecewise-cuda-graph, --enable-metrics):
# two passes of `bench serving` (24 prompts of 128-256 tokens, 16 new tokens), each beside the server-side TTFT
# (mean of that pass, from the Prometheus histogram), then /generate with 200 token ids and one new token,
# non-streamed (urllib), as the floor of the server path. Carry .whl.
set -uo pipefail
[ -d .whl ] && python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site
M=/tmp/v2l; mkdir -p $M; cp mlaserve/tools/configs/deepseek-v2-lite.json $M/config.json
python3 -m mlaserve.tools.tokenizer $M > /dev/null
python3 -m mlaserve.cli serve --model-path $M --load-format dummy --port 30000 --enable-metrics \
  --enable-piecewise-cuda-graph ${FLAGS:-} > /tmp/serve.log 2>&1 &
for k in $(seq 1 300); do
  curl -sf -m 60 http://127.0.0.1:30000/generate -H 'Content-Type: application/json' \
    -d '{"text": "Hello", "sampling_params": {"max_new_tokens": 1}}' > /dev/null 2>&1 && break
  sleep 0.5
done
server_ttft() { curl -s http://127.0.0.1:30000/metrics | grep "time_to_first_token_seconds_\(sum\|count\)" | awk '{print $2}' | paste -sd' '; }
before=$(server_ttft)
for pass in 1 2; do
  timeout 120 python3 -m mlaserve.cli bench serving --backend mlaserve --num-prompts 24 --random-input-len 256 \
    --random-output-len 16 --random-range-ratio 0.5 --request-rate inf --max-concurrency 1 --tokenizer $M \
    --disable-tqdm 2>&1 | grep -A3 "TTFT (ms)" | grep "mean\|median" | tr -s ' ' | paste -sd' ' | sed "s/^/pass $pass client TTFT ms: /"
  after=$(server_ttft)
  python3 -c "a, b = '$before'.split(), '$after'.split(); print(f'pass $pass server TTFT mean: {(float(b[1]) - float(a[1])) / (float(b[0]) - float(a[0])) * 1e3:.1f} ms')"
  before=$after
done
python3 - <<'PY'
import json, random, statistics, time, urllib.request
rng = random.Random(0)
def one(ids):
    body = json.dumps({"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0}}).encode()
    r = urllib.request.Request("http://127.0.0.1:30000/generate", data=body, headers={"Content-Type": "application/json"})
    t = time.perf_counter(); urllib.request.urlopen(r).read(); return (time.perf_counter() - t) * 1e3
ts = [one([rng.randrange(10, 100000) for _ in range(200)]) for _ in range(20)]
print(f"/generate 200 random ids, 1 new token, not streamed: median {statistics.median(ts):.1f} ms, min {min(ts):.1f}")
PY
grep -h "captured piecewise" /tmp/serve.log | cut -c1-160
pkill -f "mlaserve.cli serve"
