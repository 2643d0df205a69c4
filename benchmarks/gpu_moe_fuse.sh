#!/usr/bin/env bash
# Issue 15 (decode at the memory floor) device run, one call (< 5 min on an H100), from the repo root:
#   bash benchmarks/gpu_moe_fuse.sh            # GPU tests of the new kernels, then the microbenchmarks
#   bash benchmarks/gpu_moe_fuse.sh bench      # microbenchmarks only
#   bash benchmarks/gpu_moe_fuse.sh model      # whole model on the Triton kernels vs HF (GPU variants)
# Writes $OUT/env.txt, $OUT/gpu_tests.txt, $OUT/moe_fuse.txt (us per call, old vs new; the thresholds
# ROUTE_FUSED_MAX_TOKENS (layers/moe.py), COMBINE_MAX_TOKENS (kernels/fused_moe.py) and FUSE_QUANT_MAX_M
# (kernels/fp8_gemm.py) are read off its route, moe and fp8 tables), $OUT/model_tests.txt.
set -uo pipefail
[ -d .whl ] && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/env.txt"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' | tee -a "$OUT/env.txt"
git log -1 --format='commit %h %s' 2>/dev/null | tee -a "$OUT/env.txt"
part=${1:-all}
if [ "$part" = all ]; then
  timeout 110 python3 -m pytest -q -p no:cacheprovider -rfE tests/kernels/test_moe_topk.py tests/kernels/test_reduce.py \
    tests/kernels/test_fp8_gemm.py tests/kernels/test_fused_moe.py tests/layers/test_moe.py 2>&1 \
    | tail -30 | tee "$OUT/gpu_tests.txt"
fi
if [ "$part" = all ] || [ "$part" = bench ]; then
  timeout 45 python3 benchmarks/moe_fuse.py route sum 2>&1 | tee "$OUT/moe_fuse.txt"
  timeout 70 python3 benchmarks/moe_fuse.py moe 2>&1 | tee -a "$OUT/moe_fuse.txt"
  timeout 75 python3 benchmarks/moe_fuse.py fp8 2>&1 | tee -a "$OUT/moe_fuse.txt"
fi
if [ "$part" = model ]; then
  timeout 280 python3 -m pytest -q -p no:cacheprovider -rfE tests/models/test_deepseek_vs_hf.py -k "triton_kernels" \
    2>&1 | tail -8 | tee "$OUT/model_tests.txt"
fi
