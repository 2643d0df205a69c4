#!/usr/bin/env bash
# Device call for tensor parallelism (nvidia-h200-x2): the multi-GPU tests, the all-reduce alone (NCCL in a CUDA
# graph), one-batch V2-Lite tp 1 vs tp 2 and V3 full width FP8 at tp 2, startup to first served token at tp 2.
# Usage (repo root, on the GPU machine, carry .whl): bash benchmarks/gpu_tp.sh
set -uo pipefail
[ -d .whl ] && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD MLASERVE_CACHE=/tmp/mlaserve-cache
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1   # never NVLink multicast
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/env.txt"
nvidia-smi topo -m >> "$OUT/env.txt" 2>&1
timeout 60 python3 benchmarks/allreduce.py --tp-size 2 | tee "$OUT/allreduce.md"
timeout 300 python3 -m pytest -q -p no:cacheprovider -m "multi_gpu or gpu" tests/distributed tests/server/test_parallel_server.py \
  2>&1 | tail -5 | tee "$OUT/tests.txt"
B="python3 -m mlaserve.cli bench one-batch --load-format dummy"
timeout 200 $B --model-config mlaserve/tools/configs/deepseek-v2-lite.json --batch-size 1 16 64 --input-len 256 \
  --output-len 32 --tp-size 1 2 --output-file "$OUT/one_batch.md" 2>&1 | grep "^|" | tail -7
python3 benchmarks/v3_config.py --layers ${V3_LAYERS:-20} --out /tmp/v3_tp.json
timeout 300 $B --model-config /tmp/v3_tp.json --batch-size 1 16 64 --input-len 256 --output-len 32 --tp-size 2 \
  --output-file "$OUT/one_batch.md" 2>&1 | grep "^|" | tail -4
M=/tmp/v2l; mkdir -p $M; cp mlaserve/tools/configs/deepseek-v2-lite.json $M/config.json
python3 -m mlaserve.tools.tokenizer $M > /dev/null
t0=$(date +%s.%N)
python3 -m mlaserve.cli serve --model-path $M --load-format dummy --tp-size 2 --port 30000 --log-level warning \
  > "$OUT/serve_tp2.log" 2>&1 &
pid=$!
for i in $(seq 1 480); do
  curl -sf -m 60 http://127.0.0.1:30000/v1/completions -H 'Content-Type: application/json' \
    -d '{"model": "m", "prompt": "Hello", "max_tokens": 1}' > /dev/null 2>&1 && break
  sleep 0.5
done
echo "tp 2: startup to first served token $(python3 -c "import time; print(round(time.time() - $t0, 1))") s" | tee "$OUT/startup.txt"
kill -TERM $pid; wait $pid; echo "serve exit code $?" | tee -a "$OUT/startup.txt"
