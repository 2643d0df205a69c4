"""The tokenizer manager (main process): tokenize, send requests to the scheduler over ZeroMQ, receive token
ids, detokenize incrementally, apply stop strings, and stream results to callers (Engine API and HTTP).
"""
from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from mlaserve.core import SamplingParams
from mlaserve.ipc import messages as m
from mlaserve.tokenizer import Tokenizer
from mlaserve.tokenizer.detokenize import IncrementalDetokenizer, find_stop, stop_holdback

logger = logging.getLogger(__name__)


class RequestError(ValueError):
    """A request the engine refuses (the message is for the user; `param` names the field)."""

    def __init__(self, message: str, param: str | None = None, status_code: int = 400):
        super().__init__(message)
        self.param, self.status_code = param, status_code


@dataclass
class GenerateInput:
    """One request in the Engine's / native /generate shape."""

    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: dict[str, Any] = field(default_factory=dict)
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    stream: bool = False
    rid: str | None = None


@dataclass
class _State:
    rid: str
    params: SamplingParams
    prompt_ids: list[int]
    detok: IncrementalDetokenizer
    queue: asyncio.Queue
    created: float
    text: str = ""                # final text so far (stop strings already applied)
    pending: str = ""             # decoded text held back (may still become a stop string)
    ids: list[int] = field(default_factory=list)
    finished: dict | None = None
    meta: dict = field(default_factory=dict)
    out_logprobs: list = field(default_factory=list)
    out_top: list = field(default_factory=list)
    first_token_time: float | None = None
    last_token_time: float | None = None


class TokenizerManager:
    def __init__(self, tokenizer: Tokenizer, send_addr: str, recv_addr: str, info: dict,
                 metrics: Any | None = None):
        self.tokenizer, self.info, self.metrics = tokenizer, info, metrics
        self.context_len: int = info["context_length"]
        self.max_total_tokens: int = info["max_total_tokens"]
        self.ctx = zmq.asyncio.Context()
        self.send = self.ctx.socket(zmq.PUSH)
        self.send.bind(send_addr)
        self.recv = self.ctx.socket(zmq.PULL)
        self.recv.bind(recv_addr)
        self.states: dict[str, _State] = {}
        self._replies: asyncio.Queue | None = None
        self._control: asyncio.Lock | None = None      # one control request (flush / stats) in flight at a time
        self._loop_task: asyncio.Task | None = None

    def start(self) -> None:
        """Start the receive loop on the running event loop."""
        self._replies = asyncio.Queue()
        self._control = asyncio.Lock()
        self._loop_task = asyncio.get_running_loop().create_task(self._recv_loop())

    # --- requests ---------------------------------------------------------------------------------
    def _prepare(self, obj: GenerateInput) -> tuple[list[int], SamplingParams]:
        if obj.input_ids is not None:
            ids = list(obj.input_ids)
        elif obj.text is not None:
            ids = self.tokenizer.encode(obj.text)
        else:
            raise RequestError("either text (prompt) or input_ids is required", "prompt")
        try:
            params = SamplingParams(**obj.sampling_params)
        except TypeError as e:
            raise RequestError(f"unknown sampling parameter: {e}", "sampling_params") from None
        except ValueError as e:
            raise RequestError(str(e), str(e).split("=")[0]) from None
        if not ids:
            raise RequestError("the prompt is empty", "prompt")
        if len(ids) >= self.context_len:
            raise RequestError(f"This model's maximum context length is {self.context_len} tokens; the prompt has "
                               f"{len(ids)} tokens.", "messages" if obj.text is None else "prompt")
        if len(ids) + 1 > self.max_total_tokens:
            raise RequestError(f"the prompt has {len(ids)} tokens, more than the KV cache holds "
                               f"({self.max_total_tokens} tokens)", "prompt")
        vocab = self.info["vocab_size"]
        if any(not 0 <= t < vocab for t in ids):
            raise RequestError(f"input_ids must be in [0, {vocab})", "input_ids")
        return ids, params

    async def generate(self, obj: GenerateInput) -> AsyncIterator[dict]:
        """Yield the request's result: cumulative snapshots when streaming, else only the final one."""
        ids, params = self._prepare(obj)
        rid = obj.rid or uuid.uuid4().hex
        if rid in self.states:
            raise RequestError(f"request id {rid!r} is already running", "rid")
        state = _State(rid, params, ids, IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens),
                       asyncio.Queue(), time.monotonic())
        self.states[rid] = state
        msg = m.GenerateReqMsg(rid, ids, params, params.seed if params.seed is not None else random.getrandbits(63),
                               obj.return_logprob, obj.logprob_start_len, obj.top_logprobs_num, obj.stream)
        await self.send.send(m.encode(msg))
        try:
            while True:
                await state.queue.get()
                while not state.queue.empty():
                    state.queue.get_nowait()
                done = state.finished is not None   # NOTE: read before yielding; it may change meanwhile
                if obj.stream or done:
                    yield self._snapshot(state, obj)
                if done:
                    return
        finally:
            if state.finished is None:          # the caller went away: abort and free its KV
                state.finished = {"type": "abort"}
                await self.abort(rid)
            self.states.pop(rid, None)

    async def abort(self, rid: str) -> None:
        await self.send.send(m.encode(m.AbortReqMsg(rid)))

    async def flush_cache(self) -> bool:
        return (await self._request(m.FlushCacheReqMsg())).ok

    async def get_stats(self) -> dict:
        return (await self._request(m.GetStatsReqMsg())).stats

    async def _request(self, msg: object) -> Any:
        async with self._control:         # NOTE: replies carry no id: never two control requests at once
            await self.send.send(m.encode(msg))
            return await asyncio.wait_for(self._replies.get(), timeout=60)

    # --- results ------------------------------------------------------------------------------------
    async def _recv_loop(self) -> None:
        while True:
            msg = m.decode(await self.recv.recv())
            if isinstance(msg, m.BatchOutMsg):
                for out in msg.outputs:
                    state = self.states.get(out.rid)
                    if state is not None and state.finished is None:
                        self._update(state, out)
                        state.queue.put_nowait(None)
            else:
                self._replies.put_nowait(msg)

    def _update(self, state: _State, out: m.ReqOutput) -> None:
        now = time.monotonic()
        if out.new_ids:
            if state.first_token_time is None:
                state.first_token_time = now
                self._observe("ttft", now - state.created)
            elif state.last_token_time is not None:
                self._observe("itl", (now - state.last_token_time) / len(out.new_ids))
            state.last_token_time = now
        state.meta.update(prompt_tokens=out.prompt_tokens, cached_tokens=out.cached_tokens)
        if out.input_logprobs is not None:
            state.meta["input_token_logprobs"] = out.input_logprobs
            state.meta["input_top_logprobs"] = out.input_top_logprobs
        for i, tok in enumerate(out.new_ids):
            state.ids.append(tok)
            if out.new_logprobs:
                state.out_logprobs.append(out.new_logprobs[i])
                state.out_top.append(out.new_top_logprobs[i])
            state.pending += state.detok.add([tok])
            if self._apply_stop(state):
                return
        if out.finished is not None:
            state.pending += state.detok.flush()
            self._apply_stop(state)
            if state.finished is None:
                state.text += state.pending
                state.pending = ""
                state.finished = out.finished
        elif state.params.stop:
            keep = stop_holdback(state.pending, state.params.stop)
            state.text += state.pending[: len(state.pending) - keep]
            state.pending = state.pending[len(state.pending) - keep:]
        else:
            state.text += state.pending
            state.pending = ""
        if state.finished is not None:
            self._observe("e2e", now - state.created)

    def _apply_stop(self, state: _State) -> bool:
        """Finish the request if its text now contains a stop string (trimmed unless no_stop_trim)."""
        stops = state.params.stop
        if not stops:
            return False
        full = state.text + state.pending
        at = find_stop(full, stops)
        if at is None:
            return False
        matched = next(s for s in stops if s and full.startswith(s, at))
        state.text = full if state.params.no_stop_trim else full[:at]
        state.pending = ""
        state.finished = {"type": "stop", "matched": matched}
        asyncio.get_running_loop().create_task(self.abort(state.rid))
        return True

    def _snapshot(self, state: _State, obj: GenerateInput) -> dict:
        meta = {"id": state.rid, "finish_reason": state.finished, "prompt_tokens": len(state.prompt_ids),
                "completion_tokens": len(state.ids), "cached_tokens": state.meta.get("cached_tokens", 0),
                "e2e_latency": time.monotonic() - state.created}
        if obj.return_logprob:
            meta["input_token_logprobs"] = state.meta.get("input_token_logprobs", [])
            meta["output_token_logprobs"] = list(state.out_logprobs)
            if obj.top_logprobs_num:
                meta["input_top_logprobs"] = state.meta.get("input_top_logprobs", [])
                meta["output_top_logprobs"] = list(state.out_top)
        return {"text": state.text, "output_ids": list(state.ids), "meta_info": meta}

    def _observe(self, name: str, value: float) -> None:
        if self.metrics is not None:
            self.metrics.observe(name, value)

    async def aclose(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            try:
                await self._loop_task
            except asyncio.CancelledError:
                pass
        self.ctx.destroy(linger=0)
