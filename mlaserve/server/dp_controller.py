"""The data-parallel controller (tokenizer-manager side, DESIGN.md sec. 2 and 6): under data-parallel attention one
ZeroMQ PUSH socket per DP group, whose leader reads it. A request goes to one group by --load-balance-method and its
abort to the same group; flush and stats go to every group, and their answers are merged (per-group stats kept
under `dp_groups`, each with its `dp_rank`). Outputs of every group come back on the manager's one PULL socket.
"""
from __future__ import annotations

import itertools

import zmq
import zmq.asyncio

from mlaserve.ipc import messages as m


def dp_addresses(send_addr: str, dp_size: int) -> list[str]:
    """The request socket of each DP group (one address, unchanged, without DP attention)."""
    return [send_addr] if dp_size == 1 else [f"{send_addr}-dp{d}" for d in range(dp_size)]


class DataParallelController:
    """Routes the manager's messages over the DP groups.

    shortest_queue counts, per group, the tokens (prompt + output so far) of the requests sent there and not
    finished: the fewest wins, ties to the lowest dp_rank. round_robin takes the groups in turn."""

    def __init__(self, ctx: zmq.asyncio.Context, addrs: list[str], method: str = "shortest_queue"):
        if method not in ("round_robin", "shortest_queue"):
            raise ValueError(f"--load-balance-method {method}: choose round_robin or shortest_queue")
        self.method = method
        self.sockets = []
        for addr in addrs:
            sock = ctx.socket(zmq.PUSH)
            sock.bind(addr)
            self.sockets.append(sock)
        self.load = [0] * len(addrs)                  # running + waiting tokens per group
        self.where: dict[str, list[int]] = {}         # rid -> [group, tokens counted in its load]
        self._turn = itertools.cycle(range(len(addrs)))

    @property
    def size(self) -> int:
        return len(self.sockets)

    def group_of(self, rid: str) -> int | None:
        entry = self.where.get(rid)
        return None if entry is None else entry[0]

    def targets(self, msg: object) -> list[zmq.asyncio.Socket]:
        """The sockets `msg` goes to: one group for a request (routed now) or a known request's abort, every group
        for control messages and for an abort of a request no longer tracked (a group without it ignores it)."""
        if isinstance(msg, m.GenerateReqMsg):
            return [self.sockets[self.route(msg)]]
        if isinstance(msg, m.AbortReqMsg) and msg.rid in self.where:
            return [self.sockets[self.where[msg.rid][0]]]
        if isinstance(msg, m.GrammarCheckReqMsg):
            return [self.sockets[0]]                  # answered once, by key
        return list(self.sockets)

    def route(self, req: m.GenerateReqMsg) -> int:
        group = next(self._turn) if self.method == "round_robin" else min(range(self.size), key=self.load.__getitem__)
        self.forget(req.rid)
        self.where[req.rid] = [group, len(req.input_ids)]
        self.load[group] += len(req.input_ids)
        return group

    def on_output(self, out: m.ReqOutput) -> None:
        entry = self.where.get(out.rid)
        if entry is None:
            return
        entry[1] += len(out.new_ids)
        self.load[entry[0]] += len(out.new_ids)
        if out.finished is not None:
            self.forget(out.rid)

    def forget(self, rid: str) -> None:
        entry = self.where.pop(rid, None)
        if entry is not None:
            self.load[entry[0]] -= entry[1]

    def replies_expected(self, msg: object) -> int:
        return 1 if isinstance(msg, m.GrammarCheckReqMsg) else self.size

    @staticmethod
    def merge(replies: list[object]) -> object:
        """One answer from every group's: flush succeeds when all did; stats are summed (token_usage recomputed)
        with each group's own under `dp_groups`, in dp_rank order."""
        if all(isinstance(r, m.FlushCacheRespMsg) for r in replies):
            return m.FlushCacheRespMsg(all(r.ok for r in replies))
        if all(isinstance(r, m.StatsMsg) for r in replies):
            return m.StatsMsg(merge_stats([r.stats for r in replies]))
        raise RuntimeError(f"mismatched answers from the DP groups: {[type(r).__name__ for r in replies]}")


def merge_stats(groups: list[dict]) -> dict:
    groups = sorted(groups, key=lambda s: s.get("dp_rank", 0))
    total: dict = {}
    for key in groups[0]:
        values = [g.get(key) for g in groups]
        if key != "dp_rank" and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            total[key] = sum(values)
    errors = [g["error"] for g in groups if "error" in g]
    if errors:
        total["error"] = errors[0]
    if total.get("max_total_tokens"):
        total["token_usage"] = total.get("used_tokens", 0) / total["max_total_tokens"]
    if "avg_spec_accept_length" in total:
        total["avg_spec_accept_length"] = total.get("spec_tokens", 0) / max(total.get("spec_verify_steps", 0), 1)
    return {**total, "dp_groups": groups}
