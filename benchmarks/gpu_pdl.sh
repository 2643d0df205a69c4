#!/usr/bin/env bash
# Issue 15, programmatic dependent launch (mlaserve/kernels/pdl.py) on the decode path, on an H100 (carry .whl):
#   bash benchmarks/gpu_pdl.sh check   PDL smoke test, GPU tests of every changed kernel and the fast path (greedy
#                                      equality with graphs, log-probs), one A/B round of one-batch V2-Lite
#   bash benchmarks/gpu_pdl.sh bench   one-batch A/B (MLASERVE_PDL=0 / 1): V2-Lite bs 1 / 16 / 64 twice, V3 4L FP8
#                                      once; then PDL with every M <= 16 linear through gemv; the bs-1 profile
#   bash benchmarks/gpu_pdl.sh verify  the GPU tests of `check` alone
#   bash benchmarks/gpu_pdl.sh trigger one-batch V3 4L and V2-Lite with PDL off, launching dependents after the
#                                      main loop (1), and at the start of each kernel (early: a switch of the
#                                      measured tree, removed after it; now `early` runs as 1)
set -uo pipefail
[ -d .whl ] && python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONUNBUFFERED=1 MLASERVE_CACHE=/tmp/mlaserve-cache PYTHONPATH=$PWD:/tmp/site
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PART=${1:-check}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/env.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/env.txt"
python3 -c "import json; d=json.load(open('mlaserve/tools/configs/deepseek-v3.json')); d['num_hidden_layers']=4; json.dump(d, open('/tmp/v3_4l.json','w'))"
B="python3 -m mlaserve.cli bench one-batch --load-format dummy --input-len 256 --output-len 32"
V2L=mlaserve/tools/configs/deepseek-v2-lite.json
ab() {  # ab TAG CONFIG BATCH_SIZES...: one-batch with PDL off, then on (MODES: the MLASERVE_PDL values, default 0 1)
  local tag=$1 cfg=$2; shift 2
  for p in ${MODES:-0 1}; do
    echo "### $tag PDL=$p"
    MLASERVE_PDL=$p timeout 150 $B --model-config $cfg --batch-size "$@" --output-file "$OUT/one_batch_${tag}_pdl$p.md" \
      2>&1 | grep "^|" | tail -3
  done
}
gpu_tests() {  # every changed kernel's GPU tests and the fast path (greedy equality with graphs, log-probs)
  timeout 330 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_gemv.py tests/kernels/test_moe_topk.py \
    tests/kernels/test_mla_decode.py tests/kernels/test_fused_moe.py tests/kernels/test_mla_absorb.py \
    tests/kernels/test_norm.py tests/kernels/test_activation.py tests/kernels/test_fp8_gemm.py tests/kernels/test_reduce.py \
    tests/kernels/test_rope.py tests/kernels/test_quant.py tests/models/test_gpu_fastpath.py 2>&1
}
if [ "$PART" = check ]; then
  python3 - <<'PY' 2>&1 | tail -3 | tee "$OUT/smoke.txt"
import torch
from mlaserve.kernels.gemv import gemv
from mlaserve.kernels.pdl import pdl_meta
x = torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16); w = torch.randn(4096, 2048, device="cuda", dtype=torch.bfloat16)
print("pdl_meta", pdl_meta(x.device), "gemv max err", (gemv(x, w).float() - x.float() @ w.float().t()).abs().max().item())
PY
  gpu_tests | tail -8 | tee "$OUT/tests.txt"
  ab v2l_r1 $V2L 1 16 64
fi
if [ "$PART" = trigger ]; then     # where the next kernel may launch: after the main loop (1) or at the start (early)
  MODES="0 1 early" ab v3_trigger /tmp/v3_4l.json 1 16 64
  MODES="0 1 early" ab v2l_trigger $V2L 1 16 64
fi
if [ "$PART" = bench ]; then
  ab v2l_r2 $V2L 1 16 64
  ab v3 /tmp/v3_4l.json 1 16 64
  echo "### v2l PDL=1, every linear of <= 16 rows through gemv"
  timeout 150 python3 -c "import sys, mlaserve.kernels.gemv as g; g.MIN_N = 0; from mlaserve.cli import main; sys.exit(main())" \
    bench one-batch --load-format dummy --input-len 256 --output-len 32 --model-config $V2L --batch-size 1 16 \
    --output-file "$OUT/one_batch_v2l_gemv_all.md" 2>&1 | grep "^|" | tail -2
  for p in 0 1; do
    MLASERVE_PDL=$p timeout 100 python3 benchmarks/profile_decode.py --bs 1 > "$OUT/prof_v2l_bs1_pdl$p.txt" 2>&1
    grep -B1 -A14 "kernels per step" "$OUT/prof_v2l_bs1_pdl$p.txt"
  done
fi
if [ "$PART" = verify ]; then     # the GPU tests of the kernels and the fast path, on the committed tree
  gpu_tests | tail -3 | tee "$OUT/tests.txt"
fi
