"""The fused MoE at decode token counts with the expert scan (no align launch) against the sorted layout (the align's
launches, then the same GEMMs), on the model's own stacked shapes (GPU).

  V2-Lite: 64 routed experts, top 6, + 2 shared slots: 66 stacked experts, 8 slots a token, bf16, K 2048, I 1408
  V3:      256 routed experts, top 8, + 1 shared slot: 257 stacked experts, 9 slots a token, block FP8, K 7168, I 2048
  V3-EP8:  V3 as one of 8 expert-parallel ranks sees it: 32 local routed experts + the shared one, the other ranks'
           slots id -1 (about 7 of every token's 8 routed slots)

Each call is the whole `fused_moe` (route, both grouped GEMMs, the combine) with the tuned table's tile for the token
count, one CUDA graph of REPS back-to-back calls, L2 flushed before each replay, us per call. "sorted" forces the
counting sort (EXPERT_SCAN_MAX_SLOTS = 0); "scan" lifts every bound of the scan (EXPERT_SCAN_MAX_SLOTS,
EXPERT_SCAN_MAX_BINS, EXPERT_SCAN_FP8) for the row; "default" names what fused_moe takes with the shipped bounds.
Both outputs are compared (max |scan - sorted| / max |sorted|: the same products per row, so 0 is expected). The
last lines name, per shape, the smallest S where the scan lost.

    PYTHONPATH=$PWD python3 benchmarks/bench_moe_scan.py [--tokens 2 4 8 16 32 64 128] [--reps 20]
"""
from __future__ import annotations

import argparse
import json
import random
from typing import NamedTuple

import torch

from mlaserve.bench.kernel_cases.fused_moe import MoeShape, make_weights
from mlaserve.bench.timing import time_cuda
from mlaserve.kernels import fused_moe as fm


class ScanShape(NamedTuple):
    name: str
    routed: int
    top_k: int
    n_shared: int
    hidden: int
    inter: int
    fp8: bool
    ep: int = 1          # routed experts are this rank's share of routed * ep


SHAPES = (ScanShape("V2-Lite", 64, 6, 2, 2048, 1408, False), ScanShape("V3", 256, 8, 1, 7168, 2048, True),
          ScanShape("V3-EP8", 32, 8, 1, 7168, 2048, True, 8))
TOKENS = (2, 4, 8, 16, 32, 64, 128)


def topk(t: int, s: ScanShape) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, top_k + n_shared]: distinct random routed experts per token (over all ranks' under EP: the others' -1),
    then the shared slots E .. (weight 1)."""
    routed = torch.rand(t, s.routed * s.ep, device="cuda").topk(s.top_k, dim=1).indices
    routed = torch.where(routed < s.routed, routed, -1)
    shared = torch.arange(s.routed, s.routed + s.n_shared, device="cuda").expand(t, s.n_shared)
    ids = torch.cat([routed, shared], dim=1).to(torch.int32)
    weights = torch.cat([torch.rand(t, s.top_k, device="cuda"), torch.ones(t, s.n_shared, device="cuda")], dim=1)
    return weights, ids


def per_call_us(fn, reps: int, scan: bool) -> float:
    def many():
        keep = fm.EXPERT_SCAN_MAX_SLOTS, fm.EXPERT_SCAN_MAX_BINS, fm.EXPERT_SCAN_FP8
        fm.EXPERT_SCAN_MAX_SLOTS, fm.EXPERT_SCAN_MAX_BINS, fm.EXPERT_SCAN_FP8 = \
            (1 << 30, 1 << 30, True) if scan else (0, 0, False)                    # read at capture
        try:
            for _ in range(reps):
                fn()
        finally:
            fm.EXPERT_SCAN_MAX_SLOTS, fm.EXPERT_SCAN_MAX_BINS, fm.EXPERT_SCAN_FP8 = keep
    return time_cuda(many, iters=30) * 1000 / reps


def bench(t: int, s: ScanShape, w: dict, reps: int) -> dict:
    weights, ids = topk(t, s)
    x = torch.randn(t, s.hidden, device="cuda", dtype=torch.bfloat16)
    out = {mode: torch.empty_like(x) for mode in ("scan", "sorted")}
    cfg = fm.get_moe_config(s.routed, s.inter, "fp8_w8a8" if s.fp8 else "bf16", t)

    def call(mode: str):
        return lambda: fm.fused_moe(x, **w, topk_weights=weights, topk_ids=ids, num_routed_experts=s.routed,
                                    out=out[mode])
    scan_us = per_call_us(call("scan"), reps, True)
    sorted_us = per_call_us(call("sorted"), reps, False)
    ref = out["sorted"].float()
    diff = ((out["scan"].float() - ref).abs().max() / ref.abs().max()).item()
    slots = ids.numel()
    row = dict(shape=s.name, tokens=t, slots=slots, block_m=cfg["BLOCK_SIZE_M"], scan_us=round(scan_us, 2),
               sorted_us=round(sorted_us, 2), align_launches=fm.align_launches(slots, s.routed + s.n_shared),
               default="scan" if fm.expert_scan_fits(slots, s.routed + s.n_shared, s.fp8) else "sorted", rel_diff=diff)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS), help="token counts T")
    ap.add_argument("--reps", type=int, default=20, help="calls per CUDA graph")
    a = ap.parse_args()
    seed = random.randrange(2**31)
    torch.manual_seed(seed)
    print(torch.cuda.get_device_name(), f"seed {seed}", f"EXPERT_SCAN_MAX_SLOTS={fm.EXPERT_SCAN_MAX_SLOTS}",
          f"EXPERT_SCAN_MAX_BINS={fm.EXPERT_SCAN_MAX_BINS}", flush=True)
    rows = []
    for s in SHAPES:
        w = make_weights(MoeShape(s.name, s.routed + s.n_shared, s.top_k, s.hidden, s.inter, s.fp8, 1, 1))
        for t in a.tokens:
            rows.append(bench(t, s, w, a.reps))
            print(json.dumps(rows[-1]), flush=True)
        del w
        torch.cuda.empty_cache()
    print(f"{'shape':8} {'T':>4} {'S':>5} {'bm':>3} {'scan us':>8} {'sorted us':>9} {'saved':>6}  default  rel diff")
    for r in rows:
        print(f"{r['shape']:8} {r['tokens']:4d} {r['slots']:5d} {r['block_m']:3d} {r['scan_us']:8.2f} "
              f"{r['sorted_us']:9.2f} {r['sorted_us'] - r['scan_us']:6.2f}  {r['default']:7}  {r['rel_diff']:.1e}")
    for name in dict.fromkeys(r["shape"] for r in rows):                    # (rows in ascending T per shape)
        loss = next((r["slots"] for r in rows if r["shape"] == name and r["scan_us"] > r["sorted_us"]), None)
        print(f"{name}: " + (f"the scan's first loss at S = {loss}" if loss else "the scan won at every S"))


if __name__ == "__main__":
    main()
