"""Process topology: the scheduler runs in its own (spawned) process; the main process binds the ZeroMQ
sockets, waits for the scheduler to report ready, and watches it for the rest of its life."""
from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

from mlaserve.config import ServerConfig
from mlaserve.scheduler.scheduler import run_scheduler_process

logger = logging.getLogger(__name__)

DEMO_SOURCE = "deepseek-v3"
DEMO_LAYERS = 4


class LaunchError(RuntimeError):
    """The scheduler could not start (the message says why in one line)."""


@dataclass
class SchedulerHandle:
    process: mp.Process
    info: dict
    send_addr: str
    recv_addr: str

    def alive(self) -> bool:
        return self.process.is_alive()

    def stop(self, timeout: float = 5.0) -> None:
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout)


def ipc_addresses() -> tuple[str, str]:
    base = Path(tempfile.gettempdir()) / f"mlaserve-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    return f"ipc://{base}-req", f"ipc://{base}-out"


def start_scheduler(server: ServerConfig, model_path: str, send_addr: str, recv_addr: str,
                    timeout: float = 1800.0) -> SchedulerHandle:
    """Spawn the scheduler process (the caller has bound both addresses) and wait until it is ready."""
    ctx = mp.get_context("spawn")
    reader, writer = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=run_scheduler_process, args=(server, model_path, send_addr, recv_addr, writer),
                       daemon=True, name="mlaserve-scheduler")
    proc.start()
    writer.close()
    waited = 0.0
    while not reader.poll(1.0):
        waited += 1.0
        if not proc.is_alive():
            raise LaunchError(f"the scheduler process exited with code {proc.exitcode} before it was ready")
        if waited > timeout:
            proc.kill()
            raise LaunchError(f"the scheduler was not ready after {timeout:.0f} s")
    info = reader.recv()
    if "error" in info:
        proc.join(10)
        raise LaunchError(f"the scheduler failed to start: {info['error']}")
    return SchedulerHandle(proc, info, send_addr, recv_addr)


def demo_model_path() -> Path:
    """The built-in demo model: a shrunken DeepSeek-V3-architecture checkpoint with RANDOM weights
    (MLA, noaux_tc MoE, MTP layer, tokenizer, chat template), built once into ~/.cache/mlaserve/."""
    from mlaserve.tools.make_checkpoint import make_config, write_checkpoint

    root = Path(os.environ.get("MLASERVE_CACHE", Path.home() / ".cache" / "mlaserve"))
    path = root / f"demo-{DEMO_SOURCE}-{DEMO_LAYERS}l"
    if (path / "tokenizer.json").exists() and (path / "model.safetensors.index.json").exists():
        return path
    logger.warning("building the built-in demo model into %s (random weights: its text is gibberish)", path)
    src = json.loads(_model_config_text(DEMO_SOURCE))
    cfg = make_config(src, num_layers=DEMO_LAYERS, shrink=True, fp8=False)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    write_checkpoint(cfg, tmp, seed=0, progress=False)
    tmp.rename(path)
    return path


def _model_config_text(name: str) -> str:
    from importlib.resources import files

    return (files("mlaserve") / "tools" / "configs" / f"{name}.json").read_text()
