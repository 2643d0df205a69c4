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
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import NamedTuple

import zmq

from mlaserve import demo
from mlaserve.config import ModelConfig, ParallelConfig, ServerConfig
from mlaserve.config_resolve import precheck
from mlaserve.scheduler.entry import EXIT_LOST_RANK, run_scheduler
from mlaserve.server.dp_controller import dp_addresses
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
        if addr.startswith("ipc://"):
            Path(addr.removeprefix("ipc://")).unlink(missing_ok=True)


class ZmqAddresses(NamedTuple):
    """Where node 0's tokenizer manager binds its sockets and where the schedulers' leaders connect to them: the
    request socket (one per DP-attention group: a list) and the output socket."""

    bind_send: str | list[str]
    bind_recv: str
    send: str | list[str]
    recv: str


def zmq_addresses(p: ParallelConfig) -> ZmqAddresses:
    """ipc files on node 0; under DP attention over several nodes TCP on the ports after --dist-init-addr's
    (groups 0 .. D-1's requests on port + 1 .. port + D, outputs on port + D + 1), as leaders on other nodes
    read their group's requests there."""
    if not (p.enable_dp_attention and p.nnodes > 1):
        send, recv = ipc_addresses()
        sends = dp_addresses(send, p.dp_size)
        send_to = sends if len(sends) > 1 else send
        return ZmqAddresses(send_to, recv, send_to, recv)
    host, _, port = p.dist_init_addr.rpartition(":")
    ports = [int(port) + 1 + d for d in range(p.dp_size + 1)]
    return ZmqAddresses([f"tcp://*:{q}" for q in ports[:-1]], f"tcp://*:{ports[-1]}",
                        [f"tcp://{host}:{q}" for q in ports[:-1]], f"tcp://{host}:{ports[-1]}")


# --- the scheduler processes (one per rank of this node) -----------------------------------------------

@dataclass
class SchedulerHandle:
    """This node's rank processes (rank order; rank 0, the leader, first on node 0) and the leader's ready info."""

    processes: list[mp.Process]
    ranks: list[int]
    info: dict
    send_addr: str | list[str] | None          # one per DP-attention group under DP attention
    recv_addr: str | None
    stopped: bool = field(default=False, repr=False)

    def __post_init__(self) -> None:
        atexit.register(self.stop)          # a caller that never stops us still leaves nothing behind

    @property
    def process(self) -> mp.Process:
        return self.processes[0]

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.processes)

    def death(self) -> str | None:
        """One line naming a rank process that is gone (one that went first rather than one that lost contact
        with it), or None while all run."""
        dead = [(r, p.exitcode) for r, p in zip(self.ranks, self.processes) if not p.is_alive()]
        if not dead:
            return None
        rank, code = min(dead, key=lambda d: d[1] == EXIT_LOST_RANK)
        how = f"killed by {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit code {code}"
        return f"{_who(rank, len(self.processes))} died ({how})"

    def stop(self, timeout: float = 5.0) -> None:
        """Stop every rank (terminate, then kill) and remove the ipc files; idempotent."""
        for proc in self.processes:
            if proc.is_alive():
                proc.terminate()
        for proc in self.processes:
            _reap(proc, timeout)
        sends = self.send_addr if isinstance(self.send_addr, list) else [self.send_addr]
        remove_ipc_files(*(a for a in (*sends, self.recv_addr) if a))
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


def _who(rank: int, world: int) -> str:
    return "the scheduler process" if world == 1 and rank == 0 else f"rank {rank}'s scheduler process"


def _how(code: int | None) -> str:
    if code is not None and code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


def _exit_reason(rank: int, world: int, code: int | None) -> str:
    if code == NO_MAIN_GUARD_EXIT:
        return NO_MAIN_GUARD_MESSAGE
    return f"{_who(rank, world)} {_how(code)} before it was ready"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def start_scheduler(server: ServerConfig, model_path: str, send_addr: str | list[str] | None, recv_addr: str | None,
                    timeout: float = 1800.0) -> SchedulerHandle:
    """Spawn this node's rank processes and wait until every one is ready (LaunchError naming the rank, all
    reaped, if one is not). Without --dist-init-addr a single node's ranks meet on a free loopback port.
    `send_addr`: a list under DP attention, group d's leader (rank d * tp / dp) reading the d-th."""
    p = server.parallel
    local = p.tp_size // p.nnodes
    if p.tp_size > 1 and p.dist_init_addr is None:
        server = replace(server, parallel=replace(p, dist_init_addr=f"127.0.0.1:{free_port()}"))
    ranks = list(range(p.node_rank * local, (p.node_rank + 1) * local))
    ctx = mp.get_context("spawn")
    procs, readers = [], []
    try:
        for rank in ranks:
            reader, writer = ctx.Pipe(duplex=False)
            in_addr = send_addr[rank // (p.tp_size // p.dp_size)] if isinstance(send_addr, list) else send_addr
            proc = ctx.Process(target=run_scheduler, args=(server, model_path, in_addr, recv_addr, writer, rank),
                               daemon=True, name=f"mlaserve-rank{rank}" if p.tp_size > 1 else "mlaserve-scheduler")
            proc.start()
            writer.close()
            procs.append(proc)
            readers.append(reader)
        infos = _wait_ready(procs, ranks, readers, p.tp_size, timeout)
    except BaseException:
        for proc in procs:
            _reap(proc)
        raise
    finally:
        for reader in readers:
            reader.close()
    return SchedulerHandle(procs, ranks, infos[0], send_addr, recv_addr)


def _wait_ready(procs: list, ranks: list[int], readers: list, world: int, timeout: float) -> list[dict]:
    infos: dict[int, dict] = {}
    waited = 0.0
    while len(infos) < len(procs):
        for i, (proc, reader) in enumerate(zip(procs, readers)):
            if i not in infos and reader.poll():
                infos[i] = _ready_info(proc, ranks[i], reader, world)
        if len(infos) == len(procs):
            break
        for i, proc in enumerate(procs):
            if i not in infos and not proc.is_alive() and not readers[i].poll():
                raise LaunchError(_exit_reason(ranks[i], world, proc.exitcode))
        if waited > timeout:
            raise LaunchError(f"the scheduler was not ready after {timeout:.0f} s")
        time.sleep(0.2)
        waited += 0.2
    return [infos[i] for i in range(len(procs))]


def _ready_info(proc: mp.Process, rank: int, reader, world: int) -> dict:
    try:
        info = reader.recv()
    except EOFError:                        # it died (the pipe closed) before reporting
        proc.join(5)
        raise LaunchError(_exit_reason(rank, world, proc.exitcode)) from None
    if "error" in info:
        who = "the scheduler" if world == 1 else f"rank {rank}"
        raise LaunchError(f"{who} failed to start: {info['error']}")
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
    """The HTTP listening socket, bound before anything is loaded (a busy port fails in one line, at once).

    NOTE: proto IPPROTO_TCP, not 0: asyncio turns Nagle off (TCP_NODELAY) only on accepted sockets whose proto says
    TCP. With Nagle on, a streamed response's first chunk waits for the client's delayed ACK of the headers, and
    every request on a kept-alive connection gets its first token ~40 ms late."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
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


def _checked_model_path(server: ServerConfig) -> str:
    if server.load.model_path is not None:
        check_model_path(server.load.model_path)
    path = server.load.model_path or str(demo_model_path())
    precheck(server, path)                   # a bad flag combination: one ConfigError line, no process started
    return path


def launch_ranks(server: ServerConfig) -> SchedulerHandle:
    """A node other than node 0 (`--node-rank N`): start its ranks only (no HTTP, no tokenizer; under DP attention
    its groups' leaders connect to node 0's manager over TCP)."""
    path = _checked_model_path(server)
    if not server.parallel.enable_dp_attention:
        return start_scheduler(server, path, None, None)
    addrs = zmq_addresses(server.parallel)
    return start_scheduler(server, path, addrs.send, addrs.recv)


def launch_backend(server: ServerConfig) -> tuple[str, SchedulerHandle, TokenizerManager]:
    """Start the scheduler processes and build the tokenizer manager (call from the event loop's thread)."""
    path = _checked_model_path(server)
    if server.parallel.node_rank:
        raise LaunchError(f"--node-rank {server.parallel.node_rank}: only node 0 serves requests; start the other "
                          "nodes with `mlaserve serve --node-rank N`")
    tokenizer = _load_tokenizer(server.load.tokenizer_path or path)
    addrs = zmq_addresses(server.parallel)
    _check_ports_free(addrs, server.parallel)
    handle = None
    try:
        handle = start_scheduler(server, path, addrs.send, addrs.recv)
        try:
            manager = TokenizerManager(tokenizer, addrs.bind_send, addrs.bind_recv, handle.info,
                                       seed=server.load.seed, alive=handle.alive)
        except zmq.ZMQError as e:
            raise LaunchError(f"cannot open the schedulers' sockets ({', '.join(_listed(addrs))}): {e}") from None
        return path, handle, manager
    except BaseException:
        if handle is not None:
            handle.stop()
        remove_ipc_files(*_listed(addrs))
        raise


def _check_ports_free(addrs: ZmqAddresses, p: ParallelConfig) -> None:
    """Before any rank starts: one line for a TCP port of the manager's that another program holds."""
    for addr in _listed(addrs):
        if addr.startswith("tcp://"):
            port = int(addr.rpartition(":")[2])
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind(("", port))
                except OSError as e:
                    raise LaunchError(f"--dist-init-addr {p.dist_init_addr}: port {port}, which DP attention over "
                                      f"several nodes uses for the groups' messages, is in use ({e.strerror})") from None


def _listed(addrs: ZmqAddresses) -> list[str]:
    sends = addrs.bind_send if isinstance(addrs.bind_send, list) else [addrs.bind_send]
    return [*sends, addrs.bind_recv]


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
