"""The scheduler: a loop over a waiting queue and a running batch (continuous batching, chunked prefill,
retraction), split into plan (CPU) -> run (model) -> process (CPU) so the two CPU parts overlap the GPU step
(the overlap scheduler). `scheduler/process.py` runs it in a process per rank.
"""
from __future__ import annotations

import logging
import time

from mlaserve.config import ServerConfig
from mlaserve.core import (Batch, FinishReason, ForwardMode, Req, RequestError, RequestLimits, SamplingParams,
                           check_request, fit_request)
from mlaserve.distributed import RankGroup
from mlaserve.engine.engine import ModelRunner, PendingStep, StepOutput, resolve_for_device
from mlaserve.engine.spec import SpecOutput, slot_counts
from mlaserve.engine.spec_tree import slots_per_step
from mlaserve.ipc import messages as m
from mlaserve.scheduler.batch_log import BatchLog
from mlaserve.scheduler.cache import KVCacheManager
from mlaserve.scheduler.decode import plan_decode
from mlaserve.scheduler.dp_sync import DPStepSync
from mlaserve.scheduler.grammar import create_grammar_manager
from mlaserve.scheduler.prefill import plan_prefill

logger = logging.getLogger(__name__)

WARMUP_PROMPT, WARMUP_NEW, WARMUP_FIRST_ID = 24, 4, 11    # `Scheduler.warm_up`: prompt tokens, new tokens, ids
# On a GPU the warm-up also prefills one prompt of each of these lengths (those above the chunk, the context or half
# the pool left out): the tuned kernel tables pick tiles by token count, and each tile set is one more compile on
# first use. Without them the first batch of 16 x 256-token prompts after start-up waited ~2.5 s in serving
# (mean TTFT 0.75 s against a median of 0.11 s; V3 10 layers at tp 2, benchmarks/results/dp-ep-h200x2.md).
WARMUP_PREFILL_LENS = (200, 500, 1000, 2000, 4000, 8000)


class Scheduler:
    """One rank's scheduler. Under tensor parallelism every rank runs one over the same messages, applied at the
    same step (SPMD), so all make the same decisions; `group` joins their model runners."""

    def __init__(self, server: ServerConfig, model_path: str, runner: ModelRunner | None = None,
                 group: RankGroup | None = None):
        server = resolve_for_device(server, model_path)        # NOTE: idempotent for a resolved config
        self.server, self.cfg = server, server.sched
        self.runner = runner or ModelRunner(server, model_path, group)
        self.context_len = self.runner.context_len
        self.max_running = self.cfg.max_running_requests
        # speculative decoding: each decode step takes spec_tokens slots per request (the last token, the drafts)
        self.spec_tokens = slots_per_step(self.cfg.speculative_num_steps, self.cfg.speculative_eagle_topk,
                                          self.cfg.speculative_num_draft_tokens) if self.cfg.speculative_algorithm else 1
        self.spec_advance = self.cfg.speculative_num_steps + 1 if self.cfg.speculative_algorithm else 1
        self.overlap = not self.cfg.disable_overlap_schedule
        # table columns a request may hold past its newest token: a step's slots, and under overlap the most a
        # queued step may still advance it by (`scheduler/decode.spec_columns`)
        reach = self.spec_tokens - 1 + (self.spec_advance if self.overlap and self.spec_tokens > 1 else 0)
        self.kv = KVCacheManager(self.runner.num_slots, self.max_running + 8,
                                 min(self.context_len, self.runner.num_slots) + 1 + reach,
                                 disable_radix=server.cache.disable_radix_cache, device=self.runner.device)
        self.runner.attach(self.kv.req_to_token)
        self.runner.init_cuda_graphs(self.kv.req_to_token, self.kv.req_pool.alloc())   # a row for padding
        self.eos_ids = set(self.runner.eos_ids())
        # NOTE: a lone request must always find room for its drafts too, or it would be cut short
        self.limits = RequestLimits(self.context_len, self.kv.num_slots - reach, self.runner.cfg.vocab_size)
        # NOTE: ranks must admit a request at the same step (SPMD): under TP, compiles finish before the next step
        self.grammar = create_grammar_manager(self.cfg.grammar_backend, server.load.tokenizer_path or model_path,
                                              self.runner.cfg.vocab_size, sorted(self.eos_ids),
                                              synchronous=self.runner.group.size > 1)
        self.live: dict[str, Req] = {}          # every unfinished request by rid, wherever it is
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.chunked: Req | None = None
        self.new_token_ratio = self.cfg.init_new_token_ratio
        self.num_retracted = 0
        self.outbox: list[m.ReqOutput] = []
        self.pending: PendingStep | None = None   # the step queued on the device, not yet processed
        self.stats = {"prompt_tokens": 0, "generation_tokens": 0, "cached_tokens": 0, "steps": 0,
                      "spec_verify_steps": 0, "spec_tokens": 0, "mixed_steps": 0}
        self.arrivals = 0                         # arrival order (the same on every rank, unlike a clock)
        self.batch_log = BatchLog(self.cfg.decode_log_interval, on=self.runner.group.info.is_leader)
        # DP attention: every plan is agreed with all ranks (an IDLE batch when only other groups have work)
        slots, extend_slot = None, 0
        if self.spec_tokens > 1:                  # every group runs the drafts, the target and the draft layer
            c = self.cfg
            slots = lambda batch: slot_counts(batch, c.speculative_num_steps, c.speculative_eagle_topk,  # noqa: E731
                                              c.speculative_num_draft_tokens)
            extend_slot = c.speculative_num_steps
        graphs = self.runner.spec.graphs if self.runner.spec is not None else self.runner.graphs
        pieces = self.runner.pieces
        self.dp_sync = DPStepSync(self.runner.group, slots, graphs.batch_sizes if graphs is not None else None,
                                  pieces.sizes if pieces is not None else None, extend_slot) \
            if self.runner.group.dp is not None else None

    # --- start-up -------------------------------------------------------------------------------
    def warm_up(self, prefill_lens: tuple[int, ...] | None = None) -> float:
        """Run the warm-up requests before reporting ready: a prompt, then the same prompt again (a prefix-cache
        hit unless the cache is off: the extend-over-a-prefix kernels), a few decode steps each (speculative ones
        too), then one prompt of each of `prefill_lens` tokens, one at a time (default: WARMUP_PREFILL_LENS on a
        GPU, none on the CPU, where nothing compiles). On a GPU this compiles the kernels those paths launch on
        first use, which otherwise stall the first user requests for seconds. Their outputs are dropped; the cache
        is flushed and the counters zeroed afterwards. Every rank runs it (collectives line up: the same requests
        everywhere). Returns seconds."""
        t0 = time.monotonic()
        vocab = self.runner.cfg.vocab_size
        prompt = [(WARMUP_FIRST_ID + 37 * i) % vocab for i in range(min(WARMUP_PROMPT, self.context_len // 2))]
        params = SamplingParams(max_new_tokens=WARMUP_NEW, temperature=0.0, ignore_eos=True)
        runs = [(prompt, params), (prompt, params)]
        if prefill_lens is None:
            prefill_lens = WARMUP_PREFILL_LENS if self.runner.device.type == "cuda" else ()
        chunk = self.cfg.chunked_prefill_size
        cap = min(self.context_len - 2, self.kv.num_slots // 2, chunk if chunk > 0 else self.context_len)
        once = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
        for k, n in enumerate(sorted(n for n in set(prefill_lens) if n <= cap)):
            # NOTE: a first token of its own: a prefix-cache hit on an earlier prompt would shorten the prefill
            runs.append(([(WARMUP_FIRST_ID + 7919 * (k + 1) + 37 * i) % vocab for i in range(n)], once))
        for i, (ids, sp) in enumerate(runs):
            self.add_request(m.GenerateReqMsg(f"mlaserve-warmup-{i}", ids, sp, seed=i))
            while self.has_work or (self.dp_sync is not None and self.dp_sync.busy):
                self.step()
        self.step_outbox()
        assert self.kv.flush(), "nothing runs after the warm-up"
        self.stats = dict.fromkeys(self.stats, 0)
        self.batch_log.reset()
        self.num_retracted = 0
        self.new_token_ratio = self.cfg.init_new_token_ratio
        return time.monotonic() - t0

    # --- requests in ----------------------------------------------------------------------------
    def add_request(self, msg: m.GenerateReqMsg) -> None:
        self.arrivals += 1
        req = Req(**msg.spec_fields(), arrival=self.arrivals)
        try:   # NOTE: the manager checked it already; this cheap re-check only guards the loop
            if self.cfg.allow_auto_truncate and req.input_ids:   # (the same cut as the manager's, or a smaller pool's)
                req.input_ids, req.params, _ = fit_request(req.input_ids, req.params, self.limits)
            req.params = check_request(req.input_ids, req.params, self.limits)
        except RequestError as e:
            self._finish(req, FinishReason("abort", message=e.message, status_code=e.status_code))
            return
        limit = self.cfg.max_queued_requests
        if limit is not None and self.num_queued >= limit:
            self._finish(req, FinishReason("abort", message=f"The request queue is full (--max-queued-requests "
                                           f"{limit}); try again later.", status_code=503))
            return
        self.live[req.rid] = req
        if req.params.grammar is not None:
            self.grammar.submit(req)          # waits for its compiled grammar (`_admit_grammar_ready`)
        else:
            self.waiting.append(req)

    def _admit_grammar_ready(self) -> None:
        """Queue the requests whose grammar compiled; end those whose grammar failed (400)."""
        ready, failed = self.grammar.take_ready()
        self.waiting.extend(ready)
        for req, reason in failed:
            self.end(req, reason)

    def abort(self, rid: str, reason: FinishReason = FinishReason("abort")) -> None:
        """End request `rid` with `reason`, freeing its KV; a request not (or no longer) here still gets
        `reason` sent when it is an error (its caller must not wait)."""
        req = self.live.get(rid)
        if req is not None:
            self.end(req, reason)
        elif reason.status_code is not None:
            self.outbox.append(m.ReqOutput(rid=rid, new_ids=[], finished=reason))

    def fail_all(self, message: str) -> None:
        """End every request with a 500 (after a step failed: none of their states can be trusted)."""
        self.pending = None
        for req in list(self.live.values()):
            self.end(req, FinishReason("abort", message=message, status_code=500))

    def flush_cache(self) -> bool:
        if self.running or self.waiting or self.chunked:
            return False
        # NOTE: under overlap a step may still be in flight with only finished requests' last (discarded) tokens
        self.drain()
        return not (self.running or self.waiting or self.chunked) and self.kv.flush()

    # --- one iteration: plan -> run -> process ----------------------------------------------------
    @property
    def num_queued(self) -> int:
        """Requests waiting to start: the waiting queue and those waiting for their compiled grammar."""
        return len(self.waiting) + len(self.grammar.waiting)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked or self.pending or self.grammar.waiting)

    def plan(self) -> Batch | None:
        batch = plan_prefill(self) or plan_decode(self)
        if batch is not None:
            for req in batch.reqs:
                req.last_batch = batch
            self.batch_log.batch(batch, self)
        else:
            self.batch_log.idle()
        return batch if self.dp_sync is None else self.dp_sync.agree(batch)

    def run(self, batch: Batch) -> StepOutput | SpecOutput:
        if self._speculates(batch):
            return self.runner.spec_step(batch, self._draft_mask(batch))
        return self.runner.resolve(self.runner.launch(batch, self.grammar.bitmask(batch)))

    def _speculates(self, batch: Batch | None) -> bool:
        """A draft-and-verify step: a decode batch, or under DP attention an IDLE one replaying the agreed graphs."""
        return batch is not None and self.spec_tokens > 1 and (
            batch.mode is ForwardMode.DECODE or (batch.mode is ForwardMode.IDLE and batch.graph_bs is not None))

    def _draft_mask(self, batch: Batch):
        """Structured output under speculation: the callback that walks each verified node's drafts (needs every
        earlier token of its requests processed), or None when no request of `batch` is constrained."""
        grammar = self.grammar
        return (lambda drafts: grammar.draft_bitmask(batch, drafts)) if grammar.constrains(batch) else None

    def _launch_and_drain(self, batch: Batch | None) -> PendingStep | None:
        """Queue `batch` on the device and process the step before it meanwhile. A batch under a grammar is
        queued in two parts: the forward, then (after the previous step's tokens advanced the grammars) the
        sampling with the bitmask filled on the CPU while the forward runs."""
        if self._speculates(batch):           # a grammar's drafts are walked after `step` drained (_needs_history)
            launched = self.runner.launch_spec(batch, self._draft_mask(batch))
            self.drain()
            return launched
        if batch is None or not self.grammar.constrains(batch):
            launched = self.runner.launch(batch) if batch is not None else None
            self.drain()
            return launched
        fwd = self.runner.launch_forward(batch)
        self.drain()
        return self.runner.launch_sample(fwd, self.grammar.bitmask(batch))

    def process(self, batch: Batch, out: StepOutput | SpecOutput) -> None:
        if batch.mode is ForwardMode.IDLE:
            return
        self.stats["steps"] += 1
        self.stats["mixed_steps"] += int(batch.num_decode > 0)
        spec = isinstance(out, SpecOutput)
        tail = batch.size - batch.num_decode if not spec and out.spec is not None else None
        freed: list = []                      # rejected drafts' slots, freed at once after the step
        for i, req in enumerate(batch.reqs):
            if req.finished is not None:      # aborted while its step ran
                continue
            try:
                if spec:
                    self._process_spec(out, batch, i, req, freed)
                elif tail is not None and i >= tail:      # a mixed batch's decodes under speculative decoding
                    self._process_spec(out.spec, batch, i - tail, req, freed)
                else:
                    self._process_one(batch, out, i, req)
            except Exception as e:  # noqa: BLE001 - ends this request only
                logger.exception("processing request %s failed", req.rid)
                self.end(req, FinishReason("abort", message=f"internal error: {type(e).__name__}: {e}",
                                            status_code=500))
        self.kv.free_all(freed)

    def _process_one(self, batch: Batch, out: StepOutput, i: int, req: Req) -> None:
        decoding = batch.is_decode(i)
        if not decoding:
            self.stats["prompt_tokens"] += batch.extend_lens[i]
            req.input_logprobs += out.input_logprobs[i]
            req.input_top_logprobs += out.input_top[i]
        tok = out.next_ids[i]
        if tok is None:
            return
        if req.params.max_new_tokens == 0:    # prompt scoring only: the sampled token is dropped
            self._drop(req)
            self._finish(req, FinishReason("length", length=0))
            return
        self._append(req, tok, out.next_logprobs[i], out.next_top[i])
        if req.finished is None and not decoding and req not in self.running:    # see `_join_running`
            self.running.append(req)

    def _process_spec(self, out: SpecOutput, out_batch: Batch, i: int, req: Req, freed: list) -> None:
        """A verify step's tokens for one request: taken in order up to the first that ends it; the slots past
        the last kept token's KV (rejected drafts, or tokens after the end) are freed first."""
        toks = out.tokens[i]
        n = len(toks)
        for j, tok in enumerate(toks):
            if self._ends(req, tok, len(req.output_ids) + j + 1) is not None:
                n = j + 1
                break
        req.spec_verify_ct += 1
        req.spec_tokens += n
        self.stats["spec_verify_steps"] += 1
        self.stats["spec_tokens"] += n
        # fill_ids gains n tokens; every one of them but the newest has KV. With no later step of it queued, the
        # slots past them go now; else that step writes there (`scheduler/decode.spec_columns`)
        if req.last_batch is out_batch:
            self.kv.truncate(req, len(req.fill_ids) + n - 1, freed)
        for j in range(n):
            lp = out.logprobs[i][j] if out.logprobs[i] is not None else None
            self._append(req, toks[j], lp, out.top[i][j] if out.top[i] is not None else None, emit=j == n - 1)

    def step(self) -> list[m.ReqOutput]:
        """One scheduling iteration; returns what it produced for the tokenizer manager.

        With overlap, step N + 1 is planned and queued on the device before step N's results are
        processed, so the CPU work of both hides behind the GPU. A request that finished at step N has
        one wasted token in step N + 1 (discarded); sampling keys (seed, step index) do not change, so
        outputs are identical with overlap on or off.
        """
        self._admit_grammar_ready()
        if not self.overlap:
            batch = self.plan()
            if batch is not None:
                self.process(batch, self.run(batch))
            self._idle_for_grammar()
            return self.step_outbox()
        if self.pending is not None and self._needs_history():
            self.drain()                      # penalties read the full output history
        self.pending = self._launch_and_drain(self.plan())
        self._join_running(self.pending)
        self._idle_for_grammar()
        return self.step_outbox()

    def _join_running(self, pending: PendingStep | None) -> None:
        """Overlap: the requests whose last prompt token is in the step just queued decode from the next step on
        (their first token is read on the device, like any decode input), not a step after it is processed.
        A request with one token to make (a health check, a score) has nothing to decode: it never joins."""
        if pending is None or pending.batch.mode is not ForwardMode.EXTEND:
            return
        batch = pending.batch
        for i, req in enumerate(batch.reqs):
            if (batch.sampling[i] and not batch.is_decode(i) and req.finished is None
                    and req.params.max_new_tokens > 1 and req not in self.running):
                self.running.append(req)

    def _idle_for_grammar(self) -> None:
        if not (self.waiting or self.running or self.chunked or self.pending):
            self.grammar.wait(0.05)           # only compiles are left: wait for one instead of spinning

    def drain(self) -> None:
        """Process the step in flight (waits for it)."""
        if self.pending is not None:
            p, self.pending = self.pending, None
            self.process(p.batch, self.runner.resolve(p))

    def _needs_history(self) -> bool:
        """A request of the next step reads its whole output so far: penalties; under speculation also a grammar
        (its drafts are walked from the matcher's state after the last token)."""
        return any(r.params.repetition_penalty != 1 or r.params.frequency_penalty or r.params.presence_penalty
                   or (self.spec_tokens > 1 and r.rid in self.grammar.states) for r in self.running)

    def step_outbox(self) -> list[m.ReqOutput]:
        out, self.outbox = self.outbox, []
        return out

    # --- results ----------------------------------------------------------------------------------
    def _append(self, req: Req, tok: int, logprob: float | None, top: list | None, emit: bool = True) -> None:
        first = not req.output_ids
        req.output_ids.append(tok)
        self.stats["generation_tokens"] += 1
        if req.return_logprob:
            req.output_logprobs.append((logprob, tok))
            req.output_top_logprobs.append(top or [])
        finished = self.grammar.accept(req, tok)
        if finished is None:
            finished = self._ends(req, tok, len(req.output_ids))
        if first:
            self.stats["cached_tokens"] += req.cached_tokens
        if finished is not None:
            self._drop(req)
            self._finish(req, finished)
        elif emit and (req.sent_len == 0 or len(req.output_ids) - req.sent_len >= self.cfg.stream_interval):
            self._emit(req)                   # (--stream-interval: the first token at once, then every n)

    def _ends(self, req: Req, tok: int, n: int) -> FinishReason | None:
        """Why `tok`, output token number n (from 1), ends `req` (stop id, eos or length), or None."""
        p = req.params
        if n >= p.min_new_tokens and ((tok in self.eos_ids and not p.ignore_eos)
                                      or (p.stop_token_ids and tok in p.stop_token_ids)):
            return FinishReason("stop", matched=tok)
        if n >= p.max_new_tokens:
            return FinishReason("length", length=p.max_new_tokens)
        return None

    def end(self, req: Req, reason: FinishReason) -> None:
        """Finish `req` with `reason` wherever it is (queue, batch, prompt chunk), freeing its KV."""
        if req in self.waiting:
            self.waiting.remove(req)
        self._drop(req)
        self._finish(req, reason)

    def _drop(self, req: Req) -> None:
        if req in self.running:
            self.running.remove(req)
        if self.chunked is req:
            self.chunked = None
        self.kv.release(req)
        self.grammar.release(req)

    def _finish(self, req: Req, reason: FinishReason) -> None:
        req.finished = reason
        self.live.pop(req.rid, None)
        self._emit(req)

    def _emit(self, req: Req) -> None:
        new = req.output_ids[req.sent_len:]
        k = req.sent_len
        prompt_done = k == 0 and (new or req.finished)
        self.outbox.append(m.ReqOutput(
            rid=req.rid, new_ids=new, finished=req.finished, prompt_tokens=len(req.input_ids),
            cached_tokens=req.cached_tokens,
            new_logprobs=req.output_logprobs[k:] if req.return_logprob else [],
            new_top_logprobs=req.output_top_logprobs[k:] if req.return_logprob else [],
            input_logprobs=self._input_logprobs(req) if prompt_done and req.return_logprob else None,
            input_top_logprobs=req.input_top_logprobs if prompt_done and req.return_logprob else None,
            spec_verify_ct=req.spec_verify_ct, spec_tokens=req.spec_tokens))
        req.sent_len = len(req.output_ids)

    @staticmethod
    def _input_logprobs(req: Req) -> list:
        start = req.logprob_start
        head = [(None, req.input_ids[0])] if start == 0 else []
        return head + req.input_logprobs

    def get_stats(self) -> dict:
        return {"num_running_reqs": len(self.running) + (1 if self.chunked else 0),
                "num_waiting_reqs": len(self.waiting), "token_usage": self.kv.used() / self.kv.num_slots,
                "used_tokens": self.kv.used(), "max_total_tokens": self.kv.num_slots,
                "free_tokens": self.kv.allocator.available, "cached_tokens_in_tree": self.kv.tree.total_size(),
                "num_retracted": self.num_retracted, "grammar_states": len(self.grammar.states),
                "grammar_waiting": len(self.grammar.waiting), **self.stats,
                "avg_spec_accept_length": self.stats["spec_tokens"] / max(self.stats["spec_verify_steps"], 1),
                "piecewise_graph_steps": self.runner.pieces.runs if self.runner.pieces is not None else 0,
                "extends_as_decode": self.runner.extends_as_decode,
                **({"dp_rank": self.runner.group.info.dp_rank} if self.dp_sync is not None else {})}
