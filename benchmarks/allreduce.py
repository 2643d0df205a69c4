"""The decode path's small all-reduce alone: `TensorParallel.all_reduce` (NCCL through torch.distributed) on
[tokens, hidden] bf16, 50 back to back inside a CUDA graph, per-call time by replaying the graph.

    python benchmarks/allreduce.py --tp-size 2            # on a machine with >= 2 GPUs (NCCL)
    python benchmarks/allreduce.py --tp-size 2 --cpu      # gloo on the CPU (correctness of the script only)
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from mlaserve.distributed import RankGroup, spawn_ranks

SHAPES = [(1, 2048), (1, 7168), (16, 7168), (64, 7168)]
CALLS = 50


def time_allreduce(group: RankGroup, shapes: list[tuple[int, int]], calls: int) -> list[dict]:
    tp, rows = group.tp, []
    cuda = group.tp.nccl                                   # ranks on GPUs (spawn_ranks set each one's device)
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    for t, h in shapes:
        x = torch.full((t, h), float(group.info.rank + 1), dtype=torch.bfloat16, device=device)
        tp.all_reduce(x)
        expect = sum(range(1, group.size + 1)) * 1.0
        ok = bool((x.float() == expect).all())
        if cuda:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(calls):
                    tp.all_reduce(x)
            graph.replay()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            times = []
            for _ in range(20):
                start.record()
                graph.replay()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) * 1e3 / calls)
            us = statistics.median(times)
        else:
            t0 = time.perf_counter()
            for _ in range(calls):
                tp.all_reduce(x)
            us = (time.perf_counter() - t0) * 1e6 / calls
        rows.append({"tokens": t, "hidden": h, "bytes": t * h * 2, "us": us, "correct": ok})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tp-size", type=int, default=2)
    ap.add_argument("--cpu", action="store_true")
    args = ap.parse_args()
    device = "cpu" if args.cpu else "cuda"
    rows = spawn_ranks(time_allreduce, args.tp_size, SHAPES, CALLS, device=device)[0]
    name = "cpu (gloo)" if args.cpu else f"{torch.cuda.get_device_name()} x {args.tp_size} (NCCL)"
    print(f"### all-reduce alone, {name}, {CALLS} back to back{' in a CUDA graph' if not args.cpu else ''}\n")
    print("| shape | bytes | us per call | sum correct |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['tokens']} x {r['hidden']} | {r['bytes']} | {r['us']:.1f} | {r['correct']} |")


if __name__ == "__main__":
    main()
