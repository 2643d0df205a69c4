"""Decode launches folded together, each timed beside the launches it replaces (H100; CUDA graphs, L2 flushed).

  norm + router:  fused_add_rmsnorm + moe_route            vs  moe_route_norm      (V2-Lite 64 x 2048, V3 256 x 7168)
  fused MoE:      fused_moe at one token, align + 2 GEMMs  vs  its slot-per-block path (no align launch)

Each pair is one graph of REPS back-to-back calls (as in a decode step: a launch gap between kernels), reported
per call in us. Usage: python benchmarks/bench_decode_fold.py [--tokens 1 4 16] [--reps 20]
"""
from __future__ import annotations

import argparse
import json

import torch

from mlaserve.bench.timing import time_cuda
from mlaserve.kernels import fused_moe as fm
from mlaserve.kernels.moe_topk import moe_route, moe_route_norm
from mlaserve.kernels.norm import fused_add_rmsnorm

V2_ROUTE = dict(topk_method="greedy", scoring_func="softmax", n_shared=2)
V3_ROUTE = dict(topk_method="noaux_tc", scoring_func="sigmoid", n_group=8, topk_group=4, norm_topk_prob=True,
                routed_scaling_factor=2.5, n_shared=1)


def _per_call(fn, reps: int) -> float:
    def many():
        for _ in range(reps):
            fn()
    return time_cuda(many, iters=30) * 1000 / reps


def _row(name: str, t: int, unfused: float, fused: float) -> dict:
    r = dict(case=name, tokens=t, unfused_us=round(unfused, 2), fused_us=round(fused, 2),
             saved_us=round(unfused - fused, 2))
    print(json.dumps(r), flush=True)
    return r


def norm_route(t: int, reps: int, e: int, h: int, k: int, routing: dict) -> dict:
    dt = torch.bfloat16
    x, res = torch.randn(t, h, device="cuda", dtype=dt), torch.randn(t, h, device="cuda", dtype=dt)
    nw = torch.rand(h, device="cuda", dtype=dt) + 0.5
    gate = torch.randn(e, h, device="cuda", dtype=dt) * h ** -0.5
    bias = torch.randn(e, device="cuda") * 0.1 if routing["topk_method"] == "noaux_tc" else None
    sync, r = torch.zeros(t, dtype=torch.int32, device="cuda"), res.clone()

    def unfused():
        y, _ = fused_add_rmsnorm(x, r, nw, 1e-6)
        return moe_route(y, gate, k, e_score_correction_bias=bias, sync=sync, **routing)
    return _row(f"norm+route {e}x{h}", t, _per_call(unfused, reps),
                _per_call(lambda: moe_route_norm(x, res, nw, 1e-6, gate, k, e_score_correction_bias=bias,
                                                 sync=sync, **routing), reps))


def moe_one_token(reps: int, e: int = 64, n_shared: int = 2, h: int = 2048, i: int = 1408, k: int = 6) -> dict | None:
    if not hasattr(fm, "_slot_blocks"):
        print("fused_moe has no slot-per-block path: skipped")
        return None
    dt = torch.bfloat16
    w13 = torch.randn(e + n_shared, 2 * i, h, device="cuda", dtype=dt) * 0.02
    w2 = torch.randn(e + n_shared, h, i, device="cuda", dtype=dt) * 0.02
    x = torch.randn(1, h, device="cuda", dtype=dt)
    ids = torch.cat([torch.randperm(e, device="cuda")[:k], torch.arange(e, e + n_shared, device="cuda")])
    ids = ids.to(torch.int32)[None]
    wts = torch.rand(1, k + n_shared, device="cuda")
    sync = torch.zeros(h // 16 + 1, dtype=torch.int32, device="cuda")
    block_m = fm.get_moe_config(e, i, "bf16", 1)["BLOCK_SIZE_M"]

    def run():
        return fm.fused_moe(x, w13, w2, wts, ids, num_routed_experts=e, sync=sync)
    fused = _per_call(run, reps)
    slot_blocks = fm._slot_blocks
    fm._slot_blocks = lambda topk_ids: fm.moe_align_block_size(topk_ids, block_m, e + n_shared)   # the old path
    try:
        unfused = _per_call(run, reps)
    finally:
        fm._slot_blocks = slot_blocks
    return _row(f"fused_moe T=1 E={e}+{n_shared}", 1, unfused, fused)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    print(torch.cuda.get_device_name())
    for t in a.tokens:
        norm_route(t, a.reps, 64, 2048, 6, V2_ROUTE)
        norm_route(t, a.reps, 256, 7168, 8, V3_ROUTE)
    moe_one_token(a.reps)


if __name__ == "__main__":
    main()
