#!/usr/bin/env bash
# Issue 11, the one-shot all-reduce over peer buffers (CUDA IPC) with the norm fused in.
#   bash benchmarks/gpu_peer.sh one   (nvidia-h100-x1) two ranks on one GPU over CUDA IPC, eager and in a CUDA graph
#                                     (correctness only: the GPU time-slices the two processes), the tp-1 fast-path
#                                     tests (the decoder layer changed), one-batch V2-Lite bs 1 (no regression)
#   bash benchmarks/gpu_peer.sh two   (nvidia-h200-x2) the all-reduce alone, peer vs NCCL, plain and with the norm;
#                                     the multi-GPU tests; one-batch V2-Lite and V3 tp 2 with and without the peer path
# Carry .whl. Results under $OUT.
set -uo pipefail
[ -d .whl ] && python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site MLASERVE_CACHE=/tmp/mlaserve-cache
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1   # never NVLink multicast
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PART=${1:-one}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/env.txt"
B="python3 -m mlaserve.cli bench one-batch --load-format dummy --input-len 256 --output-len 32"
if [ "$PART" = one ]; then
  timeout 300 python3 -m pytest -q -p no:cacheprovider -s tests/distributed/test_peer.py -k gpu 2>&1 | tail -4 \
    | tee "$OUT/tests_peer.txt"
  timeout 300 python3 -m pytest -q -p no:cacheprovider tests/models/test_gpu_fastpath.py 2>&1 | tail -3 \
    | tee "$OUT/tests_fastpath.txt"
  timeout 200 $B --model-config mlaserve/tools/configs/deepseek-v2-lite.json --batch-size 1 16 \
    --output-file "$OUT/one_batch.md" 2>&1 | grep "^|" | tail -3
fi
if [ "$PART" = two ]; then
  nvidia-smi topo -m >> "$OUT/env.txt" 2>&1
  timeout 120 python3 benchmarks/allreduce.py --tp-size 2 2>&1 | tee "$OUT/allreduce.md"
  timeout 300 python3 -m pytest -q -p no:cacheprovider tests/distributed/test_peer.py tests/distributed/test_tensor_parallel.py \
    -k "gpu" 2>&1 | tail -4 | tee "$OUT/tests.txt"
  python3 -c "import json; d=json.load(open('mlaserve/tools/configs/deepseek-v3.json')); d['num_hidden_layers']=20; json.dump(d, open('/tmp/v3_tp.json','w'))"
  for flag in "" "--disable-custom-all-reduce"; do
    timeout 200 $B --model-config mlaserve/tools/configs/deepseek-v2-lite.json --batch-size 1 16 64 --tp-size 2 $flag \
      --output-file "$OUT/one_batch.md" 2>&1 | grep "^|" | tail -4
    timeout 300 $B --model-config /tmp/v3_tp.json --batch-size 1 16 64 --tp-size 2 $flag \
      --output-file "$OUT/one_batch.md" 2>&1 | grep "^|" | tail -4
  done
fi
