"""Decode planning: one new token for every running request, retracting the newest when the pool is short, or
(--enable-mixed-chunk) riding along in a prefill batch."""
from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from mlaserve.core import Batch, FinishReason, ForwardMode, Req

if TYPE_CHECKING:
    from mlaserve.scheduler.scheduler import Scheduler


def retract(sched: "Scheduler", req: Req) -> None:
    """Preempt `req`: its computed KV goes to the prefix tree, it waits at the head of the queue and later
    resumes from prompt + outputs so far (with the same sampling seed and step, so identical results); its
    grammar matcher is dropped and rebuilt by replaying those outputs."""
    sched.kv.release(req)
    sched.grammar.release_matcher(req)
    sched.running.remove(req)
    sched.waiting.insert(0, req)
    sched.num_retracted += 1


def plan_decode(sched: "Scheduler") -> Batch | None:
    """One new token per running request, or under speculative decoding k = `spec_tree.slots_per_step` slots each
    (the last token and the drafts; those past the accepted ones are freed after the step)."""
    k = sched.spec_tokens
    if sched.running and sched.kv.available() < k * len(sched.running):
        sched.drain()                         # retraction needs every request's tokens on the CPU
    while sched.running and sched.kv.available() < k * len(sched.running):
        if len(sched.running) == 1 and sched.chunked is None:
            # NOTE: alone it would never fit after a retraction either (check_request prevents this): end it
            req = sched.running[0]
            sched.end(req, FinishReason("length", length=len(req.output_ids)))
            break
        newest = max(sched.running, key=lambda r: r.arrival)
        retract(sched, newest)
        sched.new_token_ratio = min(1.0, sched.new_token_ratio + 0.1)
    if not sched.running:
        return None
    reqs = list(sched.running)
    slots = sched.kv.alloc(k * len(reqs))
    assert slots is not None, "decode slots must be available after retraction"
    prefix = [r.kv_len for r in reqs]
    if k == 1:
        sched.kv.extend_one_each(reqs, slots)
    else:
        sched.kv.extend_each(reqs, slots, k)
    sched.new_token_ratio = max(sched.cfg.min_new_token_ratio, sched.new_token_ratio - 0.001)
    # NOTE: input ids are read on the device from the runner's token_buf (the last step may be in flight)
    return Batch(ForwardMode.DECODE, reqs, [], slots, prefix, [k] * len(reqs), [True] * len(reqs))


def mix_decodes(sched: "Scheduler", batch: Batch) -> Batch:
    """--enable-mixed-chunk: `batch` (a prefill or prompt chunk) with every running request appended as a one-token
    extend over its cached tokens, so decoding does not pause for the prefill. `batch` alone when their slots
    cannot be had (`plan_prefill` kept them back, so only when the pool is nearly full; they then wait a step)."""
    reqs = list(sched.running)
    slots = sched.kv.alloc(len(reqs)) if reqs else None
    if slots is None:
        return batch
    prefix = [r.kv_len for r in reqs]
    sched.kv.extend_one_each(reqs, slots)
    n = len(reqs)
    # NOTE: input ids are read on the device from the runner's token_buf, as in a decode batch: placeholders here
    return replace(batch, reqs=batch.reqs + reqs, input_ids=batch.input_ids + [0] * n,
                   out_slots=torch.cat([batch.out_slots, slots]), prefix_lens=batch.prefix_lens + prefix,
                   extend_lens=batch.extend_lens + [1] * n, sampling=batch.sampling + [True] * n, num_decode=n)
