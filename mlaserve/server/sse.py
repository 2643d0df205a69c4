"""Server-sent events and client disconnects: a client that goes away closes the manager's generators, which
aborts their requests in the scheduler and frees their KV (streamed or not). A stream that fails after its
headers went out ends with an OpenAI error event and [DONE]."""
from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from starlette.requests import ClientDisconnect, Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from mlaserve.server.protocol import error_body

logger = logging.getLogger(__name__)

T = TypeVar("T")
DONE = "data: [DONE]\n\n"
_END = object()


def sse(obj: Any) -> str:
    """One SSE event carrying `obj` as JSON."""
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def stream_error(e: Exception) -> str:
    """The last events of a stream that failed after its headers went out: an OpenAI error body, then [DONE]."""
    status = getattr(e, "status_code", 500)
    message = getattr(e, "message", None) or f"internal server error: {type(e).__name__}: {e}"
    return sse(error_body(message, getattr(e, "param", None), status)) + DONE


async def _guarded(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """`events`, except that an error ends them with `stream_error` (the client always sees why)."""
    try:
        async for event in events:
            yield event
    except Exception as e:  # noqa: BLE001 - reported to the client in the stream
        if getattr(e, "status_code", 500) >= 500:
            logger.error("a stream failed: %s: %s", type(e).__name__, e)
        yield stream_error(e)
    finally:
        aclose = getattr(events, "aclose", None)
        if aclose is not None:
            await aclose()


class ClientGone(Exception):
    """The client disconnected before its answer was ready (its requests were aborted)."""


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class SSEResponse(StreamingResponse):
    """A `text/event-stream` response whose body iterator is always closed: at its end, on an error, and
    as soon as the client disconnects, even while no token is being sent."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str]):
        super().__init__(_guarded(events))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        streamer = asyncio.ensure_future(self.stream_response(send))
        watcher = asyncio.ensure_future(_wait_disconnect(receive))
        try:
            await asyncio.wait({streamer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (streamer, watcher):
                task.cancel()
            await asyncio.gather(streamer, watcher, return_exceptions=True)
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()
        if streamer.done() and not streamer.cancelled():
            err = streamer.exception()
            if err is not None and not isinstance(err, (OSError, ClientDisconnect)):
                logger.error("streaming a response failed: %s: %s", type(err).__name__, err)


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`; if the client disconnects first, cancel it (closing its generators) and raise ClientGone."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request.receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
    if task.cancelled():
        raise ClientGone()
    return task.result()


async def merge(gens: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Interleave several async iterators as (index, item). Closing the merge closes every one of them;
    an exception in one is raised here."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, gen: AsyncIterator[T]) -> None:
        try:
            async for item in gen:
                queue.put_nowait((i, item, None))
            queue.put_nowait((i, _END, None))
        except Exception as e:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait((i, None, e))

    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(gens)]
    try:
        left = len(tasks)
        while left:
            i, item, err = await queue.get()
            if err is not None:
                raise err
            if item is _END:
                left -= 1
                continue
            yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def collect(gens: list[AsyncIterator[T]]) -> list[T]:
    """The last item of each iterator (the manager's final snapshot), in order."""
    last: list[Any] = [None] * len(gens)
    async for i, item in merge(gens):
        last[i] = item
    return last
