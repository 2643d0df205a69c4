#!/usr/bin/env bash
# Issue 12 on nvidia-h200-x2 (and issue 18 with GPUS=8): DP attention and EP against plain TP over $GPUS GPUs (default
# 2). DeepSeek-V3 full width, block FP8, $V3_LAYERS layers (default 12: ~68 GB of weights per rank at tp 2, the rest
# for graphs and the KV pool; 61 is the whole model), dummy weights, our tokenizer.
#   bash benchmarks/gpu_dp_ep.sh collectives   the gather + scatter vs tp's two all-reduces per layer (dp_collectives.py)
#   bash benchmarks/gpu_dp_ep.sh serve A B ..  for each configuration named (tp tp-ep dp dp-ep dp-ep-a2a: N = $GPUS
#                                              ranks, DP attention with N groups of one rank): start the server,
#                                              time it to the first served token, read its KV capacity, run
#                                              `bench serving` random 256 in / 128 out at $CONCURRENCY (16 128 512),
#                                              $PROMPTS_X (2) x concurrency prompts a level, at least 64
# One call can hold two configurations (startup ~1-2 min each). Results under $OUT: serving_NAME.jsonl,
# capacity.txt (KV tokens and startup per configuration), serve_NAME.log, and the summary on stdout.
# CPU dry run of the plumbing: DRY_CPU=1 V3_LAYERS=2 CONCURRENCY="2 4" NUM_PROMPTS=8 bash benchmarks/gpu_dp_ep.sh serve dp
set -uo pipefail
[ -d .whl ] && python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site MLASERVE_CACHE=${MLASERVE_CACHE:-/tmp/mlaserve-cache}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1   # never NVLink multicast
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PART=${1:-collectives}; shift || true
PORT=${PORT:-30000}
N=${GPUS:-2}
CONCURRENCY=${CONCURRENCY:-16 128 512}
if [ -z "${DRY_CPU:-}" ]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/env.txt" 2>&1
fi

if [ "$PART" = collectives ]; then
  timeout 120 python3 benchmarks/dp_collectives.py --tp-size $N $([ -n "${DRY_CPU:-}" ] && echo --cpu) \
    2>&1 | tee "$OUT/dp_collectives.md"
  exit 0
fi

M=/tmp/v3_dp; mkdir -p $M
if [ -n "${DRY_CPU:-}" ]; then     # a small V3-shape config (fp32 CPU ranks): the plumbing, not the figures
  python3 benchmarks/v3_config.py --layers ${V3_LAYERS:-2} --tiny --out $M/config.json
  DEVICE_FLAGS="--device cpu"
else
  python3 benchmarks/v3_config.py --layers ${V3_LAYERS:-12} --out $M/config.json
  DEVICE_FLAGS=""
fi
python3 -m mlaserve.tools.tokenizer $M > /dev/null

flags_of() {
  case $1 in
    tp) echo "--tp-size $N" ;;
    tp-ep) echo "--tp-size $N --ep-size $N" ;;
    dp) echo "--tp-size $N --dp-size $N --enable-dp-attention" ;;
    dp-ep) echo "--tp-size $N --dp-size $N --enable-dp-attention --ep-size $N" ;;
    dp-ep-a2a) echo "--tp-size $N --dp-size $N --enable-dp-attention --ep-size $N --moe-dispatch all_to_all" ;;
    *) echo "unknown configuration $1" >&2; return 1 ;;
  esac
}

for NAME in "$@"; do
  FLAGS=$(flags_of "$NAME") || exit 1
  t0=$(date +%s.%N)
  python3 -m mlaserve.cli serve --model-path $M --load-format dummy --port $PORT $DEVICE_FLAGS $FLAGS \
    > "$OUT/serve_$NAME.log" 2>&1 &
  pid=$!
  up=""
  for _ in $(seq 1 480); do
    curl -sf -m 60 http://127.0.0.1:$PORT/generate -H 'Content-Type: application/json' \
      -d '{"text": "Hello", "sampling_params": {"max_new_tokens": 1}}' > /dev/null 2>&1 && { up=1; break; }
    kill -0 $pid 2> /dev/null || break
    sleep 0.5
  done
  if [ -z "$up" ]; then
    echo "$NAME ($FLAGS): did not start; last log line: $(tail -1 "$OUT/serve_$NAME.log")" | tee -a "$OUT/capacity.txt"
    kill -TERM $pid 2> /dev/null; wait $pid 2> /dev/null
    continue
  fi
  startup=$(python3 -c "import time; print(round(time.time() - $t0, 1))")
  curl -s http://127.0.0.1:$PORT/get_server_info | python3 -c "
import json, sys; i = json.load(sys.stdin)
print(f\"$NAME ($FLAGS): KV capacity {i['max_total_tokens']} tokens, startup to first served token $startup s\")" \
    | tee -a "$OUT/capacity.txt"
  for c in $CONCURRENCY; do
    n=${NUM_PROMPTS:-$((c * ${PROMPTS_X:-2} > 64 ? c * ${PROMPTS_X:-2} : 64))}
    timeout 300 python3 -m mlaserve.cli bench serving --backend mlaserve --port $PORT --num-prompts $n \
      --random-input-len 256 --random-output-len 128 --random-range-ratio 1 --request-rate inf --max-concurrency $c \
      --tokenizer $M --disable-tqdm --output-file "$OUT/serving_$NAME.jsonl" > /dev/null 2>&1 \
      || echo "$NAME conc $c: bench serving failed (exit $?)" | tee -a "$OUT/capacity.txt"
  done
  kill -TERM $pid; wait $pid; echo "$NAME: server exit code $?" >> "$OUT/capacity.txt"
done
python3 benchmarks/serving_summary.py "$OUT"
