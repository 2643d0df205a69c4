"""`chain_us`: us a call of calls run back to back in one CUDA graph (a call starts while the one before it ends, as
in the decode graph). Imports torch alone, so a benchmark run from an older tree (`gpu_merge_moe.sh sampler`) has it."""
from __future__ import annotations

import statistics

import torch


def chain_us(calls: list, replays: int = 20) -> float:
    """Median us per call of `calls` (zero-argument functions) run back to back in one CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in calls:
            f()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in calls:
            f()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / len(calls))
    return statistics.median(times)
