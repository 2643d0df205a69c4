#!/usr/bin/env bash
# Device call (one GPU, < 9 min): speculation through the real server with the overlap scheduler (the default), the
# demo model: `mlaserve bench serving` at concurrency 1 and 16 with and without --speculative-algorithm EAGLE, then
# the tree drafts' throughput (`spec_decode.py demo 512 tree`). Carry .whl (server deps). Writes under $OUT.
# RUNS="plain eagle" picks the servers; TREE_S=0 skips the tree run.
set -uo pipefail
[ -d .whl ] && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$OUT/gpu.txt"
serve_and_bench() {  # $1: label, rest: extra serve flags
  local label=$1; shift
  python3 -m mlaserve.cli serve --port 30000 --log-level warning --cuda-graph-max-bs 16 "$@" > "$OUT/serve_$label.log" 2>&1 &
  local pid=$!
  for i in $(seq 1 180); do curl -sf -m 2 http://127.0.0.1:30000/health > /dev/null 2>&1 && break; sleep 1; done
  for conc in 1 16; do
    timeout 100 python3 -m mlaserve.cli bench serving --backend mlaserve --num-prompts $((conc * 4 > 16 ? conc * 4 : 16)) \
      --random-input-len 128 --random-output-len 512 --random-range-ratio 1.0 --request-rate inf --max-concurrency $conc \
      --disable-tqdm --output-file "$OUT/serving_$label.jsonl" > "$OUT/bench_${label}_$conc.txt" 2>&1
  done
  curl -s http://127.0.0.1:30000/get_server_info > "$OUT/info_$label.json"
  kill -TERM $pid; wait $pid
}
for run in ${RUNS:-plain eagle}; do
  case $run in
    plain) serve_and_bench plain ;;
    eagle) serve_and_bench eagle --speculative-algorithm EAGLE ;;
  esac
done
python3 benchmarks/serving_summary.py "$OUT"
[ "${TREE_S:-200}" -gt 0 ] && timeout ${TREE_S:-200} python3 benchmarks/spec_decode.py demo 512 tree 2>&1 | tr '\r' '\n' | grep '^{' | tee "$OUT/tree.jsonl" | cut -c1-260
