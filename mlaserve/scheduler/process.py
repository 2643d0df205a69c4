"""The scheduler process of one rank: join the other ranks, build the scheduler, report ready, then loop.

Every rank runs the same loop over the same inputs (SPMD). Rank 0 (the leader) reads the tokenizer manager's
messages from ZeroMQ and, under tensor parallelism, broadcasts each iteration's messages to the other ranks, so
every rank applies them before the same step; only the leader answers and sends outputs. A failed collective
(a rank died or hung past --dist-timeout) ends the process with one line; the launcher then ends the server.
"""
from __future__ import annotations

import faulthandler
import logging
import os
import sys
import threading
import time
import traceback
from dataclasses import replace

from mlaserve.config import ServerConfig
from mlaserve.config_resolve import rank_device, resolved_args
from mlaserve.core import FinishReason
from mlaserve.distributed import CollectiveError, ParallelInfo, RankGroup, init_distributed, shutdown_distributed
from mlaserve.engine.engine import resolve_for_device
from mlaserve.env import install_stack_dumps
from mlaserve.ipc import messages as m
from mlaserve.scheduler.entry import EXIT_LOST_RANK
from mlaserve.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)

MAX_STEP_FAILURES = 3     # consecutive failed steps before the scheduler gives up (the server then exits)
IDLE_POLL_MS = 50         # how long an idle leader waits for a message before looping (and broadcasting) again


def run_scheduler_process(server: ServerConfig, model_path: str, in_addr: str, out_addr: str, ready,
                          rank: int = 0) -> None:
    """Entry point of rank `rank`'s process: join, build, report readiness through `ready` (a Pipe end), loop."""
    import torch

    install_stack_dumps()
    info = ParallelInfo(server.parallel.tp_size, rank, server.parallel.nnodes, server.parallel.dp_size)
    tag = "scheduler" if info.world_size == 1 else f"rank {rank}"
    logging.basicConfig(level=server.log_level.upper(), format=f"[%(asctime)s {tag}] %(message)s")
    try:
        server = replace(server, load=replace(server.load, device=rank_device(server, info.local_rank)))
        server = resolve_for_device(server, model_path)        # e.g. --dist-timeout's default, before joining
        device = torch.device(server.load.device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        elif info.world_size > 1:            # CPU ranks share the cores
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // info.local_size))
        group = init_distributed(info, server.parallel.dist_init_addr, server.parallel.dist_timeout, device,
                                 peer_all_reduce=False if server.parallel.disable_custom_all_reduce else None)
        sched = Scheduler(server, model_path, group=group)
        warmup_s = None
        if not server.sched.skip_server_warmup:
            warmup_s = sched.warm_up()
            logger.info("warm-up requests done in %.2f s", warmup_s)
    except Exception as e:  # noqa: BLE001 - the parent reports it in one line
        ready.send({"error": str(e) if isinstance(e, CollectiveError) else f"{type(e).__name__}: {e}",
                    "traceback": traceback.format_exc()})
        return
    try:
        _serve(sched, group, in_addr, out_addr, ready, warmup_s)
    except CollectiveError as e:
        logger.error("%s; exiting", e)
        # NOTE: no teardown past a lost peer: destroying an NCCL group whose other ranks are gone can block (node 1
        # of two GPU "nodes" outlived node 0 by over 60 s so, 2026-11-27); the OS reclaims what the process held
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_LOST_RANK)
    finally:
        shutdown_distributed()


def _serve(sched: Scheduler, group: RankGroup, in_addr: str, out_addr: str, ready, warmup_s: float | None) -> None:
    cfg = sched.runner.cfg
    # the resolved flags (no "auto" left), then what was measured at start
    ready.send({"ok": True, "rank": group.info.rank, **resolved_args(sched.server),
                "max_total_tokens": sched.kv.num_slots, "context_length": sched.context_len,
                "max_running_requests": sched.max_running, "vocab_size": cfg.vocab_size,
                "architecture": cfg.architecture, "warmup_s": warmup_s})
    inbox = Inbox(group, in_addr, out_addr)
    watchdog = Watchdog(sched.server.sched.watchdog_timeout)
    failures = 0
    dp = sched.dp_sync
    while True:
        # NOTE: under DP attention every rank steps every iteration (the step agrees with all ranks); a leader
        # waits for messages only when no group had work, or it would hold up the groups that decode
        for data in inbox.receive(wait=not (sched.has_work or (dp is not None and dp.busy))):
            reply = _handle(sched, data)
            if reply is not None:
                inbox.send(reply)
        watchdog.beat()
        outputs, failures = _step(sched, failures, always=dp is not None)
        watchdog.idle()
        if outputs:
            inbox.send(m.BatchOutMsg(outputs))


class Inbox:
    """The step's messages: the leader reads them from ZeroMQ (waiting up to IDLE_POLL_MS when idle) and
    broadcasts them; the other ranks receive the broadcast. `send` goes out from the leader only. Under DP
    attention each group's leader reads its own socket and broadcasts within its group."""

    def __init__(self, group: RankGroup, in_addr: str, out_addr: str):
        self.group, self.leader = group, group.info.is_leader
        self.recv = self.send_sock = None
        if self.leader:
            import zmq

            ctx = zmq.Context()
            self.recv, self.send_sock = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
            self.recv.connect(in_addr)
            self.send_sock.connect(out_addr)

    def receive(self, wait: bool) -> list[bytes]:
        msgs: list[bytes] = []
        if self.leader:
            if self.recv.poll(timeout=IDLE_POLL_MS if wait else 0):
                while self.recv.poll(timeout=0):
                    msgs.append(self.recv.recv())
        return self.group.broadcast_from_leader(msgs)  # NOTE: every rank, every iteration (a no-op for one rank)

    def send(self, msg: object) -> None:
        if self.leader:
            self.send_sock.send(m.encode(msg))


def _step(sched: Scheduler, failures: int, always: bool = False) -> tuple[list[m.ReqOutput], int]:
    """One loop iteration's step; a failing step fails the requests in flight (500) and the loop goes on,
    unless steps keep failing (then the process exits and the server with it). `always`: step even without work
    (DP attention). Under DP attention a failed step ends the process: the groups' collectives would no longer
    line up."""
    try:
        return (sched.step() if always or sched.has_work else sched.step_outbox()), 0
    except Exception as e:  # noqa: BLE001 - isolated to the requests in flight
        if always or failures + 1 >= MAX_STEP_FAILURES:
            raise
        logger.exception("a scheduler step failed; ending the requests in flight")
        sched.fail_all(f"internal error in a scheduler step: {type(e).__name__}: {e}")
        return sched.step_outbox(), failures + 1


def _handle(sched: Scheduler, data: bytes) -> object | None:
    """Apply one message from the manager; an error ends only the request it concerns."""
    msg = None
    try:
        msg = m.decode(data)
        return _apply(sched, msg)
    except Exception as e:  # noqa: BLE001 - isolated to this message
        logger.exception("handling %s failed", type(msg).__name__)
        error = f"internal error: {type(e).__name__}: {e}"
        if isinstance(msg, (m.GenerateReqMsg, m.AbortReqMsg)):
            sched.abort(msg.rid, FinishReason("abort", message=error, status_code=500))
        elif isinstance(msg, m.FlushCacheReqMsg):
            return m.FlushCacheRespMsg(False)
        elif isinstance(msg, m.GetStatsReqMsg):
            return m.StatsMsg({"error": error})
        elif isinstance(msg, m.GrammarCheckReqMsg):
            return m.GrammarCheckRespMsg(msg.key, error)
        return None


def _apply(sched: Scheduler, msg: object) -> object | None:
    if isinstance(msg, m.GenerateReqMsg):
        sched.add_request(msg)
    elif isinstance(msg, m.AbortReqMsg):
        sched.abort(msg.rid)
    elif isinstance(msg, m.FlushCacheReqMsg):
        return m.FlushCacheRespMsg(sched.flush_cache())
    elif isinstance(msg, m.GetStatsReqMsg):
        return m.StatsMsg(sched.get_stats())
    elif isinstance(msg, m.GrammarCheckReqMsg):
        return m.GrammarCheckRespMsg(msg.key, sched.grammar.check(msg.kind, msg.text))
    return None


class Watchdog:
    """Exits the process (non-zero) when one step runs longer than `timeout` seconds."""

    def __init__(self, timeout: float):
        self.timeout, self.started = timeout, None
        threading.Thread(target=self._watch, daemon=True).start()

    def beat(self) -> None:
        self.started = time.monotonic()

    def idle(self) -> None:
        self.started = None

    def _watch(self) -> None:
        while True:
            time.sleep(min(1.0, self.timeout / 4))
            if self.started is not None and time.monotonic() - self.started > self.timeout:
                logger.error("watchdog: a scheduler step has run for over %.0f s; exiting (where each thread "
                             "was: below)", self.timeout)
                if sys.__stderr__ is not None:                     # e.g. which collective the step waits in
                    faulthandler.dump_traceback(file=sys.__stderr__, all_threads=True)
                os._exit(3)
