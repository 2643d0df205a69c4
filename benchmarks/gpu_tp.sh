#!/usr/bin/env bash
# Device call for tensor parallelism (nvidia-h200-x2), in parts (default: all, in this order):
#   allreduce   the all-reduce alone (NCCL, pull and push peer kernels, in a CUDA graph)
#   one-batch   V2-Lite tp 1 vs tp 2 (the default peer settings; then MLASERVE_PEER_PUSH=1 too where PUSH_ONE_BATCH=1)
#   push        V2-Lite tp 2: MLASERVE_PEER_PUSH=0 (pull kernel only), auto (push up to 4096 elements; the default since 2026-11-29),
#               then auto with MLASERVE_KERNEL_SUMS=1 (the sums inside the router and the one-token fused MoE), each
#               run's whole log kept; a run still going after 150 s gets `kill -USR1` (every rank prints its Python
#               stacks to the log; each rank also prints them at 120 s unasked), then is killed; PUSH_RULES="auto,0 auto,1" picks rules (PUSH,SUMS)
#   v3          V3 full width FP8: 4 layers at tp 1 and tp 2, then $V3_LAYERS (20; 8 on H100s) at tp 2
#   stress      benchmarks/peer_stress.py: the peer kernels in a decode's order (bs 1 with in-kernel sums, in and out
#               of a CUDA graph, then bs 16 / 64 pull calls, twice), then the same with the push kernel (--sums 0)
#   tests-tp    the GPU-marked tests of test_peer.py and test_tensor_parallel.py only
#   tests       the GPU-marked tests of tests/distributed and the parallel server
#   startup     startup to first served token at tp 2
# Usage (repo root, on the GPU machine, carry .whl): bash benchmarks/gpu_tp.sh [PART ...]
set -uo pipefail
[ -d .whl ] && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD MLASERVE_CACHE=/tmp/mlaserve-cache
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1   # never NVLink multicast
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PARTS=${*:-allreduce one-batch v3 tests startup}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/env.txt"
nvidia-smi topo -m >> "$OUT/env.txt" 2>&1
B="python3 -m mlaserve.cli bench one-batch --load-format dummy"
# tree PID: PID and its descendants (only this script's processes: another job may run beside it, gpu_jobs.sh)
tree() { local c; echo $1; for c in $(ps -o pid= --ppid $1 2> /dev/null); do tree $c; done; }
# run_or_dump SECONDS LOG CMD...: CMD with its output in LOG; past SECONDS its processes print their stacks (USR1),
# then are killed
run_or_dump() {
  local secs=$1 log=$2; shift 2
  "$@" > "$log" 2>&1 &
  local pid=$! i
  for i in $(seq 1 "$secs"); do kill -0 $pid 2> /dev/null || break; sleep 1; done
  if kill -0 $pid 2> /dev/null; then
    echo "still running after $secs s: stacks below" >> "$log"
    local all; all=$(tree $pid); kill -USR1 $all 2> /dev/null; sleep 5; kill -KILL $(tree $pid) $all 2> /dev/null
  fi
  wait $pid; echo "exit code $?" >> "$log"
}
for PART in $PARTS; do
  echo "== $PART $(date +%T)"
  case $PART in
    allreduce)
      timeout 90 python3 benchmarks/allreduce.py --tp-size 2 | tee "$OUT/allreduce.md" ;;
    one-batch)
      C="--model-config mlaserve/tools/configs/deepseek-v2-lite.json --batch-size 1 16 64 --input-len 256 --output-len 32"
      timeout 200 $B $C --tp-size 1 2 --output-file "$OUT/one_batch.md" 2>&1 | grep "^|" | tail -7
      [ -n "${PUSH_ONE_BATCH:-}" ] &&    # push for every call of <= 16 rows (A/B): its run only where asked
        MLASERVE_PEER_PUSH=1 timeout 120 $B $C --tp-size 2 --output-file "$OUT/one_batch_push.md" 2>&1 | grep "^|" | tail -4 ;;
    push)       # tp 2 with each rule, back to back on the same machine
      C="--model-config mlaserve/tools/configs/deepseek-v2-lite.json --batch-size 1 16 64 --input-len 256 --output-len 32"
      for R in ${PUSH_RULES:-0,0 auto,0 auto,1}; do
        set -- ${R/,/ }
        MLASERVE_PEER_PUSH=$1 MLASERVE_KERNEL_SUMS=$2 MLASERVE_DUMP_STACKS_EVERY=120 run_or_dump 150 "$OUT/push$1_sums$2.log" \
          $B $C --tp-size 2 --output-file "$OUT/one_batch_push$1_sums$2.md"
        echo "MLASERVE_PEER_PUSH=$1 MLASERVE_KERNEL_SUMS=$2"; grep "^|\|still running\|exit code" "$OUT/push$1_sums$2.log" | tail -4
      done ;;
    v3)         # 4 layers fit one GPU: tp 1 against tp 2; then $V3_LAYERS at tp 2 (20 fit an H200, 8 an H100)
      python3 benchmarks/v3_config.py --layers 4 --out /tmp/v3_4l.json
      # the whole output kept (the seventh session's 20-layer run ended without a row and without a visible cause)
      timeout 200 $B --model-config /tmp/v3_4l.json --batch-size 1 16 64 --input-len 256 --output-len 32 --tp-size 1 2 \
        --output-file "$OUT/one_batch_v3_4l.md" > "$OUT/one_batch_v3_4l.log" 2>&1
      echo "exit code $?"; grep "^|" "$OUT/one_batch_v3_4l.log" | tail -7
      python3 benchmarks/v3_config.py --layers ${V3_LAYERS:-20} --out /tmp/v3_tp.json
      timeout 240 $B --model-config /tmp/v3_tp.json --batch-size 1 16 64 --input-len 256 --output-len 32 --tp-size 2 \
        --output-file "$OUT/one_batch_v3.md" > "$OUT/one_batch_v3.log" 2>&1
      echo "exit code $?"; grep "^|\|rror" "$OUT/one_batch_v3.log" | tail -6 ;;
    stress)
      for S in 1 0; do
        run_or_dump ${STRESS_LIMIT:-280} "$OUT/stress_sums$S.log" python3 benchmarks/peer_stress.py --sums $S --phase-timeout 60
        echo "peer_stress --sums $S"; grep "^round\|^ok\|rror\|still running\|exit code" "$OUT/stress_sums$S.log" | tail -12
      done ;;
    tests-tp)   # the peer kernels (push, split rows) and tp 2 == tp 1 with graphs (the fold in the fused MoE)
      timeout ${TESTS_TIMEOUT:-240} python3 -m pytest -q -p no:cacheprovider -m "multi_gpu or gpu" \
        tests/distributed/test_peer.py tests/distributed/test_tensor_parallel.py 2>&1 | tail -8 | tee "$OUT/tests_tp.txt" ;;
    tests)
      timeout ${TESTS_TIMEOUT:-400} python3 -m pytest -q -p no:cacheprovider -m "multi_gpu or gpu" tests/distributed \
        tests/server/test_parallel_server.py 2>&1 | tail -15 | tee "$OUT/tests.txt" ;;
    startup)
      M=/tmp/v2l; mkdir -p $M; cp mlaserve/tools/configs/deepseek-v2-lite.json $M/config.json
      python3 -m mlaserve.tools.tokenizer $M > /dev/null
      t0=$(date +%s.%N)
      python3 -m mlaserve.cli serve --model-path $M --load-format dummy --tp-size 2 --port ${PORT:-30000} --log-level warning \
        > "$OUT/serve_tp2.log" 2>&1 &
      pid=$!
      up="did not serve"
      for i in $(seq 1 480); do
        curl -sf -m 60 http://127.0.0.1:${PORT:-30000}/generate -H 'Content-Type: application/json' \
          -d '{"text": "Hello", "sampling_params": {"max_new_tokens": 1}}' > /dev/null 2>&1 && { up=served; break; }
        kill -0 $pid 2> /dev/null || break
        sleep 0.5
      done
      echo "tp 2: $up, $(python3 -c "import time; print(round(time.time() - $t0, 1))") s after start" \
        | tee "$OUT/startup.txt"
      kill -TERM $pid; wait $pid; echo "serve exit code $?" | tee -a "$OUT/startup.txt" ;;
    *) echo "unknown part $PART"; exit 2 ;;
  esac
done
