"""Process topology: the scheduler runs in its own (spawned) process; the main process binds the ZeroMQ
sockets, waits for the scheduler to report ready, and watches it for the rest of its life.

Nothing here imports the model stack: the spawn target is `mlaserve.scheduler.entry.run_scheduler`, which
imports the scheduler (models, kernels, Triton) in the child. User errors found while starting raise
`LaunchError` with a one-line message; every exit path removes the ZeroMQ ipc files.
"""
from __future__ import annotations

import atexit
import json
import logging
import multiprocessing as mp
import os
import signal
import socket
import tempfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from mlaserve import demo
from mlaserve.config import ModelConfig, ServerConfig
from mlaserve.config_resolve import precheck
from mlaserve.scheduler.entry import run_scheduler
from mlaserve.server.manager import TokenizerManager
from mlaserve.tokenizer import Tokenizer, load_tokenizer

logger = logging.getLogger(__name__)

# Exit code of a spawned child that re-ran an unguarded `__main__` script (see `refuse_spawned_reimport`).
NO_MAIN_GUARD_EXIT = 86
NO_MAIN_GUARD_MESSAGE = ("mlaserve.Engine was created at the top level of a script without an "
                         "`if __name__ == \"__main__\":` guard; the scheduler process is spawned and re-runs the "
                         "script's top level, so create the Engine under that guard")


class LaunchError(RuntimeError):
    """The server or engine could not start (the message says why in one line)."""


def refuse_spawned_reimport() -> None:
    """Exit quietly if this process is a spawned child still importing the parent's `__main__` script (an
    Engine created at a script's top level without the `__main__` guard); the parent then reports it."""
    if getattr(mp.current_process(), "_inheriting", False):
        raise SystemExit(NO_MAIN_GUARD_EXIT)


# --- ZeroMQ ipc files ------------------------------------------------------------------------------

def ipc_addresses() -> tuple[str, str]:
    base = Path(tempfile.gettempdir()) / f"mlaserve-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    return f"ipc://{base}-req", f"ipc://{base}-out"


def remove_ipc_files(*addrs: str) -> None:
    for addr in addrs:
        Path(addr.removeprefix("ipc://")).unlink(missing_ok=True)


# --- the scheduler process --------------------------------------------------------------------------

@dataclass
class SchedulerHandle:
    process: mp.Process
    info: dict
    send_addr: str
    recv_addr: str
    stopped: bool = field(default=False, repr=False)

    def __post_init__(self) -> None:
        atexit.register(self.stop)          # a caller that never stops us still leaves nothing behind

    def alive(self) -> bool:
        return self.process.is_alive()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the scheduler (terminate, then kill) and remove the ipc files; idempotent."""
        _reap(self.process, timeout)
        remove_ipc_files(self.send_addr, self.recv_addr)
        if not self.stopped:
            self.stopped = True
            atexit.unregister(self.stop)


def _reap(proc: mp.Process, timeout: float = 5.0) -> None:
    if proc.is_alive():
        proc.terminate()
        proc.join(timeout)
    if proc.is_alive():
        proc.kill()
    proc.join(timeout)


def _exit_reason(code: int | None) -> str:
    if code == NO_MAIN_GUARD_EXIT:
        return NO_MAIN_GUARD_MESSAGE
    if code is not None and code < 0:
        return f"the scheduler process was killed by {signal.Signals(-code).name} before it was ready"
    return f"the scheduler process exited with code {code} before it was ready"


def start_scheduler(server: ServerConfig, model_path: str, send_addr: str, recv_addr: str,
                    timeout: float = 1800.0) -> SchedulerHandle:
    """Spawn the scheduler process and wait until it is ready (LaunchError, child reaped, if it is not)."""
    ctx = mp.get_context("spawn")
    reader, writer = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=run_scheduler, args=(server, model_path, send_addr, recv_addr, writer),
                       daemon=True, name="mlaserve-scheduler")
    proc.start()
    writer.close()
    try:
        info = _wait_ready(proc, reader, timeout)
    except BaseException:
        _reap(proc)
        raise
    finally:
        reader.close()
    return SchedulerHandle(proc, info, send_addr, recv_addr)


def _wait_ready(proc: mp.Process, reader, timeout: float) -> dict:
    waited = 0.0
    while not reader.poll(1.0):
        waited += 1.0
        if not proc.is_alive():
            raise LaunchError(_exit_reason(proc.exitcode))
        if waited > timeout:
            raise LaunchError(f"the scheduler was not ready after {timeout:.0f} s")
    try:
        info = reader.recv()
    except EOFError:                        # it died (the pipe closed) before reporting
        proc.join(5)
        raise LaunchError(_exit_reason(proc.exitcode)) from None
    if "error" in info:
        raise LaunchError(f"the scheduler failed to start: {info['error']}")
    return info


# --- start-up checks ---------------------------------------------------------------------------------

def check_model_path(path: str) -> None:
    """One line for a model path that cannot be served: missing directory or an unreadable config.json."""
    if not Path(path).is_dir():
        raise LaunchError(f"--model-path {path}: no such directory")
    try:
        ModelConfig.from_hf(path)
    except json.JSONDecodeError as e:
        raise LaunchError(f"--model-path {path}: config.json is not valid JSON ({e})") from None
    except KeyError as e:
        raise LaunchError(f"--model-path {path}: config.json has no key {e}") from None
    except (OSError, ValueError, TypeError) as e:
        raise LaunchError(f"--model-path {path}: {e}") from None


def read_chat_template(path: str | None) -> str | None:
    if path is None:
        return None
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise LaunchError(f"--chat-template {path}: {getattr(e, 'strerror', None) or e}") from None


def listen(host: str, port: int) -> socket.socket:
    """The HTTP listening socket, bound before anything is loaded (a busy port fails in one line, at once)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise LaunchError(f"--host {host} --port {port}: {e.strerror or e}") from None
    sock.set_inheritable(False)
    return sock


def _load_tokenizer(path: str) -> Tokenizer:
    try:
        return load_tokenizer(path)
    except Exception as e:  # noqa: BLE001 - tokenizers raises plain Exception for a bad file
        raise LaunchError(f"cannot load the tokenizer from {path}: {e}") from None


def launch_backend(server: ServerConfig) -> tuple[str, SchedulerHandle, TokenizerManager]:
    """Start the scheduler process and build the tokenizer manager (call from the event loop's thread)."""
    if server.load.model_path is not None:
        check_model_path(server.load.model_path)
    path = server.load.model_path or str(demo_model_path())
    precheck(server, path)                   # a bad flag combination: one ConfigError line, no process started
    tokenizer = _load_tokenizer(server.load.tokenizer_path or path)
    send_addr, recv_addr = ipc_addresses()
    handle = None
    try:
        handle = start_scheduler(server, path, send_addr, recv_addr)
        return path, handle, TokenizerManager(tokenizer, send_addr, recv_addr, handle.info, seed=server.load.seed,
                                              alive=handle.alive)
    except BaseException:
        if handle is not None:
            handle.stop()
        remove_ipc_files(send_addr, recv_addr)
        raise


# --- the demo model ------------------------------------------------------------------------------------

def demo_model_path(fp8: bool = False) -> Path:
    """The built-in demo model (`mlaserve.demo`: trained on Python source, shipped as package data).
    `fp8=True`: its block-FP8 copy, made once into the cache directory by a child process (quantising
    imports the model stack, which the HTTP process never does)."""
    if not (demo.DEMO_DIR / "config.json").exists():
        raise LaunchError(f"the built-in demo model is missing from {demo.DEMO_DIR}; pass --model-path")
    if not fp8:
        return demo.DEMO_DIR
    path = demo.fp8_dir()
    if demo.has_fp8():
        return path
    logger.warning("quantising the built-in demo model to block FP8 into %s", path)
    proc = mp.get_context("spawn").Process(target=demo.build_fp8, name="mlaserve-demo-fp8")
    proc.start()
    proc.join()
    if proc.exitcode == NO_MAIN_GUARD_EXIT:
        raise LaunchError(NO_MAIN_GUARD_MESSAGE)
    if proc.exitcode != 0:
        raise LaunchError(f"quantising the demo model into {path} failed (exit code {proc.exitcode})")
    return path
