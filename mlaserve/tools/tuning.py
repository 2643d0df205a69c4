"""Shared parts of the kernel tuners (`mlaserve tune ...`): parallel pre-compilation and the search loop.

Triton compiles a candidate config in one to a few seconds, far longer than timing it; a search over a few
hundred candidates would spend nearly all its time in the compiler on one CPU core. `precompile` runs each
candidate once in spawned worker processes (one CUDA context each, small inputs with the same compile-time
specialisation as the real ones), which fills Triton's on-disk cache; the timing process then loads every
kernel from that cache instead of compiling it.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import sys
from typing import Any, Callable, Iterable

import torch

from mlaserve.bench.timing import time_cuda

Config = dict[str, Any]


def _call(item: tuple[Callable[[Any], None], Any]) -> bool:
    worker, job = item
    try:
        worker(job)
        if torch.cuda.is_initialized():
            torch.cuda.synchronize()
        return True
    except Exception:  # noqa: BLE001 -- a candidate that cannot compile (registers, shared memory) is skipped
        return False


def precompile(worker: Callable[[Any], None], jobs: Iterable[Any], processes: int | None = None) -> int:
    """Run `worker(job)` for every job in spawned processes (the worker must be a module-level function).

    Returns the number of jobs that raised. With `processes=0` the jobs run in this process (tests).
    """
    jobs = list(jobs)
    if not jobs:
        return 0
    if processes is None:
        processes = max(1, min(len(jobs), 16, (os.cpu_count() or 2) - 1))
    if processes == 0:
        return sum(not _call((worker, job)) for job in jobs)
    with mp.get_context("spawn").Pool(processes) as pool:
        return sum(not ok for ok in pool.imap_unordered(_call, [(worker, job) for job in jobs]))


def best_config(candidates: Iterable[Config], timer: Callable[[Config], float],
                label: str = "") -> tuple[Config, float]:
    """The candidate with the least `timer(cfg)` (ms); candidates whose timer raises are skipped."""
    best, best_ms = None, float("inf")
    for cfg in candidates:
        try:
            ms = timer(cfg)
        except Exception as exc:  # noqa: BLE001 -- out of shared memory / registers for this tile
            print(f"  {label} skip {cfg}: {type(exc).__name__}", file=sys.stderr)
            continue
        if ms < best_ms:
            best, best_ms = cfg, ms
    assert best is not None, f"no candidate config ran {label}"
    return best, best_ms


def graph_timer(fn: Callable[[], object], iters: int = 10) -> float:
    """Median ms of `fn` replayed from a CUDA graph, L2 flushed before each replay (the tuners' timer)."""
    return time_cuda(fn, warmup=2, iters=iters)
