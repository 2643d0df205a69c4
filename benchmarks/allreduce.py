"""The decode path's small all-reduce alone, [tokens, hidden] bf16, 50 back to back inside a CUDA graph, per-call
time by replaying the graph: NCCL, the model's call (`distributed/peer.py`: whichever kernel its rules pick), the
one-shot pull kernel over peer buffers, its push variant (rows <= 16: `kernels/allreduce.peer_all_reduce_ll`;
whole rows from one program each, and from SPLIT_COLS-column programs), and each followed by the residual add +
RMSNorm (NCCL + the norm kernel vs the peer kernels with the norm fused in).
Every rank checks its sums against the others' parts.

    python benchmarks/allreduce.py --tp-size 2            # on a machine with >= 2 GPUs (NCCL, CUDA IPC)
    python benchmarks/allreduce.py --tp-size 2 --cpu      # gloo + the interpreter (correctness of the script)
"""
from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from mlaserve.bench.timing import time_graph_or_wall
from mlaserve.distributed import RankGroup, spawn_ranks
from mlaserve.distributed.peer import SPLIT_COLS
from mlaserve.kernels.allreduce import ll_chunk, peer_all_reduce, peer_all_reduce_ref
from mlaserve.kernels.norm import fused_add_rmsnorm

SHAPES = [(1, 2048), (4, 2048), (16, 2048), (1, 7168), (4, 7168), (8, 7168), (16, 7168), (64, 7168)]
CALLS = 50


def time_allreduce(group: RankGroup, shapes: list[tuple[int, int]], calls: int) -> list[dict]:
    tp, rows = group.tp, []
    peer, cuda = tp.peer, tp.nccl
    assert peer is not None, "no peer all-reduce on this machine (see the rank log for why)"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float16
    for t, h in shapes:
        g = torch.Generator().manual_seed(1000 * t + h + group.info.rank)
        x = torch.randn(t, h, generator=g).to(dtype)
        x = x.to(device)
        parts = [torch.empty_like(x) for _ in range(group.size)]     # on the device: NCCL gathers there
        dist.all_gather(parts, x, group=tp.group)
        res, w = torch.randn(t, h, device=device).to(dtype), torch.ones(h, dtype=dtype, device=device)
        want = peer_all_reduce_ref([p.cpu() for p in parts])
        got = x.clone()
        peer.all_reduce(got)
        y = torch.zeros_like(x)                      # timed in place, call after call: stays finite
        chunk = ll_chunk(h, -(-h // SPLIT_COLS))
        lib = "nccl" if cuda else "gloo"
        ways = {
            lib: lambda: dist.all_reduce(y, group=tp.group),
            "ours (the model's call)": lambda: peer.all_reduce(y),
            "pull": lambda: peer_all_reduce(y, peer.peers),
            f"{lib} + norm": lambda: fused_add_rmsnorm(dist.all_reduce(y, group=tp.group) or y, res, w, 1e-6),
            "ours + norm (one launch)": lambda: peer.all_reduce_add_norm(y, res, w, 1e-6),
            "pull + norm": lambda: peer_all_reduce(y, peer.peers, res, w, 1e-6),
            "push": lambda: peer.all_reduce_push(y),
            "push + norm": lambda: peer.all_reduce_push(y, res, w, 1e-6),
            f"push, {SPLIT_COLS}-column programs": lambda: peer.all_reduce_push(y, chunk=chunk),
            f"push, {SPLIT_COLS}-column programs + norm": lambda: peer.all_reduce_push(y, res, w, 1e-6, chunk=chunk),
        }
        if not cuda:                                 # a split row with the norm needs concurrent programs
            del ways[f"push, {SPLIT_COLS}-column programs + norm"]
        if not peer.fits_push(x):
            ways = {k: v for k, v in ways.items() if not k.startswith("push")}
        exact = torch.equal(got.cpu(), want)
        if peer.fits_push(x):
            pushed, split = peer.all_reduce_push(x.clone()), peer.all_reduce_push(x.clone(), chunk=chunk)
            exact = exact and torch.equal(pushed.cpu(), want) and torch.equal(split.cpu(), want)
        row = {"tokens": t, "hidden": h, "bytes": t * h * x.element_size(), "peer_equals_ref": bool(exact)}
        for name, fn in ways.items():
            row[name] = time_graph_or_wall(lambda: [fn() for _ in range(calls)], cuda) * 1e6 / calls
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tp-size", type=int, default=2)
    ap.add_argument("--cpu", action="store_true")
    args = ap.parse_args()
    device = "cpu" if args.cpu else "cuda"
    shapes, calls = (SHAPES, CALLS) if not args.cpu else ([(1, 256), (4, 256)], 2)
    rows = spawn_ranks(time_allreduce, args.tp_size, shapes, calls, device=device, peer_all_reduce=True)[0]
    name = "cpu (gloo, interpreter)" if args.cpu else f"{torch.cuda.get_device_name()} x {args.tp_size}"
    print(f"### all-reduce alone, {name}, {calls} back to back{' in a CUDA graph' if not args.cpu else ''}, "
          f"us per call\n")
    ways = [k for k in rows[0] if k not in ("tokens", "hidden", "bytes", "peer_equals_ref")]
    print("| shape | bytes | " + " | ".join(ways) + " | peer sums exact |\n|---|---|" + "---|" * (len(ways) + 1))
    for r in rows:
        cells = [f"{r[k]:.1f}" if k in r else "-" for k in ways]
        print(f"| {r['tokens']} x {r['hidden']} | {r['bytes']} | " + " | ".join(cells) + f" | {r['peer_equals_ref']} |")


if __name__ == "__main__":
    main()
