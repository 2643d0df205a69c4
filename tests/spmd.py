"""Run a function on several CPU ranks (one spawned process each, gloo), as the server's rank processes do."""
from __future__ import annotations

import multiprocessing as mp
import traceback
from typing import Any, Callable

import torch

from mlaserve.distributed import ParallelInfo, init_distributed, shutdown_distributed
from mlaserve.server.launch import free_port


def _rank_main(fn: Callable, rank: int, world: int, addr: str, args: tuple, conn) -> None:
    torch.set_num_threads(1)
    try:
        group = init_distributed(ParallelInfo(world, rank), addr, 120, torch.device("cpu"))
        conn.send(("ok", fn(group, *args)))
    except BaseException:  # noqa: BLE001 - reported to the test
        conn.send(("error", traceback.format_exc()))
    finally:
        shutdown_distributed()


def run_ranks(fn: Callable, world: int, *args: Any, timeout: float = 300) -> list[Any]:
    """fn(group, *args) on `world` ranks; returns each rank's result (fn must be importable by name)."""
    ctx = mp.get_context("spawn")
    addr = f"127.0.0.1:{free_port()}"
    pipes, procs = [], []
    for rank in range(world):
        recv, send = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_rank_main, args=(fn, rank, world, addr, args, send), daemon=True)
        proc.start()
        send.close()
        pipes.append(recv)
        procs.append(proc)
    results = []
    try:
        for rank, recv in enumerate(pipes):
            if not recv.poll(timeout):
                raise AssertionError(f"rank {rank} gave no result in {timeout} s")
            status, value = recv.recv()
            if status != "ok":
                raise AssertionError(f"rank {rank} failed:\n{value}")
            results.append(value)
    finally:
        for proc in procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
    return results
