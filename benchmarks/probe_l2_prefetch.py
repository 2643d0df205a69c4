"""Does the L2 prefetch job (mlaserve/kernels/prefetch.py) put a weight in L2 in time, and how much of one stays?

One CUDA graph per row, replayed with L2 flushed first (a 512 MB write): [flush] [prefetch job] [a ~20 us spin, HBM
idle, as under a small batch's attention] [a one-row linear reading the weight]. The linear's time is the graph's
minus the same graph without it; "cold" rows run no prefetch. Weights of 8-48 MB, a one-row bf16 GEMV over them
(gemv1 / gemv, as the decode's o_proj and dense MLP), [1, K] x [N, K].

    python3 benchmarks/probe_l2_prefetch.py
"""
from __future__ import annotations

import os
import statistics

import torch

from mlaserve.kernels import prefetch
from mlaserve.kernels.gemv import linear

SPIN_CYCLES = 40_000       # ~20 us at ~1.98 GHz
REPLAYS = 30


def graph_us(fns: list) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    times = []
    for _ in range(REPLAYS):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def main() -> None:
    os.environ["MLASERVE_L2_PREFETCH_MB"] = "64"                         # whole weights up to 48 MB here
    dev = torch.device("cuda")
    flush_buf = torch.empty(512 * 2**20, dtype=torch.uint8, device=dev)
    flush = flush_buf.zero_
    spin = lambda: torch.cuda._sleep(SPIN_CYCLES)                          # noqa: E731
    print(torch.cuda.get_device_name(), "L2", torch.cuda.get_device_properties(dev).L2_cache_size // 2**20, "MB")
    base = graph_us([flush, spin])
    print(f"flush + spin alone: {base:.1f} us")
    print("| weight MB | shape | cold linear us | after prefetch us | prefetch job alone us |")
    print("|---|---|---|---|---|")
    for mb, k in ((8, 2048), (16, 2048), (24, 2048), (32, 2048), (40, 2048), (48, 2048), (32, 7168)):
        n = mb * 2**20 // (2 * k)
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        job = prefetch.plan([w])
        assert job is not None, "prefetch is off here (needs compute capability 9.0, MLASERVE_L2_PREFETCH_MB > 0)"
        run = lambda: linear(x, w)                                          # noqa: E731
        pre = lambda: prefetch.l2_prefetch(job)                             # noqa: E731
        cold = graph_us([flush, spin, run]) - base
        warm = graph_us([flush, pre, spin, run]) - graph_us([flush, pre, spin])
        alone = graph_us([flush, pre]) - graph_us([flush])
        print(f"| {mb} (job {job.bytes() / 2**20:.0f}) | {n} x {k} | {cold:.1f} | {warm:.1f} | {alone:.1f} |")
        del w


if __name__ == "__main__":
    main()
