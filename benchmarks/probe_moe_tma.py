"""One grouped GEMM of the fused MoE with the TMA key, in a process of its own (GPU): does it run, does it equal the
pointer loads, how long does it take. For cases that may fault (a fault ends the process's CUDA context).

Usage: PYTHONPATH=$PWD python3 benchmarks/probe_moe_tma.py --experts 256 --tokens 4096 --tile 64,128,4,4
       [--gemm gated|down] [--rank 2|3] [--bf16]
"""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from sweep_moe_prefill import case  # noqa: E402

from mlaserve.bench.kernel_cases.fused_moe import MODELS, make_weights, route  # noqa: E402
from mlaserve.bench.timing import time_cuda  # noqa: E402
from mlaserve.kernels import fused_moe as fm  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--experts", type=int, default=256)
ap.add_argument("--tokens", type=int, default=4096)
ap.add_argument("--tile", default="64,128,4,4")
ap.add_argument("--gemm", default="gated", choices=["gated", "down"])
ap.add_argument("--rank", type=int, default=3)
ap.add_argument("--bf16", action="store_true", help="V2-Lite's shape (bf16) instead of V3's (FP8)")
a = ap.parse_args()
fm.TMA_B_RANK = a.rank
s = MODELS[0 if a.bf16 else 1]._replace(num_experts=a.experts)
bm, bn, warps, stages = map(int, a.tile.split(","))
cfg = dict(BLOCK_SIZE_M=bm, BLOCK_SIZE_N=bn, BLOCK_SIZE_K=64 if a.bf16 else 128, GROUP_SIZE_M=1, num_warps=warps,
           num_stages=stages)
w = make_weights(s)
torch.manual_seed(1)
x = torch.randn(a.tokens, s.hidden_size, device="cuda", dtype=torch.bfloat16)
topk_weights, topk_ids = route(s, a.tokens)
gated = a.gemm == "gated"
label = f"E={a.experts} T={a.tokens} {a.gemm} tile {a.tile} rank {a.rank}{' bf16' if a.bf16 else ''}"
run, out = case(fm, s, w, x, topk_weights, topk_ids, cfg, gated)
run()
ref = out().float()
run, out = case(fm, s, w, x, topk_weights, topk_ids, dict(cfg, TMA=True), gated)
run()
torch.cuda.synchronize()
diff = ((out().float() - ref).abs().max() / ref.abs().max()).item()
ms_tma = time_cuda(run, iters=10)
run0, _ = case(fm, s, w, x, topk_weights, topk_ids, cfg, gated)
ms = time_cuda(run0, iters=10)
print(f"OK {label}: diff {diff:.1e}, TMA {ms_tma * 1e3:.0f} us, pointer loads {ms * 1e3:.0f} us", flush=True)
