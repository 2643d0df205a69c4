"""The tokenizer manager (main process): tokenize and check requests, send them to the scheduler over ZeroMQ,
receive token ids, detokenize incrementally, apply stop strings, and stream results to callers (Engine API and
HTTP). An error in one request's output ends that request only; a dead scheduler fails every request at once.
"""
from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import Any

import zmq
import zmq.asyncio

from mlaserve.core import (FinishReason, RequestError, RequestLimits, SamplingParams, check_request,
                           check_text_length, fit_request)
from mlaserve.ipc import messages as m
from mlaserve.server.dp_controller import DataParallelController
from mlaserve.tokenizer import Tokenizer
from mlaserve.tokenizer.detokenize import IncrementalDetokenizer, StopStream

logger = logging.getLogger(__name__)

WATCH_INTERVAL_S = 0.2        # how often the scheduler process is checked for life
CONTROL_TIMEOUT_S = 60.0      # the longest a flush / stats request waits for the scheduler's answer
GRAMMAR_CHECKS_KEPT = 1024    # grammar check answers remembered (most recent)

__all__ = ["EngineDeadError", "GenerateInput", "RequestError", "TokenizerManager"]


class EngineDeadError(RuntimeError):
    """The scheduler (or the manager's receive loop) is gone: no request can be served (HTTP 503)."""

    status_code, param = 503, None

    @property
    def message(self) -> str:
        return str(self)


@dataclass
class GenerateInput:
    """One request in the Engine's / native /generate shape (sampling parameters already validated)."""

    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    stream: bool = False
    rid: str | None = None
    grammar_start_id: int | None = None     # the grammar applies after this output token (reasoning models)


@dataclass
class _State:
    req: m.GenerateReqMsg
    detok: IncrementalDetokenizer
    stops: StopStream
    queue: asyncio.Queue
    created: float
    wire_rid: str                 # the scheduler's id of this run (req.rid is the caller's)
    text: str = ""                # final text so far (stop strings already applied)
    ids: list[int] = field(default_factory=list)
    finished: FinishReason | None = None
    meta: dict = field(default_factory=dict)
    out_logprobs: list = field(default_factory=list)
    out_top: list = field(default_factory=list)
    first_token_time: float | None = None
    last_token_time: float | None = None


def encode_within(tokenizer: Tokenizer, text: str, limits: RequestLimits, param: str, *, truncate: bool,
                  add_bos: bool = True) -> list[int]:
    """`text` tokenized; a text surely longer than the limits is refused first, without tokenizing it (a prompt of
    megabytes would hold up the event loop), as a RequestError naming `param`. truncate (--allow-auto-truncate): no
    refusal, `fit_request` cuts the tokens later."""
    if not truncate:
        try:
            check_text_length(tokenizer.min_tokens(text), limits)
        except RequestError as e:
            raise e.renamed({"input_ids": param}) from None
    return tokenizer.encode(text, add_bos=add_bos)


class TokenizerManager:
    """Args:
        send_addr: the scheduler's request socket, or one per DP-attention group (then a DataParallelController
            routes the requests by info["load_balance_method"]).
        info: what the scheduler reported when ready (context_length, max_total_tokens, vocab_size, ...).
        seed: seeds the RNG that draws the sampling seed of every request without one (--seed).
        alive: tells whether the scheduler process still runs (None: not watched).
    """

    def __init__(self, tokenizer: Tokenizer, send_addr: str | list[str], recv_addr: str, info: dict,
                 metrics: Any | None = None, *, seed: int = 0, alive: Callable[[], bool] | None = None):
        self.tokenizer, self.info, self.metrics = tokenizer, info, metrics
        self.limits = RequestLimits(info["context_length"], info["max_total_tokens"], info["vocab_size"])
        self.ctx = zmq.asyncio.Context()
        self.send = self.dp = None
        if isinstance(send_addr, str):
            self.send = self.ctx.socket(zmq.PUSH)
            self.send.bind(send_addr)
        else:
            self.dp = DataParallelController(self.ctx, send_addr, info.get("load_balance_method", "shortest_queue"))
        self.recv = self.ctx.socket(zmq.PULL)
        self.recv.bind(recv_addr)
        self.states: dict[str, _State] = {}     # by the scheduler's id of the run (`_State.wire_rid`)
        self.running: set[str] = set()          # the callers' rids of the requests in flight
        self.dead: str | None = None          # why no request can be served any more
        self._seeds = random.Random(seed)
        self._alive = alive
        self._replies: asyncio.Queue | None = None
        self._control: asyncio.Lock | None = None      # one control request (flush / stats) in flight at a time
        self._dead_fut: asyncio.Future | None = None
        self._tasks: set[asyncio.Task] = set()
        self._grammar_checks: OrderedDict[str, asyncio.Future] = OrderedDict()   # (kind, text) key -> error | None

    @property
    def context_len(self) -> int:
        return self.limits.context_len

    @property
    def max_total_tokens(self) -> int:
        return self.limits.max_total_tokens

    def start(self) -> None:
        """Start the receive loop (and the scheduler watch) on the running event loop."""
        loop = asyncio.get_running_loop()
        self._replies, self._control, self._dead_fut = asyncio.Queue(), asyncio.Lock(), loop.create_future()
        self._spawn(self._recv_loop())
        if self._alive is not None:
            self._spawn(self._watch())

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # --- requests ---------------------------------------------------------------------------------
    def prepare(self, obj: GenerateInput) -> m.GenerateReqMsg:
        """Tokenize and check one request (the only check on its path) and choose its seed.

        Raises RequestError naming the field (`text` / `input_ids`, `max_new_tokens`, `logit_bias`, a grammar
        with --grammar-backend none, a rid already running), or EngineDeadError. Grammars are checked by
        `check_grammars` (async)."""
        self._check_alive()
        if obj.rid is not None and obj.rid in self.running:     # (before a stream starts; `generate` checks again)
            raise RequestError(f"request id {obj.rid!r} is already running", "rid")
        if obj.input_ids is not None:
            ids = list(obj.input_ids)
        elif obj.text is not None:
            ids = encode_within(self.tokenizer, obj.text, self.limits, "text",
                                truncate=bool(self.info.get("allow_auto_truncate")))
        else:
            raise RequestError("either text (prompt) or input_ids is required", "text")
        params = obj.sampling_params
        if self.info.get("allow_auto_truncate") and ids:
            ids, params, cut = fit_request(ids, params, self.limits)
            if cut:
                logger.warning("request %s: %s (--allow-auto-truncate)", obj.rid or "(no rid)", cut)
        try:
            params = check_request(ids, params, self.limits)
        except RequestError as e:
            raise (e if obj.input_ids is not None else e.renamed({"input_ids": "text"})) from None
        if params.grammar is not None and self.info.get("grammar_backend") == "none":
            raise RequestError("structured output is off: the server runs with --grammar-backend none",
                               f"sampling_params.{params.grammar[0]}")
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
        return m.GenerateReqMsg(obj.rid or uuid.uuid4().hex, ids, params, seed, obj.return_logprob,
                                obj.logprob_start_len, obj.top_logprobs_num, obj.stream,
                                obj.grammar_start_id if params.grammar is not None else None)

    async def check_grammars(self, reqs: list[m.GenerateReqMsg]) -> None:
        """Have the scheduler check every grammar of `reqs` (once per distinct grammar; answers are cached):
        raises RequestError naming `sampling_params.<kind>` and the reason for an invalid one."""
        for req in reqs:
            if req.params.grammar is None:
                continue
            kind, text = req.params.grammar
            error = await self._check_grammar(kind, text)
            if error is not None:
                raise RequestError(f"invalid {kind}: {error}", f"sampling_params.{kind}")

    async def _check_grammar(self, kind: str, text: str) -> str | None:
        key = f"{kind}:{text}"
        fut = self._grammar_checks.get(key)
        if fut is None or (fut.done() and fut.exception() is not None):
            fut = asyncio.get_running_loop().create_future()
            self._grammar_checks[key] = fut
            while len(self._grammar_checks) > GRAMMAR_CHECKS_KEPT:
                self._grammar_checks.popitem(last=False)
            try:
                await self._send(m.GrammarCheckReqMsg(key, kind, text))
            except BaseException as e:
                fut.set_exception(e)
                raise
        self._grammar_checks.move_to_end(key)
        await asyncio.wait({fut, self._dead_fut}, return_when=asyncio.FIRST_COMPLETED)
        self._check_alive()
        return fut.result()

    async def generate(self, req: m.GenerateReqMsg) -> AsyncIterator[dict]:
        """Run a prepared request; yield cumulative snapshots when streaming, else only the final one."""
        self._check_alive()
        await self.check_grammars([req])      # NOTE: before the rid check: no await between it and registering
        if req.rid in self.running:
            raise RequestError(f"request id {req.rid!r} is already running", "rid")
        # NOTE: the scheduler knows each run by a fresh id: outputs of an earlier run of the same rid (its abort
        # answer after a disconnect or a stop string) can still be in flight and must not reach this one
        wire = replace(req, rid=uuid.uuid4().hex)
        p = req.params
        state = _State(req, IncrementalDetokenizer(self.tokenizer, req.input_ids, p.skip_special_tokens),
                       StopStream(p.stop, keep_stop=p.no_stop_trim), asyncio.Queue(), time.monotonic(), wire.rid)
        self.states[wire.rid] = state
        self.running.add(req.rid)
        try:
            await self._send(wire)
            while True:
                await state.queue.get()
                while not state.queue.empty():
                    state.queue.get_nowait()
                done = state.finished is not None   # NOTE: read before yielding; it may change meanwhile
                if not done and self.dead is not None:
                    raise EngineDeadError(self.dead)
                if req.stream or done:
                    yield self._snapshot(state)
                if done:
                    return
        finally:
            self.running.discard(req.rid)
            if state.finished is None and self.dead is None:   # the caller went away: abort and free its KV
                state.finished = FinishReason("abort")
                await self.abort(wire.rid)
            self.states.pop(wire.rid, None)
            if self.dp is not None:
                self.dp.forget(wire.rid)

    async def abort(self, rid: str) -> None:
        if self.dead is None:
            try:
                await self._send(m.AbortReqMsg(rid))
            except EngineDeadError:
                pass

    async def abort_request(self, rid: str | None, abort_all: bool = False) -> int:
        """End the caller's running request `rid` (or every one) now: its caller gets the output so far with an
        abort finish, and the scheduler frees its KV. How many were running."""
        hit = [s for s in self.states.values() if s.finished is None and (abort_all or s.req.rid == rid)]
        for state in hit:
            self._finish(state, FinishReason("abort", message="aborted by an /abort_request call"))
            state.queue.put_nowait(None)
            await self.abort(state.wire_rid)
        return len(hit)

    async def flush_cache(self) -> bool:
        return (await self._request(m.FlushCacheReqMsg())).ok

    async def get_stats(self) -> dict:
        return (await self._request(m.GetStatsReqMsg())).stats

    async def _request(self, msg: object) -> Any:
        async with self._control:         # NOTE: replies carry no id: never two control requests at once
            await self._send(msg)
            replies = []
            for _ in range(1 if self.dp is None else self.dp.replies_expected(msg)):   # one per DP group
                reply = asyncio.ensure_future(self._replies.get())
                await asyncio.wait({reply, self._dead_fut}, timeout=CONTROL_TIMEOUT_S,
                                   return_when=asyncio.FIRST_COMPLETED)
                if not reply.done():
                    reply.cancel()
                    self._check_alive()
                    raise TimeoutError(f"the scheduler did not answer in {CONTROL_TIMEOUT_S:.0f} s")
                replies.append(reply.result())
            return replies[0] if self.dp is None else self.dp.merge(replies)

    async def _send(self, msg: object) -> None:
        """Send to the scheduler; never waits forever (a PUSH with no live peer blocks until one connects)."""
        self._check_alive()
        data = m.encode(msg)
        for sock in [self.send] if self.dp is None else self.dp.targets(msg):
            sent = sock.send(data)
            if not sent.done():
                await asyncio.wait({sent, self._dead_fut}, return_when=asyncio.FIRST_COMPLETED)
                if not sent.done():
                    sent.cancel()
                    self._check_alive()
            sent.result()

    def _check_alive(self) -> None:
        if self.dead is not None:
            raise EngineDeadError(self.dead)

    # --- death -----------------------------------------------------------------------------------------
    async def _watch(self) -> None:
        while self._alive():
            await asyncio.sleep(WATCH_INTERVAL_S)
        self._die("the scheduler process is not running")

    def _die(self, reason: str) -> None:
        """Fail every request in flight and every later one with EngineDeadError(reason)."""
        if self.dead is not None:
            return
        self.dead = reason
        self._dead_fut.set_result(None)
        for state in self.states.values():
            state.queue.put_nowait(None)

    # --- results ------------------------------------------------------------------------------------
    async def _recv_loop(self) -> None:
        try:
            while True:
                msg = m.decode(await self.recv.recv())
                if isinstance(msg, m.BatchOutMsg):
                    for out in msg.outputs:
                        self._deliver(out)
                elif isinstance(msg, m.GrammarCheckRespMsg):
                    self._grammar_checked(msg)
                else:
                    self._replies.put_nowait(msg)
        except Exception as e:  # noqa: BLE001 - a dead loop fails every request; the server then exits
            logger.debug("the receive loop failed", exc_info=True)
            self._die(f"the tokenizer manager's receive loop failed: {type(e).__name__}: {e}")

    def _grammar_checked(self, msg: m.GrammarCheckRespMsg) -> None:
        fut = self._grammar_checks.get(msg.key)
        if fut is not None and not fut.done():
            fut.set_result(msg.error)

    def _deliver(self, out: m.ReqOutput) -> None:
        """Apply one request's output; an error here ends that request only (500)."""
        if self.dp is not None:
            self.dp.on_output(out)
        state = self.states.get(out.rid)
        if state is None or state.finished is not None:
            return
        try:
            self._update(state, out)
        except Exception as e:  # noqa: BLE001 - isolated to this request
            logger.exception("request %s: handling its output failed", out.rid)
            state.finished = FinishReason("abort", message=f"internal error: {type(e).__name__}: {e}",
                                          status_code=500)
            self._spawn(self.abort(out.rid))
        state.queue.put_nowait(None)

    def _update(self, state: _State, out: m.ReqOutput) -> None:
        self._timing(state, out)
        state.meta.update(prompt_tokens=out.prompt_tokens, cached_tokens=out.cached_tokens)
        if out.spec_verify_ct:
            state.meta.update(spec_verify_ct=out.spec_verify_ct, spec_tokens=out.spec_tokens)
        if out.input_logprobs is not None:
            state.meta["input_token_logprobs"] = out.input_logprobs
            state.meta["input_top_logprobs"] = out.input_top_logprobs
        # SGLang: the matched stop token (stop_token_ids, EOS) is in output_ids, not in the text (no_stop_trim keeps it)
        fin = out.finished
        trim = fin is not None and fin.kind == "stop" and isinstance(fin.matched, int) \
            and not state.req.params.no_stop_trim and bool(out.new_ids) and out.new_ids[-1] == fin.matched
        for i, tok in enumerate(out.new_ids):
            state.ids.append(tok)
            if out.new_logprobs:
                state.out_logprobs.append(out.new_logprobs[i])
                state.out_top.append(out.new_top_logprobs[i])
            if trim and i == len(out.new_ids) - 1:
                break
            state.text += state.stops.add(state.detok.add([tok]))
            if state.stops.stopped:
                self._finish(state, FinishReason("stop", matched=state.stops.matched))
                if out.finished is None:
                    self._spawn(self.abort(state.wire_rid))
                return
        if out.finished is not None:
            state.text += state.stops.add(state.detok.flush())
            if state.stops.stopped:
                self._finish(state, FinishReason("stop", matched=state.stops.matched))
            else:
                state.text += state.stops.flush()
                self._finish(state, out.finished)

    def _finish(self, state: _State, reason: FinishReason) -> None:
        state.finished = reason
        self._observe("e2e", time.monotonic() - state.created)

    def _timing(self, state: _State, out: m.ReqOutput) -> None:
        if not out.new_ids:
            return
        now = time.monotonic()
        if state.first_token_time is None:
            state.first_token_time = now
            self._observe("ttft", now - state.created)
        elif state.last_token_time is not None:
            self._observe("itl", (now - state.last_token_time) / len(out.new_ids))
        state.last_token_time = now

    def _snapshot(self, state: _State) -> dict:
        req = state.req
        meta = {"id": req.rid, "finish_reason": state.finished.to_json() if state.finished else None,
                "prompt_tokens": len(req.input_ids), "completion_tokens": len(state.ids),
                "cached_tokens": state.meta.get("cached_tokens", 0), "e2e_latency": time.monotonic() - state.created}
        if "spec_verify_ct" in state.meta:    # speculative decoding: verify steps, tokens per verify step
            ct = state.meta["spec_verify_ct"]
            meta.update(spec_verify_ct=ct, spec_accept_length=state.meta["spec_tokens"] / ct)
        if req.return_logprob:
            meta["input_token_logprobs"] = state.meta.get("input_token_logprobs", [])
            meta["output_token_logprobs"] = list(state.out_logprobs)
            if req.top_logprobs_num:
                meta["input_top_logprobs"] = state.meta.get("input_top_logprobs", [])
                meta["output_top_logprobs"] = list(state.out_top)
        return {"text": state.text, "output_ids": list(state.ids), "meta_info": meta}

    def _observe(self, name: str, value: float) -> None:
        if self.metrics is not None:
            self.metrics.observe(name, value)

    async def aclose(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.ctx.destroy(linger=0)
