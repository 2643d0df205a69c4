"""Prefill planning: which waiting requests join the next extend batch, and how many tokens each (chunking)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from mlaserve.core import Batch, ForwardMode, Req
from mlaserve.scheduler.decode import mix_decodes, mix_tokens

if TYPE_CHECKING:
    from mlaserve.scheduler.scheduler import Scheduler


def order_waiting(sched: "Scheduler") -> list[Req]:
    """fcfs: arrival order; lpm: longest cached prefix first (retracted requests always first)."""
    waiting = sched.waiting
    if sched.cfg.schedule_policy != "lpm" or sched.kv.tree.disable:
        return list(waiting)
    hits = {id(r): len(sched.kv.match(r)[0]) for r in waiting}
    return sorted(waiting, key=lambda r: (not r.output_ids, -hits[id(r)]))


def decode_reserve(sched: "Scheduler") -> int:
    """Slots kept back for the future tokens of requests already decoding (an estimate, see retraction)."""
    return int(sum(max(r.params.max_new_tokens - len(r.output_ids), 0) for r in sched.running)
               * sched.new_token_ratio)


def plan_prefill(sched: "Scheduler") -> Batch | None:
    cfg = sched.cfg
    chunk_cap = cfg.chunked_prefill_size if cfg.chunked_prefill_size > 0 else None
    budget = cfg.max_prefill_tokens if chunk_cap is None else min(cfg.max_prefill_tokens, chunk_cap)
    if (cfg.enable_mixed_chunk and sched.spec_tokens > 1 and sched.pending is not None and sched.running
            and (sched.chunked or sched.waiting)):
        # NOTE: the decodes' verify rows of a mixed batch sit at positions the host must know (the extend's lengths
        # are host lists): the step in flight is processed first, so this step does not overlap the one before
        sched.drain()
    candidates = ([sched.chunked] if sched.chunked else []) + order_waiting(sched)
    reserve = decode_reserve(sched)
    # --enable-mixed-chunk: the running requests take one token each of the batch (SGLang counts them the same way),
    # under speculative decoding their step's verified tokens each
    mixed = mix_tokens(sched) if cfg.enable_mixed_chunk else 0
    mixed = mixed if 0 < mixed < budget else 0
    budget -= mixed
    reserve += mixed
    picked: list[tuple[Req, int, torch.Tensor]] = []
    for req in candidates:
        running = len(sched.running) + len(picked)
        if req is not sched.chunked and running >= sched.max_running:
            break
        if req.req_pool_idx is None and not _admit(sched, req):
            break
        need = len(req.fill_ids) - req.kv_len
        if chunk_cap is None and picked and need > budget:
            _unadmit(sched, req)
            break
        n = need if chunk_cap is None else min(need, budget)
        future = 0 if n < need else int(req.params.max_new_tokens * sched.new_token_ratio)
        if sched.kv.available() - reserve < n + future and (picked or sched.running):
            _unadmit(sched, req)
            break
        slots = sched.kv.alloc(n)
        if slots is None:
            _unadmit(sched, req)
            break
        picked.append((req, n, slots))
        budget -= n
        reserve += future
        if budget <= 0:
            break
    if not picked:
        return None
    batch = _build(sched, picked)
    return mix_decodes(sched, batch) if mixed else batch


def _admit(sched: "Scheduler", req: Req) -> bool:
    slots, node = sched.kv.match(req)
    if not sched.kv.admit(req, slots, node):
        return False
    if not req.admitted_once:
        req.cached_tokens = len(slots)
        req.admitted_once = True
    return True


def _unadmit(sched: "Scheduler", req: Req) -> None:
    if req is not sched.chunked and req.kv_len == req.prefix_len:
        sched.kv.release(req)


def _build(sched: "Scheduler", picked: list[tuple[Req, int, torch.Tensor]]) -> Batch:
    reqs, ids, prefix, ext, sampling, slots = [], [], [], [], [], []
    sched.chunked = None
    for req, n, s in picked:
        start = req.kv_len
        ids.extend(req.fill_ids[start:start + n])
        sched.kv.extend(req, s)
        reqs.append(req)
        prefix.append(start)
        ext.append(n)
        done = req.kv_len == len(req.fill_ids)
        sampling.append(done)
        slots.append(s)
        if req in sched.waiting:
            sched.waiting.remove(req)
        if not done:
            sched.chunked = req
    return Batch(ForwardMode.EXTEND, reqs, ids, torch.cat(slots), prefix, ext, sampling)
