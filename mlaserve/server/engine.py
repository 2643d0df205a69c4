"""The offline Engine API (SGLang's shape): the same scheduler process and tokenizer manager as the HTTP server,
driven from a background event loop so plain synchronous code can call it.

    engine = mlaserve.Engine(model_path=DIR, device="cpu")
    out = engine.generate(prompt="Hi", sampling_params={"max_new_tokens": 8})
"""
from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

from pydantic import ValidationError

from mlaserve.config import ConfigError, ServerConfig
from mlaserve.config_resolve import http_only_flags
from mlaserve.core import RequestError, SamplingParams
from mlaserve.server.launch import (NO_MAIN_GUARD_MESSAGE, LaunchError, launch_backend,
                                    refuse_spawned_reimport)
from mlaserve.server.manager import GenerateInput
from mlaserve.server.protocol import GenerateRequest, request_error

logger = logging.getLogger(__name__)


def native_inputs(req: GenerateRequest) -> tuple[list[GenerateInput], bool]:
    """The native request (/generate, Engine.generate) as one GenerateInput per prompt; returns (inputs, is_batch)."""
    if isinstance(req.text, list):
        prompts, batch = [{"text": t} for t in req.text], True
    elif req.input_ids and isinstance(req.input_ids[0], list):
        prompts, batch = [{"input_ids": ids} for ids in req.input_ids], True
    else:
        prompts, batch = [{"text": req.text, "input_ids": req.input_ids}], False
    params = req.sampling_params if req.sampling_params is not None else SamplingParams()
    if isinstance(params, list) and len(params) != len(prompts):
        raise RequestError(f"{len(params)} sampling_params for {len(prompts)} prompts", "sampling_params")
    if req.stream and batch:
        raise RequestError("stream takes a single prompt", "stream")
    rids = req.rid if isinstance(req.rid, list) else [req.rid] * len(prompts)
    if batch and isinstance(req.rid, str):
        raise RequestError("a batch takes a list of rids, one per prompt", "rid")
    if not batch and isinstance(req.rid, list):
        raise RequestError("a single prompt takes one rid (a string)", "rid")
    if len(rids) != len(prompts):
        raise RequestError(f"{len(rids)} rids for {len(prompts)} prompts", "rid")
    if req.rid is not None and len(set(rids)) != len(rids):
        raise RequestError("the rids of a batch must differ", "rid")
    each = params if isinstance(params, list) else [params] * len(prompts)
    return [GenerateInput(**p, sampling_params=sp, return_logprob=req.return_logprob,
                          logprob_start_len=req.logprob_start_len, top_logprobs_num=req.top_logprobs_num,
                          stream=req.stream, rid=rid) for p, sp, rid in zip(prompts, each, rids)], batch


def engine_inputs(**fields: Any) -> tuple[list[GenerateInput], bool]:
    """`native_inputs` of Engine.generate's arguments; a wrong one raises RequestError naming it."""
    fields["text"] = fields.pop("prompt")
    try:
        req = GenerateRequest.model_validate(fields)
    except ValidationError as e:
        raise request_error(e) from None
    return native_inputs(req)


class Engine:
    def __init__(self, model_path: str | None = None, **server_args: Any):
        """Start the scheduler process (spawned) and the tokenizer manager; raises `LaunchError` (one line) if
        they cannot start. A script that creates the Engine at its top level without the `__main__` guard
        exits with one line saying so (the spawned scheduler would re-run the script)."""
        refuse_spawned_reimport()
        self.handle = self.manager = None
        self.server = ServerConfig.from_flat(model_path=model_path, **server_args)
        if http_only_flags(self.server):
            raise ConfigError(f"{', '.join(http_only_flags(self.server))}: HTTP server options; the offline Engine "
                              "serves no HTTP (use `mlaserve serve`)")
        logging.basicConfig(level=self.server.log_level.upper())
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="mlaserve-engine")
        self._thread.start()
        try:
            self.model_path, self.handle, self.manager = self._call(self._start())
        except LaunchError as e:
            self.shutdown()
            if str(e) == NO_MAIN_GUARD_MESSAGE:
                raise SystemExit(f"mlaserve: {e}") from None
            raise

    async def _start(self):
        path, handle, manager = await asyncio.to_thread(launch_backend, self.server)
        manager.start()
        return path, handle, manager

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    # --- generation -------------------------------------------------------------------------------
    def generate(self, prompt: str | list[str] | None = None, sampling_params: dict | list[dict] | None = None,
                 input_ids: list[int] | list[list[int]] | None = None, return_logprob: bool = False,
                 logprob_start_len: int = -1, top_logprobs_num: int = 0, stream: bool = False,
                 rid: str | None = None) -> dict | list[dict] | Iterator[dict]:
        """Generate for one prompt (-> dict) or a batch (-> list of dicts); `stream=True` (one prompt)
        returns an iterator of cumulative snapshots.

        Raises RequestError naming the field for a bad argument (as /generate answers 400), EngineDeadError
        when the scheduler process is gone."""
        objs, batch = engine_inputs(prompt=prompt, sampling_params=sampling_params, input_ids=input_ids,
                                    return_logprob=return_logprob, logprob_start_len=logprob_start_len,
                                    top_logprobs_num=top_logprobs_num, stream=stream, rid=rid)
        reqs = self._call(self._prepare(objs))
        if stream:
            return self._stream_sync(reqs[0])
        results = self._call(self._gather(reqs))
        return results if batch else results[0]

    async def async_generate(self, prompt: str | list[str] | None = None, sampling_params: dict | list[dict] | None = None,
                             input_ids: list[int] | list[list[int]] | None = None, return_logprob: bool = False,
                             logprob_start_len: int = -1, top_logprobs_num: int = 0, stream: bool = False,
                             rid: str | None = None) -> dict | list[dict] | AsyncIterator[dict]:
        """The awaitable form of `generate` (callable from any event loop)."""
        objs, batch = engine_inputs(prompt=prompt, sampling_params=sampling_params, input_ids=input_ids,
                                    return_logprob=return_logprob, logprob_start_len=logprob_start_len,
                                    top_logprobs_num=top_logprobs_num, stream=stream, rid=rid)
        reqs = await self._on_loop(self._prepare(objs))
        if stream:
            return self._stream_async(reqs[0])
        futs = [self._on_loop(self._final(r)) for r in reqs]
        results = await asyncio.gather(*futs)
        return list(results) if batch else results[0]

    def _on_loop(self, coro) -> asyncio.Future:
        return asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop))

    async def _prepare(self, objs: list[GenerateInput]) -> list:
        reqs = [self.manager.prepare(o) for o in objs]
        await self.manager.check_grammars(reqs)
        return reqs

    async def _gather(self, reqs: list) -> list[dict]:
        return list(await asyncio.gather(*(self._final(r) for r in reqs)))

    async def _final(self, req) -> dict:
        result = None
        async for result in self.manager.generate(req):
            pass
        return result

    def _stream_sync(self, req) -> Iterator[dict]:
        agen = self.manager.generate(req)
        try:
            while True:
                try:
                    yield self._call(_next(agen))
                except StopAsyncIteration:
                    return
        finally:                      # an abandoned stream aborts its request
            self._call(agen.aclose())

    async def _stream_async(self, req) -> AsyncIterator[dict]:
        agen = self.manager.generate(req)
        try:
            while True:
                fut = asyncio.run_coroutine_threadsafe(_next(agen), self.loop)
                try:
                    yield await asyncio.wrap_future(fut)
                except StopAsyncIteration:
                    return
        finally:
            await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(agen.aclose(), self.loop))

    # --- control ----------------------------------------------------------------------------------
    def flush_cache(self) -> bool:
        return self._call(self.manager.flush_cache())

    def get_server_info(self) -> dict:
        stats = self._call(self.manager.get_stats())
        return {**self.server.flat(), **self.handle.info, **stats, "model_path": self.model_path}

    def shutdown(self) -> None:
        """Stop the scheduler process and the background loop; removes the ipc files. Idempotent."""
        if getattr(self, "handle", None) is not None:
            self.handle.stop()
            self.handle = None
        if getattr(self, "manager", None) is not None and self.loop.is_running():
            self._call(self.manager.aclose())
            self.manager = None
        if getattr(self, "_thread", None) is not None and self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=5)

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:  # noqa: BLE001 - interpreter teardown
            pass


async def _next(agen: AsyncIterator[dict]) -> dict:
    return await agen.__anext__()
