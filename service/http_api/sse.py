"""Server-sent events for one request, and the client-disconnect watch both response kinds share.

A client that goes away (closed connection) aborts its request at once: the runner frees its slots within one
step, whether the request was streaming, waiting in the queue, or being collected for a non-streaming answer.
"""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from service.errors import StreamStalled

T = TypeVar("T")
DONE = b"data: [DONE]\n\n"


def event(data: Any) -> bytes:
    return b"data: " + json.dumps(data, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


async def _disconnected(receive: Receive) -> None:
    """Returns when the client has gone (the request body was read already)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(receive: Receive, work: Awaitable[T], on_disconnect: Callable[[], None]) -> T | None:
    """`work`, unless the client goes first: then `on_disconnect()`, `work` cancelled, None."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if task.done():
        return task.result()
    on_disconnect()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return None


class EventStream(Response):
    """`text/event-stream` from an async iterator of encoded events. `deliver` wraps each send (the request's
    stall timer may end a send a client never reads); `on_close` runs however the stream ends."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes], on_close: Callable[[], None],
                 deliver: Callable[[Awaitable[None]], Awaitable[None]], headers: dict[str, str] | None = None):
        super().__init__(headers={"cache-control": "no-cache", "x-accel-buffering": "no", **(headers or {})})
        self.raw_headers = [(k, v) for k, v in self.raw_headers if k != b"content-length"]  # chunked
        self._events, self._on_close, self._deliver = events, on_close, deliver

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def stream() -> None:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            try:
                async for chunk in self._events:
                    await self._deliver(send({"type": "http.response.body", "body": chunk, "more_body": True}))
            except StreamStalled:  # the client left the finished output unread: drop the connection
                return
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        try:
            await until_disconnect(receive, stream(), lambda: None)
        finally:
            self._on_close()
