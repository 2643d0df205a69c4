"""The scheduler processes' spawn target, importable without the model stack: the HTTP process names it, the
spawned child imports the scheduler (models, kernels, Triton) when it runs."""
from __future__ import annotations

from typing import Any

from mlaserve.config import ServerConfig

EXIT_LOST_RANK = 4        # exit code of a rank whose collective with the other ranks failed (not the first to go)


def run_scheduler(server: ServerConfig, model_path: str, in_addr: str, out_addr: str, ready: Any,
                  rank: int = 0) -> None:
    """See `mlaserve.scheduler.process.run_scheduler_process`."""
    import threading

    from tqdm import tqdm

    from mlaserve.scheduler.process import run_scheduler_process

    # NOTE: tqdm's default lock (the weight loader's progress bar) holds a multiprocessing semaphore, which a rank
    # stopped by a signal never unlinks: the resource tracker then warns of a leaked semaphore at shutdown. One
    # process, one bar at a time: a thread lock does.
    tqdm.set_lock(threading.RLock())

    run_scheduler_process(server, model_path, in_addr, out_addr, ready, rank)
