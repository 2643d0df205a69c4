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

from mlaserve.config import ConfigError, ServerConfig
from mlaserve.config_resolve import http_only_flags
from mlaserve.server.launch import (NO_MAIN_GUARD_MESSAGE, LaunchError, launch_backend,
                                    refuse_spawned_reimport)
from mlaserve.server.manager import GenerateInput

logger = logging.getLogger(__name__)


def split_inputs(prompt: Any, input_ids: Any, sampling_params: Any) -> tuple[list[dict], bool]:
    """Normalise the Engine's single-or-batch arguments into per-request kwargs; returns (items, is_batch)."""
    if prompt is not None and input_ids is not None:
        raise ValueError("give either prompt or input_ids, not both")
    if isinstance(prompt, list):
        items, batch = [{"text": p} for p in prompt], True
    elif input_ids is not None and input_ids and isinstance(input_ids[0], list):
        items, batch = [{"input_ids": ids} for ids in input_ids], True
    else:
        items, batch = [{"text": prompt, "input_ids": input_ids}], False
    params = sampling_params or {}
    if isinstance(params, list):
        if len(params) != len(items):
            raise ValueError(f"{len(params)} sampling_params for {len(items)} prompts")
        for it, p in zip(items, params):
            it["sampling_params"] = dict(p)
    else:
        for it in items:
            it["sampling_params"] = dict(params)
    return items, batch


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
        returns an iterator of cumulative snapshots."""
        items, batch = split_inputs(prompt, input_ids, sampling_params)
        common = dict(return_logprob=return_logprob, logprob_start_len=logprob_start_len,
                      top_logprobs_num=top_logprobs_num)
        objs = [GenerateInput(**it, **common, rid=rid if not batch else None) for it in items]
        if stream:
            if batch:
                raise ValueError("stream=True takes a single prompt")
            objs[0].stream = True
            return self._stream_sync(objs[0])
        results = self._call(self._gather(objs))
        return results if batch else results[0]

    async def async_generate(self, prompt: str | list[str] | None = None, sampling_params: dict | list[dict] | None = None,
                             input_ids: list[int] | list[list[int]] | None = None, return_logprob: bool = False,
                             logprob_start_len: int = -1, top_logprobs_num: int = 0, stream: bool = False,
                             rid: str | None = None) -> dict | list[dict] | AsyncIterator[dict]:
        """The awaitable form of `generate` (callable from any event loop)."""
        items, batch = split_inputs(prompt, input_ids, sampling_params)
        objs = [GenerateInput(**it, return_logprob=return_logprob, logprob_start_len=logprob_start_len,
                              top_logprobs_num=top_logprobs_num, rid=rid if not batch else None) for it in items]
        if stream:
            if batch:
                raise ValueError("stream=True takes a single prompt")
            objs[0].stream = True
            return self._stream_async(objs[0])
        futs = [asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self._final(o), self.loop)) for o in objs]
        results = await asyncio.gather(*futs)
        return list(results) if batch else results[0]

    async def _gather(self, objs: list[GenerateInput]) -> list[dict]:
        return list(await asyncio.gather(*(self._final(o) for o in objs)))

    async def _final(self, obj: GenerateInput) -> dict:
        result = None
        async for result in self.manager.generate(obj):
            pass
        return result

    def _stream_sync(self, obj: GenerateInput) -> Iterator[dict]:
        agen = self.manager.generate(obj)
        try:
            while True:
                try:
                    yield self._call(_next(agen))
                except StopAsyncIteration:
                    return
        finally:                      # an abandoned stream aborts its request
            self._call(agen.aclose())

    async def _stream_async(self, obj: GenerateInput) -> AsyncIterator[dict]:
        agen = self.manager.generate(obj)
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
