"""GPU timing and ceiling measurement shared by every benchmark (CUDA events, median of many runs)."""
from __future__ import annotations

import statistics
from typing import Callable

import torch


def time_cuda(fn: Callable[[], object], *, warmup: int = 5, iters: int = 50,
              flush_l2: bool = True) -> float:
    """Median wall time of `fn()` on the current CUDA device, in milliseconds.

    Each timed call is bracketed by CUDA events; the L2 cache is flushed before each call
    (a 256 MiB write) so weights are read from HBM as they would be in a real step.
    """
    flush = torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device="cuda") if flush_l2 else None
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        if flush is not None:
            flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def measure_copy_bandwidth(nbytes: int = 2 * 1024**3) -> float:
    """Device-to-device copy bandwidth in bytes/s (bytes read + bytes written)."""
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    ms = time_cuda(lambda: dst.copy_(src), flush_l2=False, iters=20)
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
    ms = time_cuda(fn, flush_l2=False, iters=20)
    return 2 * n**3 / (ms * 1e-3)


class Ceilings(dict):
    """Measured ceilings of the current GPU: keys `copy_bps`, `bf16_flops`, `fp8_flops`."""

    @classmethod
    def measure(cls) -> "Ceilings":
        return cls(copy_bps=measure_copy_bandwidth(), bf16_flops=measure_matmul_rate(torch.bfloat16),
                   fp8_flops=measure_matmul_rate(torch.float8_e4m3fn))
