"""What one kernel boundary costs in a decode-like CUDA graph: N small Triton kernels back to back, each reading the
previous one's output (as the decode step's ~250 kernels do), with and without PDL.

Each kernel has G programs. A program may stream its share of W weight bytes (bf16, a buffer no kernel writes),
either before its PDL wait (as gemv / head_gemm do) or after it (as the fused MoE must: its experts are the router's
output); then it reads its value of the previous kernel's output, adds, and stores its own. With W = 0 the chain's us
a kernel is the boundary's latency alone; with W > 0 the excess over W / copy rate is what the boundary costs a
streaming kernel. A decode step is then about sum(bytes) / rate + kernels x that excess, which is what bounds it.

    python3 benchmarks/probe_kernel_chain.py [--kernels 252] [--grids 1 16 132 264] [--mbytes 0 2 8 16 46 92]
"""
from __future__ import annotations

import argparse
import statistics

import torch
import triton
import triton.language as tl

from mlaserve.kernels.pdl import pdl_enter, pdl_release

BLOCK = 2048                                     # bf16 values a weight step loads per program (4 KB)
RING_BYTES = 1 << 30                             # weights the links cycle through (20x an H100's L2)


@triton.jit
def _link_kernel(x_ptr, y_ptr, w_ptr, steps, zero, BLOCK: tl.constexpr, BEFORE: tl.constexpr, PDL: tl.constexpr):
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    base = w_ptr + pid.to(tl.int64) * steps * BLOCK
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    if BEFORE:
        for i in range(steps):
            acc += tl.load(base + i * BLOCK + offs).to(tl.float32)
    pdl_enter(PDL)
    if not BEFORE:
        for i in range(steps):
            acc += tl.load(base + i * BLOCK + offs).to(tl.float32)
    pdl_release(PDL)
    v = tl.load(x_ptr + pid)
    tl.store(y_ptr + pid, v + 1.0 + tl.sum(acc, axis=0) * zero)    # zero: a runtime 0.0 (loads kept)


def chain_us(kernels: int, grid: int, mbytes: float, before: bool, pdl: bool, replays: int = 20) -> tuple[float, float]:
    """(us a kernel, the chain's check value) of `kernels` links of `grid` programs in one graph.
    Its own replay loop, not chain_timer's: the first buffer is zeroed before each replay for the check."""
    steps = max(0, round(mbytes * 1e6 / 2 / BLOCK / grid))
    # the links read weights from a ring of slots past the L2's reach (the decode step reads each layer's once)
    per = grid * steps * BLOCK
    slots = max(1, min(kernels, -(-RING_BYTES // max(2 * per, 1))))
    w = torch.randn(max(1, slots * per), dtype=torch.bfloat16, device="cuda")
    bufs = [torch.zeros(grid, dtype=torch.float32, device="cuda") for _ in range(2)]

    def run():
        for i in range(kernels):
            _link_kernel[(grid,)](bufs[i % 2], bufs[(i + 1) % 2], w[(i % slots) * per:] if per else w, steps, 0.0, BLOCK=BLOCK,
                                  BEFORE=before, PDL=pdl, launch_pdl=pdl, num_warps=4)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        run()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        run()
    times = []
    for _ in range(replays):
        bufs[0].zero_()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / kernels)
    check = bufs[kernels % 2][0].item()          # each link adds 1 to the one before: `kernels` if ordered
    del w
    return statistics.median(times), check


def copy_rate() -> float:
    x = torch.empty(1 << 28, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(10):
        y.copy_(x)
    b.record()
    b.synchronize()
    return 2 * x.numel() * 10 / (a.elapsed_time(b) / 1e3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernels", type=int, default=252)
    ap.add_argument("--grids", type=int, nargs="+", default=[1, 16, 132, 264])
    ap.add_argument("--mbytes", type=float, nargs="+", default=[0, 2, 8, 16, 46, 92])
    a = ap.parse_args()
    rate = copy_rate()
    print(f"{torch.cuda.get_device_name()}: copy {rate / 1e12:.2f} TB/s; {a.kernels} kernels a chain in one graph, "
          f"medians of 20 replays")
    print("| MB a kernel | programs | weights | PDL off: us a kernel | PDL on | bytes alone at copy rate | "
          "excess off / on (us) | check |")
    print("|---|---|---|---|---|---|---|---|")
    for mb in a.mbytes:
        for grid in a.grids:
            for before in ((False,) if mb == 0 else (True, False)):
                off, c0 = chain_us(a.kernels, grid, mb, before, False)
                on, c1 = chain_us(a.kernels, grid, mb, before, True)
                floor = mb * 1e6 / rate * 1e6
                ok = "ok" if c0 == c1 == a.kernels else f"BAD {c0} {c1}"
                where = "-" if mb == 0 else ("before the wait" if before else "after the wait")
                print(f"| {mb:g} | {grid} | {where} | {off:.2f} | {on:.2f} | {floor:.2f} | {off - floor:.2f} / "
                      f"{on - floor:.2f} | {ok} |", flush=True)


if __name__ == "__main__":
    main()
