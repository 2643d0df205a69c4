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


def spec_columns(sched: "Scheduler", req: Req) -> tuple[int, int]:
    """Speculative decoding: (a lower bound of the request's base L for its next step, the req_to_token columns it
    needs by then: L's highest possible value + `spec_tokens`). While the batch last planned with it is queued and
    unprocessed, L is known on the device only (`SpecDecoder.base_buf`): after a queued decode step it is
    1 .. `spec_advance` tokens past the host's, after a queued prompt exactly one past. The columns past the real
    L + spec_tokens stay the request's: the next steps write there (rejected drafts' slots are reused, not lost),
    and a step processed with nothing queued after it frees them (`Scheduler._process_spec`)."""
    n = len(req.input_ids) + len(req.output_ids)     # len(fill_ids), without building the list
    pending = sched.pending.batch if sched.pending is not None else None
    if pending is None or req.last_batch is not pending:
        low = high = n - 1                    # every token it has but the newest has KV
    elif id(req) in pending.decode_ids:       # a decode step queued (or the decodes of a mixed batch)
        low, high = n, n - 1 + sched.spec_advance
    else:                                     # its last prompt token is queued: the sampled token comes next
        low = high = n
    return low, high + sched.spec_tokens


def _missing(sched: "Scheduler") -> int:
    """Slots the next decode step needs beyond those the running requests hold."""
    if sched.spec_tokens == 1:
        return len(sched.running)
    return sum(max(0, spec_columns(sched, r)[1] - r.kv_len) for r in sched.running)


def plan_decode(sched: "Scheduler") -> Batch | None:
    """One new token per running request, or under speculative decoding the slots of a step (`spec_columns`: the
    last token and the drafts, those past the accepted ones reused or freed after the step)."""
    if sched.running and sched.kv.available() < _missing(sched):
        sched.drain()                         # retraction needs every request's tokens on the CPU
    while sched.running and sched.kv.available() < _missing(sched):
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
    k = sched.spec_tokens
    sched.new_token_ratio = max(sched.cfg.min_new_token_ratio, sched.new_token_ratio - 0.001)
    if k > 1:
        cols = [spec_columns(sched, r) for r in reqs]
        counts = [max(0, hi - r.kv_len) for r, (_, hi) in zip(reqs, cols)]
        slots = sched.kv.alloc(sum(counts))
        assert slots is not None, "decode slots must be available after retraction"
        sched.kv.extend_varied(reqs, counts, slots)
        # NOTE: prefix_lens are lower bounds of each base while a step is queued (the device holds the real ones)
        return Batch(ForwardMode.DECODE, reqs, [], slots, [lo for lo, _ in cols], [k] * len(reqs),
                     [True] * len(reqs))
    slots = sched.kv.alloc(len(reqs))
    assert slots is not None, "decode slots must be available after retraction"
    prefix = [r.kv_len for r in reqs]
    sched.kv.extend_one_each(reqs, slots)
    # NOTE: input ids are read on the device from the runner's token_buf (the last step may be in flight)
    return Batch(ForwardMode.DECODE, reqs, [], slots, prefix, [k] * len(reqs), [True] * len(reqs))


def mix_tokens(sched: "Scheduler") -> int:
    """--enable-mixed-chunk: the tokens the running requests take of a prefill batch (one each, or under speculative
    decoding the step's verified tokens each)."""
    return len(sched.running) * sched.spec_tokens


def mix_decodes(sched: "Scheduler", batch: Batch) -> Batch:
    """--enable-mixed-chunk: `batch` (a prefill or prompt chunk) with every running request appended as an extend
    over its cached tokens, so decoding does not pause for the prefill: one token each, or under speculative decoding
    its step's last token and drafts (`spec_tokens`; the drafts are made and the accept runs around the batch's
    target forward, `SpecDecoder.mixed_drafts` / `mixed_accept`). `batch` alone when their slots cannot be had
    (`plan_prefill` kept them back, so only when the pool is nearly full; they then wait a step), or under
    speculative decoding when a running request is grammar-constrained (its drafts are walked on the host in a
    decode step of its own)."""
    reqs = list(sched.running)
    k = sched.spec_tokens
    if not reqs or (k > 1 and any(r.rid in sched.grammar.states for r in reqs)):
        return batch
    # NOTE: plan_prefill drained the step in flight, so every base L is exact on the host (kv_len = L), and a step's
    # k slots are columns L .. L + k - 1 (`spec_columns` with nothing queued)
    assert k == 1 or sched.pending is None, "a mixed batch under speculative decoding plans with no step in flight"
    slots = sched.kv.alloc(len(reqs) * k)
    if slots is None:
        return batch
    prefix = [r.kv_len for r in reqs]
    sched.kv.extend_varied(reqs, [k] * len(reqs), slots)
    n = len(reqs)
    # NOTE: input ids are read on the device from the runner's token_buf (and the drafts), as in a decode batch:
    # placeholders here. Under speculative decoding the decodes' tokens come from the accept, not from sampling
    return replace(batch, reqs=batch.reqs + reqs, input_ids=batch.input_ids + [0] * (n * k),
                   out_slots=torch.cat([batch.out_slots, slots]), prefix_lens=batch.prefix_lens + prefix,
                   extend_lens=batch.extend_lens + [k] * n, sampling=batch.sampling + [k == 1] * n, num_decode=n)
