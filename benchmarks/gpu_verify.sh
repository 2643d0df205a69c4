#!/usr/bin/env bash
# Correctness on two GPUs of everything that has run only on the CPU or under the Triton interpreter, in two streams
# at once (the tests assert tokens and values, never times, so sharing a GPU only slows them):
#   both GPUs: the peer kernels and tp 2 == tp 1 (push, split rows, sums in the router and the one-token fused MoE),
#              torch.compile without CUDA graphs at tp 2 ep 2 / DP attention / with speculation, EP 2 == one GPU,
#              the two GPUs as two nodes of one GPU each (the server, NCCL) == one GPU
#   GPU 1:     the padding-row mask (router kernels, padded graphs) and torch.compile without graphs on one GPU
# Usage (repo root, nvidia-h200-x2, carry .whl or .whlx): bash benchmarks/gpu_verify.sh   (about 12 min on two
# H200s: the both-GPU stream is the longer one; the fourth session ran it over two calls, see tp-h200x2.md).
# SKIP_COMPILE=1: the both-GPU stream's peer / tp 2 / EP 2 / two-node tests only (no torch.compile, no GPU-1 stream).
set -uo pipefail
W=.whl; [ -d .whlx ] && W=.whlx
[ -d $W ] && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $W/*.whl > /dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD MLASERVE_CACHE=/tmp/mlaserve-cache
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1   # never NVLink multicast
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/env.txt"
P="python3 -m pytest -q -p no:cacheprovider -rfE"
(
  timeout ${T1:-230} $P -m "multi_gpu or gpu" tests/distributed/test_peer.py tests/distributed/test_tensor_parallel.py \
    > "$OUT/tests_tp.txt" 2>&1
  [ -n "${SKIP_COMPILE:-}" ] || timeout ${T2:-420} $P -k nographs tests/test_combinations.py \
    > "$OUT/tests_nographs.txt" 2>&1
  timeout ${T3:-240} $P -m multi_gpu tests/distributed/test_expert_parallel.py -k two_gpus_equal_one_gpu \
    > "$OUT/tests_ep.txt" 2>&1
  timeout ${T5:-240} $P -m multi_gpu tests/server/test_parallel_server.py -k two_gpus_as_two_nodes \
    > "$OUT/tests_two_nodes.txt" 2>&1
) &
a=$!
[ -n "${SKIP_COMPILE:-}" ] || CUDA_VISIBLE_DEVICES=1 timeout ${T4:-400} $P tests/kernels/test_moe_topk.py \
  tests/layers/test_moe.py tests/engine/test_padded_rows.py tests/models/test_gpu_fastpath.py \
  tests/engine/test_spec.py -k "mask or pad or compile" > "$OUT/tests_mask_compile.txt" 2>&1
wait $a
for f in "$OUT"/tests_*.txt; do echo "== $f"; tail -12 "$f"; done
