#!/usr/bin/env bash
# Device call (one H100, < 8 min): why the ablation's TPS@1 on V3 4L FP8 was 52-66 tok/s against 442 in one-batch.
# Hypothesis (benchmarks/probe_first_launch.py on the CPU): the first radix hit of a prompt (a 1-token extend over
# a cached prefix) launches Triton kernels no earlier request did (mla_prefill's prefix attention and merge), which
# JIT-compile inside that request; ablation.py's timed request was that first hit (one 8-token warm-up before it).
# Per server: the ablation's prompt five times, non-streamed, timed from the client, with the Triton kernels
# compiled during each request (new entries in a TRITON_CACHE_DIR shared by every server of this call). Confirmed
# if r2 (the first hit) carries seconds and compiles that r3 / r5 do not, r3 / r5 run near the one-batch step, and
# --disable-radix-cache moves nothing to r2; refuted if r3 / r5 stay at ~15 ms a token (then a per-token cost).
# Servers now send warm-up requests before ready (a prompt and its prefix hit; --skip-server-warmup skips them):
# "cold" skips them (the first hit should then carry the compiles), "plain" has them (r2 should not).
# Usage (repo root, carry .whl): bash benchmarks/gpu_tps_probe.sh   (RUNS="cold plain nextn compile" by default)
set -uo pipefail
[ -d .whl ] && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site TRITON_CACHE_DIR=/tmp/tps_triton_cache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" "$TRITON_CACHE_DIR"
M=${MODEL:-/tmp/v3_4l}                   # MODEL: a checkpoint dir of your own (a CPU dry run: a small one)
if [ -z "${MODEL:-}" ]; then
  mkdir -p $M
  python3 -c "import json; d=json.load(open('mlaserve/tools/configs/deepseek-v3.json')); d['num_hidden_layers']=4; json.dump(d, open('$M/config.json','w'))"
  python3 -m mlaserve.tools.tokenizer $M > /dev/null
fi
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$OUT/gpu.txt" 2>&1
git rev-parse HEAD > "$OUT/commit.txt" 2>/dev/null
PORT=30124
END=$(( $(date +%s) + ${LIMIT:-430} ))      # the runs stop starting servers past this (the call stays < 8 min)
left() { echo $(( END - $(date +%s) )); }
probe() {  # $1: label, rest: extra serve flags; SERVE_ARGS for every run (a small graph ladder: bs 1 is all it times)
  local label=$1; shift
  local t0=$(date +%s) budget=$(left)
  if [ "$budget" -lt 60 ]; then echo "$label: skipped ($budget s left)" | tee -a "$OUT/startup.txt"; return; fi
  python3 -m mlaserve.cli serve --model-path $M --load-format dummy --port $PORT --log-level info \
    ${SERVE_ARGS---cuda-graph-max-bs 8} "$@" > "$OUT/serve_$label.log" 2>&1 &
  local pid=$!
  for i in $(seq 1 $(( budget - 30 < ${START_S:-180} ? budget - 30 : ${START_S:-180} ))); do
    curl -sf -m 2 http://127.0.0.1:$PORT/health > /dev/null 2>&1 && break
    kill -0 $pid 2>/dev/null || break
    sleep 1
  done
  if ! curl -sf -m 2 http://127.0.0.1:$PORT/health > /dev/null 2>&1; then
    echo "$label ($*): not healthy after $(( $(date +%s) - t0 )) s: $(tail -1 "$OUT/serve_$label.log" | cut -c1-200)" \
      | tee -a "$OUT/startup.txt"
    kill -TERM $pid 2>/dev/null; wait $pid 2>/dev/null; return
  fi
  echo "$label ($*): healthy after $(( $(date +%s) - t0 )) s" | tee -a "$OUT/startup.txt"
  local req_s=$(left); req_s=$(( req_s < ${REQ_S:-90} ? (req_s > 20 ? req_s : 20) : ${REQ_S:-90} ))
  timeout $req_s python3 - "$label" "$PORT" "${NEW:-256}" <<'PY' | tee -a "$OUT/tps_probe.jsonl"
import json, os, sys, time
import httpx
sys.path.insert(0, "benchmarks")
from ablation import QUERY
label, url, new = sys.argv[1], f"http://127.0.0.1:{sys.argv[2]}", int(sys.argv[3])
cache = os.environ["TRITON_CACHE_DIR"]
model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
info = httpx.get(f"{url}/get_server_info", timeout=30).json()
kernels = lambda: len(os.listdir(cache))
runs = {}
for name, n in [("r1", new), ("r2", new), ("r3", new), ("r4", 1), ("r5", new)]:
    k0, t0 = kernels(), time.perf_counter()
    body = {"model": model, "prompt": QUERY, "max_tokens": n, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=300).json()
    dt = time.perf_counter() - t0
    u = r["usage"]
    runs[name] = dt
    print(json.dumps({"label": label, "req": name, "max_tokens": n, "completion_tokens": u["completion_tokens"],
                      "cached_tokens": (u.get("prompt_tokens_details") or {}).get("cached_tokens"),
                      "seconds": round(dt, 4), "tok_s": round(u["completion_tokens"] / dt, 1),
                      "triton_compiles": kernels() - k0}))
# r6: the same request streamed through the native /generate: the time between snapshots per new token
body = {"text": QUERY, "stream": True, "sampling_params": {"max_new_tokens": new, "temperature": 0, "ignore_eos": True}}
marks, k0, t0 = [], kernels(), time.perf_counter()
with httpx.stream("POST", f"{url}/generate", json=body, timeout=300) as resp:
    for line in resp.iter_lines():
        if line.startswith("data: {"):
            marks.append((time.perf_counter() - t0, len(json.loads(line[6:])["output_ids"])))
gaps = sorted((b[0] - a[0]) / (b[1] - a[1]) * 1e3 for a, b in zip(marks, marks[1:]) if b[1] > a[1])
pick = lambda q: round(gaps[min(len(gaps) - 1, int(q * len(gaps)))], 3) if gaps else None
print(json.dumps({"label": label, "req": "r6 stream", "ttft_ms": round(marks[0][0] * 1e3, 1) if marks else None,
                  "tokens": marks[-1][1] if marks else 0, "itl_ms_per_token_p50": pick(0.5),
                  "itl_ms_per_token_p99": pick(0.99), "itl_ms_max": pick(1.0), "triton_compiles": kernels() - k0}))
info = httpx.get(f"{url}/get_server_info", timeout=30).json()       # now with the run's stats
decode_ms = (runs["r5"] - runs["r4"]) / (new - 1) * 1e3            # r5 and r4: the same path, 1 vs `new` tokens
keys = ("disable_cuda_graph", "cuda_graph_bs", "torch_compile_max_bs", "disable_overlap_schedule", "context_length",
        "vocab_size", "speculative_algorithm", "steps", "generation_tokens", "avg_spec_accept_length")
print(json.dumps({"label": label, "summary": True, "decode_ms_per_token": round(decode_ms, 3),
                  "ttft_hit_ms": round(runs["r4"] * 1e3, 1), "r2_minus_r3_s": round(runs["r2"] - runs["r3"], 3),
                  **{k: info.get(k) for k in keys}}))
PY
  kill -TERM $pid 2>/dev/null; wait $pid 2>/dev/null
}
for run in ${RUNS:-cold plain nextn compile}; do
  case $run in
    cold) probe cold --skip-server-warmup ;;
    plain) probe plain ;;
    norad) probe norad --disable-radix-cache ;;
    nextn) probe nextn --speculative-algorithm EAGLE ;;
    compile) probe compile --enable-torch-compile ;;
  esac
done
grep -h "captured\|resolved:" "$OUT"/serve_*.log | cut -c1-200 > "$OUT/server_lines.txt"
python3 - "$OUT/tps_probe.jsonl" <<'PY'
import json, sys
rows = [json.loads(x) for x in open(sys.argv[1]) if x.startswith("{")]
for r in rows:
    if r.get("req") == "r6 stream":
        print(f"{r['label']:>8} r6 streamed: TTFT {r['ttft_ms']} ms, ITL per token p50 {r['itl_ms_per_token_p50']} / "
              f"p99 {r['itl_ms_per_token_p99']} / max {r['itl_ms_max']} ms, {r['triton_compiles']} Triton compiles")
    elif r.get("summary"):
        print(f"{r['label']:>8} decode {r['decode_ms_per_token']} ms/token, TTFT (hit) {r['ttft_hit_ms']} ms, "
              f"r2 - r3 {r['r2_minus_r3_s']} s, graphs off {r['disable_cuda_graph']}, {r['steps']} steps for "
              f"{r['generation_tokens']} tokens (accept length {r['avg_spec_accept_length']})")
    else:
        print(f"{r['label']:>8} {r['req']} {r['completion_tokens']:>3} tok, cached {r['cached_tokens']}, "
              f"{r['seconds']:.3f} s, {r['tok_s']} tok/s, {r['triton_compiles']} Triton compiles")
PY
