"""GPU timing and ceiling measurement shared by every benchmark (CUDA events, median of many runs)."""
from __future__ import annotations

import logging
import statistics
import time
from typing import Callable

import torch

logger = logging.getLogger(__name__)


def _capture(fn: Callable[[], object], warmup: int) -> Callable[[], object]:
    """`fn` captured in a CUDA graph (after `warmup` eager calls on a side stream); returns its replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(max(warmup, 1)):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def time_cuda(fn: Callable[[], object], *, warmup: int = 5, iters: int = 50,
              flush_l2: bool = True, graph: bool = True) -> float:
    """Median wall time of `fn()` on the current CUDA device, in milliseconds.

    Each timed call is bracketed by CUDA events; the L2 cache is flushed before each call
    (a 256 MiB write) so weights are read from HBM as they would be in a real step. With `graph`
    (the default) `fn` is captured in a CUDA graph and its replays are timed, as the engine runs
    decode: a kernel of a few microseconds is then timed without the host's launch cost, and the
    flush gives the host time to queue the replay before the GPU reaches it. `fn` that cannot be
    captured (a host sync inside) is timed eagerly.
    """
    flush = torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device="cuda") if flush_l2 else None
    run = fn
    if graph:
        try:
            run = _capture(fn, warmup)
        except RuntimeError as exc:
            logger.warning("CUDA graph capture failed (%s); timing eagerly", str(exc).splitlines()[0])
            torch.cuda.synchronize()
            run = fn
    for _ in range(warmup):
        run()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        if flush is not None:
            flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def time_graph_or_wall(fn: Callable[[], object], cuda: bool) -> float:
    """Seconds of one fn(): its CUDA graph's replays on a GPU (`time_cuda`, L2 kept), else the wall time of one call
    after one warm-up call (the CPU: scripts' plumbing runs, not figures)."""
    if cuda:
        return time_cuda(fn, warmup=3, iters=20, flush_l2=False) / 1e3
    fn()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def kernel_breakdown(fn: Callable[[], object], calls: int = 5, top: int = 8) -> list[str]:
    """GPU time per call of each kernel `fn` launches (torch.profiler over `calls` calls after warm-up), as lines
    "<us per call> x<launches per call> <kernel name>", largest first."""
    from torch.profiler import ProfilerActivity, profile
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    events = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:top]
    return [f"{ev.device_time_total / calls:9.1f} us/call x{ev.count // calls} {ev.key[:90]}" for ev in events]


def measure_copy_bandwidth(nbytes: int = 2 * 1024**3) -> float:
    """Device-to-device copy bandwidth in bytes/s (bytes read + bytes written)."""
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    ms = time_cuda(lambda: dst.copy_(src), flush_l2=False, iters=20, graph=False)
    return 2 * src.numel() / (ms * 1e-3)


def measure_matmul_rate(dtype: torch.dtype, n: int = 8192) -> float:
    """Dense matmul rate in FLOP/s for bf16 (torch.matmul) or fp8 e4m3 (torch._scaled_mm)."""
    if dtype == torch.float8_e4m3fn:
        a = torch.randn(n, n, device="cuda").to(dtype)
        b = torch.randn(n, n, device="cuda").to(dtype).t()
        one = torch.ones((), device="cuda")
        fn = lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)  # noqa: E731
    else:
        a = torch.randn(n, n, device="cuda", dtype=dtype)
        b = torch.randn(n, n, device="cuda", dtype=dtype)
        fn = lambda: a @ b  # noqa: E731
    ms = time_cuda(fn, flush_l2=False, iters=20, graph=False)
    return 2 * n**3 / (ms * 1e-3)


class Ceilings(dict):
    """Measured ceilings of the current GPU: keys `copy_bps`, `bf16_flops`, `fp8_flops`."""

    @classmethod
    def measure(cls) -> "Ceilings":
        return cls(copy_bps=measure_copy_bandwidth(), bf16_flops=measure_matmul_rate(torch.bfloat16),
                   fp8_flops=measure_matmul_rate(torch.float8_e4m3fn))


def wall_and_gpu_s(fn: Callable[[], object], sleep_cycles: int = 400_000_000) -> tuple[float, float]:
    """(wall seconds of one synchronised call, GPU seconds of another queued behind a GPU sleep of `sleep_cycles`
    (~200 ms at 4e8), so the host has issued all of it before the GPU starts: its time without host stalls)."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    wall = time.perf_counter() - t
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(sleep_cycles)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return wall, start.elapsed_time(end) / 1e3
