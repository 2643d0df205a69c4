"""moe_align_block_size at decode sizes: the one-program kernel, count + scan-and-scatter, and count / scan / scatter,
each forced (GPU).

  V2-Lite: 64 routed experts, top 6, + 2 shared slots (fused up to FUSE_SHARED_MAX_TOKENS): 66 experts, 8 slots
  V3:      256 routed experts, top 8, + 1 shared slot: 257 experts, 9 slots

block_m is the tuned table's BLOCK_SIZE_M for the token count (as fused_moe would pick it), or --block-m. Each
path is one CUDA graph of REPS back-to-back calls (a launch gap between them, as in a decode step), L2 flushed,
reported in us per call. The last lines name the largest S where the one program won on every shape (the bound,
ALIGN_ONE_PROGRAM_MAX_WORK, is on S x BE: read it per shape) and the most values the scan-and-scatter programs read
(chunks x chunks x BE) where two launches beat three on every shape (ALIGN_TWO_LAUNCH_MAX_READS). Usage: PYTHONPATH=$PWD python3 benchmarks/bench_moe_align.py
[--tokens 1 8 16 32 64 128 256] [--reps 20] [--block-m 16]
"""
from __future__ import annotations

import argparse
import json
from typing import NamedTuple

import torch

from mlaserve.bench.timing import time_cuda
from mlaserve.kernels import fused_moe as fm


class AlignShape(NamedTuple):
    name: str
    num_experts: int     # routed
    top_k: int
    n_shared: int        # shared slots riding along in the fused call
    inter: int           # moe_intermediate_size: the tuned table's N
    dtype: str           # the tuned table's dtype


SHAPES = (AlignShape("V2-Lite", 64, 6, 2, 1408, "bf16"), AlignShape("V3", 256, 8, 1, 2048, "fp8_w8a8"))
TOKENS = (1, 8, 16, 32, 64, 128, 256, 512, 1024)


def topk_ids(t: int, s: AlignShape) -> torch.Tensor:
    """[T, top_k + n_shared] int32: distinct random routed experts per token, then the shared slots E ..."""
    routed = torch.rand(t, s.num_experts, device="cuda").topk(s.top_k, dim=1).indices
    shared = torch.arange(s.num_experts, s.num_experts + s.n_shared, device="cuda").expand(t, s.n_shared)
    return torch.cat([routed, shared], dim=1).to(torch.int32)


def per_call_us(fn, reps: int) -> float:
    def many():
        for _ in range(reps):
            fn()
    return time_cuda(many, iters=30) * 1000 / reps


def bench(t: int, s: AlignShape, reps: int, block_m: int | None) -> dict:
    ids = topk_ids(t, s)
    e = s.num_experts + s.n_shared
    bm = block_m or fm.get_moe_config(s.num_experts, s.inter, s.dtype, t)["BLOCK_SIZE_M"]
    outs = [fm.moe_align_block_size(ids, bm, e, launches=n) for n in (1, 2, 3)]
    same = all(torch.equal(a, b) for out in outs[:2] for a, b in zip(out, outs[2]))
    us = [per_call_us(lambda n=n: fm.moe_align_block_size(ids, bm, e, launches=n), reps) for n in (1, 2, 3)]
    slots = ids.numel()
    block_e = 1 << e.bit_length()                     # next power of two above e: the kernels' BLOCK_E
    chunks = -(-slots // max(16, min(128, 8192 // block_e)))
    row = dict(shape=s.name, tokens=t, slots=slots, block_m=bm, reads=chunks * chunks * block_e, one_program_us=round(us[0], 2),
               two_launch_us=round(us[1], 2), three_launch_us=round(us[2], 2), same_outputs=same,
               default=("one", "two", "three")[fm.align_launches(slots, e) - 1])
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--block-m", type=int, default=None, help="default: the tuned BLOCK_SIZE_M per token count")
    a = ap.parse_args()
    print(torch.cuda.get_device_name(), f"ALIGN_ONE_PROGRAM_MAX_WORK={fm.ALIGN_ONE_PROGRAM_MAX_WORK}",
          f"ALIGN_TWO_LAUNCH_MAX_READS={fm.ALIGN_TWO_LAUNCH_MAX_READS}")
    rows = [bench(t, s, a.reps, a.block_m) for s in SHAPES for t in a.tokens]
    print(f"{'shape':8} {'T':>4} {'S':>5} {'bm':>3} {'reads':>9} {'one us':>7} {'two us':>7} {'three us':>8}  default")
    for r in rows:
        print(f"{r['shape']:8} {r['tokens']:4d} {r['slots']:5d} {r['block_m']:3d} {r['reads']:9d} "
              f"{r['one_program_us']:7.2f} {r['two_launch_us']:7.2f} {r['three_launch_us']:8.2f}  {r['default']}"
              f"{'' if r['same_outputs'] else '  OUTPUTS DIFFER'}")
    losing = [r["slots"] for r in rows if r["one_program_us"] > min(r["two_launch_us"], r["three_launch_us"])]
    wins = [r["slots"] for r in rows if r["slots"] < min(losing, default=1 << 30)]
    print(f"one program won up to S = {max(wins, default=0)} on every shape"
          + (f"; first loss at S = {min(losing)}" if losing else ""))
    lost2 = [r["reads"] for r in rows if r["two_launch_us"] > r["three_launch_us"]]
    won2 = [r["reads"] for r in rows if r["reads"] < min(lost2, default=1 << 62)]
    print(f"two launches beat three up to {max(won2, default=0)} values read (chunks x chunks x BE) on every shape"
          + (f"; first loss at {min(lost2)}" if lost2 else ""))

if __name__ == "__main__":
    main()
