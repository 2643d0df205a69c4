#!/usr/bin/env bash
# Device call (one GPU, < 9 min): where the time goes when the demo model is served (issue 13's concurrency-16
# anomaly, issue 15's TTFT at concurrency 1). Servers run eagle, plain, eagle (the Triton cache is warm for the
# second eagle); each gets a TTFT run (concurrency 1, one new token), then concurrency 16 twice, the second under
# py-spy (scheduler and HTTP/tokenizer process; speedscope files, all in profiles.tgz). Carry .whl (server
# deps + py-spy). RUNS picks the servers (default: eagle1 plain eagle2; nextn: EAGLE with the demo's MTP layer
# exported by `mlaserve export-nextn` as --speculative-draft-model-path). py-spy is not among
# ../shared/device/wheels.sh's packages: add it with `python3 -m pip download --only-binary=:all: --python-version 3.12
# --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 -d .whl py-spy`.
set -uo pipefail
[ -d .whl ] && python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site PATH=/tmp/site/bin:$PATH
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$OUT/gpu.txt"
bench() {  # $1 label, $2 conc, $3 prompts, $4 output len
  timeout 100 python3 -m mlaserve.cli bench serving --backend mlaserve --num-prompts $3 --random-input-len 128 \
    --random-output-len $4 --random-range-ratio 1.0 --request-rate inf --max-concurrency $2 --disable-tqdm \
    --output-file "$OUT/serving_$1.jsonl" > "$OUT/bench_$1.txt" 2>&1
  grep -E "Output throughput|Median TTFT|median|p99|Accept" "$OUT/bench_$1.txt" | tr -s ' ' | paste -sd'|' | sed "s/^/$1: /"
}
spy() {  # $1 pid, $2 file, $3 seconds (SPY=0: no profiles)
  [ "${SPY:-1}" = 1 ] || return 0
  py-spy record -p $1 -r 400 -d $3 --idle -f speedscope -o "$OUT/$2.json" > "$OUT/$2.log" 2>&1 &
}
probe() {  # $1 label, rest: serve flags
  local label=$1; shift
  python3 -m mlaserve.cli serve --port 30000 --log-level warning --cuda-graph-max-bs 16 "$@" > "$OUT/serve_$label.log" 2>&1 &
  local pid=$!
  for i in $(seq 1 180); do curl -sf -m 2 http://127.0.0.1:30000/health > /dev/null 2>&1 && break; sleep 1; done
  local sched=$(pgrep -P $pid -f spawn_main | head -1)
  echo "$label: up after ${i}s, main $pid scheduler $sched"
  bench ${label}_ttft 1 32 1
  spy $pid ${label}_ttft_main 6; spy $sched ${label}_ttft_sched 6; sleep 0.5
  bench ${label}_ttft_spy 1 48 1; wait_spies
  bench ${label}_16a 16 64 512
  spy $pid ${label}_16_main 4; spy $sched ${label}_16_sched 4; sleep 0.5
  bench ${label}_16b 16 64 512; wait_spies
  curl -s http://127.0.0.1:30000/get_server_info > "$OUT/info_$label.json"
  kill -TERM $pid; wait $pid
}
wait_spies() { sleep 1; while pgrep -x py-spy > /dev/null; do sleep 0.5; done; }
for run in ${RUNS:-eagle1 plain eagle2}; do
  case $run in
    nextn) python3 -m mlaserve.cli export-nextn --input-dir mlaserve/demo --output-dir /tmp/demo_nextn > /dev/null
           probe nextn --speculative-algorithm EAGLE --speculative-draft-model-path /tmp/demo_nextn ;;
    eagle*) probe $run --speculative-algorithm EAGLE ;;
    *) probe $run ;;
  esac
done
for f in "$OUT"/*_sched.json "$OUT"/*_main.json; do
  [ -f "$f" ] && { echo "### $(basename $f)"; python3 benchmarks/pyspy_summary.py "$f" 28 | cut -c1-150; }
done > "$OUT/pyspy_summary.txt" 2>&1
(cd "$OUT" && tar czf profiles.tgz --exclude pyspy_summary.txt *.json *.log *.txt *.jsonl && rm -f *.json *.log bench_*.txt serving_*.jsonl)
ls "$OUT"
