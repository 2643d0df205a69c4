#!/usr/bin/env bash
# One device call: GPU tests (kernels vs refs, fast path vs reference) and `mlaserve bench kernels`.
# Usage on the GPU machine (from the repo root): bash benchmarks/gpu_check.sh [quick]
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' | tee -a "$OUT/gpu.txt"
timeout 300 python3 -m pytest -q -p no:cacheprovider --timeout 240 tests/kernels tests/models/test_gpu_fastpath.py \
  2>&1 | tail -60 | tee "$OUT/gpu_tests.txt"
QUICK=""; [ "${1:-}" = quick ] && QUICK="--quick"
timeout 280 python3 -m mlaserve.cli bench kernels $QUICK --output "$OUT/kernels.md" 2>&1 | tee "$OUT/kernels_log.txt" | grep -v "^\s" | tail -80
