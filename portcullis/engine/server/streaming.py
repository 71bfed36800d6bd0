"""Delivery of results: Server-Sent Events for streams, and disconnect detection for plain
responses, so a client that goes away stops its engine work at once either way."""
from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from fastapi import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from portcullis.engine.server.errors import APIError

T = TypeVar("T")


def sse(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n"


class SSEResponse(StreamingResponse):
    """A text/event-stream response that runs `on_close` however the stream ends: finished,
    failed, or cancelled because the client disconnected (Starlette cancels the body iterator
    then, which may leave an async generator suspended and never finalised)."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None], headers: dict[str, str] | None = None):
        super().__init__(events, headers={"Cache-Control": "no-cache", **(headers or {})})
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


class ClientDisconnected(Exception):
    pass


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it if the client closes the connection first (the body has
    been read by then, so the next ASGI message can only be the disconnect)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, APIError):
                await task
        watcher.cancel()
    if task.cancelled():
        raise ClientDisconnected()
    return task.result()
