#!/usr/bin/env bash
# Device call (H100, < 5 min): --enable-mixed-chunk on the GPU.
#  1. GPU tests: processing mixed steps never syncs (tests/scheduler/test_overlap_sync.py, with the file's other
#     no-sync tests), the demo model with graphs + mixed chunks against the eager run (tests/test_combinations.py).
#  2. `mlaserve serve` on full-width DeepSeek-V2-Lite (dummy weights, own tokenizer), then `bench serving --backend
#     mlaserve` (ITL per generated token, from the native stream's token counts) at concurrency 64, in 256 / out 128,
#     for: the default scheduler, --enable-mixed-chunk, and both with --chunked-prefill-size 512. The issue's target
#     (issue 15): p99 ITL <= 3x the median at concurrency 64.
# Carry .whl (server deps). Results under $OUT: tests.txt, serving_<label>.jsonl, info_<label>.json, summary.txt.
set -uo pipefail
[ -d .whl ] && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
git log -1 --format='commit %H %cd' 2>/dev/null | tee -a "$OUT/gpu.txt"

if [ "${TESTS:-1}" = 1 ]; then      # TESTS=0: the serving runs only
  timeout 120 python3 -m pytest -q tests/scheduler/test_overlap_sync.py tests/test_combinations.py \
    -k "sync or graphs-mixed-chunk" -p no:cacheprovider > "$OUT/tests.txt" 2>&1
  echo "tests: exit $? ($(tail -1 "$OUT/tests.txt"))" | tee -a "$OUT/summary.txt"
fi

M=/tmp/v2l; mkdir -p $M; cp ${CONFIG:-mlaserve/tools/configs/deepseek-v2-lite.json} $M/config.json
python3 -m mlaserve.tools.tokenizer $M > /dev/null
serve_and_bench() {  # $1: label, rest: extra serve flags
  local label=$1; shift
  python3 -m mlaserve.cli serve --model-path $M --load-format dummy --port 30000 --log-level warning "$@" \
    > "$OUT/serve_$label.log" 2>&1 &
  local pid=$!
  for i in $(seq 1 180); do
    curl -sf -m 60 http://127.0.0.1:30000/generate -H 'Content-Type: application/json' \
      -d '{"text": "Hello", "sampling_params": {"max_new_tokens": 1}}' > /dev/null 2>&1 && break
    sleep 0.5
  done
  timeout 60 python3 -m mlaserve.cli bench serving --backend mlaserve --num-prompts ${PROMPTS:-192} \
    --random-input-len 256 --random-output-len 128 --random-range-ratio ${RATIO:-1.0} --request-rate inf \
    --max-concurrency ${CONC:-64} --tokenizer $M --disable-tqdm --output-file "$OUT/serving_$label.jsonl" \
    > "$OUT/bench_$label.txt" 2>&1
  curl -s -m 10 http://127.0.0.1:30000/get_server_info > "$OUT/info_$label.json"
  kill -TERM $pid; wait $pid; echo "$label: serve exit code $?"
}
for run in ${RUNS:-default mixed chunk512 mixed-chunk512}; do
  case $run in
    default) serve_and_bench default ;;
    mixed) serve_and_bench mixed --enable-mixed-chunk ;;
    chunk512) serve_and_bench chunk512 --chunked-prefill-size 512 ;;
    mixed-chunk512) serve_and_bench mixed-chunk512 --enable-mixed-chunk --chunked-prefill-size 512 ;;
    # concurrency 1 and 16 (TTFT vs the prefill time, TPOT vs the one-batch step): 16 prompts a level
    levels) CONC="1 16" PROMPTS=16 serve_and_bench levels --enable-mixed-chunk --chunked-prefill-size 512 ;;
  esac
done
python3 - "$OUT" <<'PY' | tee -a "$OUT/summary.txt"
import glob, json, sys
out = sys.argv[1]
for f in sorted(glob.glob(out + "/serving_*.jsonl")):
    label = f.split("serving_")[1][:-6]
    try:
        info = json.load(open(f"{out}/info_{label}.json"))
    except (OSError, ValueError):
        info = {}
    for line in open(f):
        r = json.loads(line)
        ratio = r["p99_itl_ms"] / r["median_itl_ms"] if r["median_itl_ms"] else float("nan")
        print(f"{label:>15} conc {r['max_concurrency']:>3}: out {r['output_throughput']:8.1f} tok/s, median TTFT "
              f"{r['median_ttft_ms']:7.1f} ms, TPOT median {r['median_tpot_ms']:6.2f} p99 {r['p99_tpot_ms']:6.2f} ms, "
              f"ITL/token median {r['median_itl_ms']:6.2f} p99 {r['p99_itl_ms']:7.2f} ms (p99/median {ratio:.2f}), "
              f"completed {r['completed']}/{r['num_prompts']}, mixed steps {info.get('mixed_steps')} of "
              f"{info.get('steps')}")
PY
