"""`mlaserve serve`: the scheduler in its own process, the HTTP server (FastAPI + uvicorn) and tokenizer here.

Exits 0 on SIGINT / SIGTERM (scheduler stopped, no process left behind) and non-zero when the scheduler
process dies or cannot start.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
import time
from collections.abc import Iterator
from typing import Any

import uvicorn

from mlaserve.config import ServerConfig, add_config_args, config_from_args

logger = logging.getLogger("mlaserve.serve")

MONITOR_INTERVAL_S = 0.5
DEAD_GRACE_S = 1.0            # /health answers 503 this long before the server exits after the scheduler died
GRACEFUL_SHUTDOWN_S = 5


class _Uvicorn(uvicorn.Server):
    """uvicorn, minus re-raising SIGINT / SIGTERM after its graceful shutdown (we stop the scheduler, exit 0)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        old = {s: signal.signal(s, self.handle_exit) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for s, handler in old.items():
                signal.signal(s, handler)


def parse_args(argv: list[str]) -> ServerConfig:
    parser = argparse.ArgumentParser(
        prog="mlaserve serve", description="Serve a DeepSeek V2/V3/R1 checkpoint over an OpenAI-compatible HTTP "
        "API. Without --model-path, serves the built-in demo model (trained on Python source, shipped in the package).")
    add_config_args(parser)
    return config_from_args(parser.parse_args(argv))


def main(argv: list[str]) -> int:
    cfg = parse_args(argv)
    logging.basicConfig(level=cfg.log_level.upper(), format="[%(asctime)s %(name)s] %(levelname)s %(message)s")
    return run(cfg)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def run(cfg: ServerConfig) -> int:
    """Start the backend, serve until a signal (-> 0) or the scheduler's death (-> 1); a user error found while
    starting (missing model or template, busy port, scheduler start failure) -> one line and 1."""
    from mlaserve.server.launch import LaunchError, launch_backend, listen, read_chat_template
    from mlaserve.config import ConfigError

    signal.signal(signal.SIGTERM, _interrupt)   # during start-up: unwind; launch_backend reaps what it started
    if cfg.parallel.node_rank > 0:
        return run_ranks_only(cfg)
    sock = None
    try:
        chat_template = read_chat_template(cfg.chat_template)
        sock = listen(cfg.host, cfg.port)
        path, handle, manager = launch_backend(cfg)
    except (LaunchError, ConfigError) as e:
        logger.error("%s", e)
        return _close(sock, 1)
    except KeyboardInterrupt:
        return _close(sock, 0)
    try:
        return asyncio.run(_serve(cfg, path, handle, manager, sock, chat_template))
    except KeyboardInterrupt:
        return 0
    finally:
        handle.stop()
        sock.close()


def run_ranks_only(cfg: ServerConfig) -> int:
    """`--node-rank N > 0`: run this node's ranks until a signal (-> 0) or until one of them ends (-> 1, one line
    naming it; a rank ends when a collective fails, e.g. because node 0 went away)."""
    from mlaserve.config import ConfigError
    from mlaserve.server.launch import LaunchError, launch_ranks

    try:
        handle = launch_ranks(cfg)
    except (LaunchError, ConfigError) as e:
        logger.error("%s", e)
        return 1
    except KeyboardInterrupt:
        return 0
    logger.info("node %d: ranks %s ready", cfg.parallel.node_rank, handle.ranks)
    try:
        while handle.alive():
            time.sleep(MONITOR_INTERVAL_S)
        logger.error("%s; stopping this node's ranks", handle.death())
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        handle.stop()


def _close(sock: Any, code: int) -> int:
    if sock is not None:
        sock.close()
    return code


async def _serve(cfg: ServerConfig, path: str, handle: Any, manager: Any, sock: Any,
                 chat_template: str | None) -> int:
    from mlaserve.server.openai import create_app

    metrics = None
    if cfg.enable_metrics:
        from mlaserve.server.metrics import ServerMetrics

        metrics = manager.metrics = ServerMetrics()
    if chat_template is not None:
        manager.tokenizer.chat_template = chat_template
    if cfg.load.model_path is None:
        logger.warning("serving the built-in demo model from %s: a 15M-parameter model trained on Python "
                       "source (it writes code, not conversation); pass --model-path to serve a real checkpoint", path)
    manager.start()
    app = create_app(manager, manager.tokenizer, cfg, model_path=path, handle=handle, metrics=metrics)
    server = _Uvicorn(uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level=cfg.log_level,
                                     timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S))
    died: list[bool] = []
    monitor = asyncio.ensure_future(_monitor(server, handle, manager, died))
    try:
        await server.serve(sockets=[sock])
    finally:
        monitor.cancel()
        await manager.aclose()
    if died:
        return 1
    if not server.started:
        logger.error("the HTTP server did not start on %s:%d", cfg.host, cfg.port)
        return 1
    return 0


async def _monitor(server: uvicorn.Server, handle: Any, manager: Any, died: list[bool]) -> None:
    """Stop the server (exit code 1) when the scheduler process dies or the manager can serve no more."""
    while handle.alive() and manager.dead is None:
        await asyncio.sleep(MONITOR_INTERVAL_S)
    if handle.alive():
        logger.error("%s; shutting the server down", manager.dead)
    else:
        logger.error("%s; shutting the server down", handle.death())
    died.append(True)
    await asyncio.sleep(DEAD_GRACE_S)
    server.should_exit = True


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
