#!/usr/bin/env bash
# Tree drafts (speculative_eagle_topk > 1) on one GPU: the tree-mask kernel test, the GPU tree tests (eager, CUDA
# graphs, graphs + torch.compile, against decoding without speculation), then accept length and decode tok/s of
# the chain (3, 1, 4) beside trees on the demo model at bs 1 and 8 (bf16, CUDA graphs; as many rows as fit
# the time). Under 5 minutes on an H100.
# Run from the repository root on the device: bash benchmarks/gpu_tree.sh  (writes under $OUT)
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
[ -d .whl ] && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$OUT/gpu.txt"
git rev-parse HEAD > "$OUT/commit.txt" 2>/dev/null || true
timeout 40 python3 -m pytest -q -x tests/kernels/test_mla_decode.py -k "tree or num_q" -p no:cacheprovider 2>&1 \
  | tail -5 > "$OUT/kernel_tests.txt"
cat "$OUT/kernel_tests.txt"
# the chain's graphs go through the same SpecGraphRunner
timeout 50 python3 -m pytest -q "tests/engine/test_spec.py::test_gpu_triton_kernels_and_graphs_equal_no_speculation[graphs]" \
  -p no:cacheprovider 2>&1 \
  | grep -v "loading weights" | tail -8 > "$OUT/chain_tests.txt"
cat "$OUT/chain_tests.txt"
timeout 130 python3 -m pytest -v tests/engine/test_spec_tree.py -k gpu -p no:cacheprovider 2>&1 \
  | grep -v "loading weights" | tail -25 > "$OUT/tree_tests.txt"
cat "$OUT/tree_tests.txt"
timeout 80 python3 benchmarks/spec_decode.py demo 128 tree 2>&1 | grep -v "loading weights" | tee "$OUT/demo_tree.jsonl"
