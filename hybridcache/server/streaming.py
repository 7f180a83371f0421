"""Client disconnects: run a response while watching the ASGI `receive` channel for `http.disconnect`.

A client that goes away cancels the work that serves it, so the request is aborted in the engine and frees
everything it holds, both while it streams and while a non-streaming response is still being computed.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from starlette.requests import ClientDisconnect
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

T = TypeVar("T")


class ClientGone(Exception):
    """The client disconnected before the response was complete."""


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def run_until_disconnect(receive: Receive, work: Awaitable[T]) -> T:
    """Await `work`; if the client disconnects first, cancel it and raise ClientGone. Call only after the
    request body has been read (then `receive` yields nothing but the disconnect)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(receive))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done() and not watcher.done():  # we were cancelled ourselves
            task.cancel()
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    raise ClientGone()


class EventStreamResponse(StreamingResponse):
    """A `text/event-stream` response that stops at a client disconnect and always runs `on_close` once
    the stream ends, however it ends (finished, disconnected, failed or cancelled)."""

    def __init__(self, events: AsyncIterator[bytes], on_close: Callable[[], Any]) -> None:
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._events = events
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def stream() -> None:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for event in self._events:
                await send({"type": "http.response.body", "body": event, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        try:
            await run_until_disconnect(receive, stream())
        except (ClientGone, ClientDisconnect, OSError):
            pass
        except asyncio.CancelledError:
            # the server cancels responses still running when its shutdown timeout expires: end quietly
            pass
        finally:
            with contextlib.suppress(Exception):
                await self._events.aclose()
            self._on_close()
