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
    the stream ends, however it ends (finished, disconnected, failed or cancelled).

    Cancelled (the server's shutdown grace period ended while it still ran), it sends `final_events`
    (an error event and `data: [DONE]`; or a function giving them then, for events numbered in their stream) and
    ends the body, so that the client sees a complete stream."""

    def __init__(self, events: AsyncIterator[bytes], on_close: Callable[[], Any],
                 final_events: tuple[bytes, ...] | Callable[[], tuple[bytes, ...]] = ()) -> None:
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._events = events
        self._on_close = on_close
        self._final_events = final_events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = False

        async def stream() -> None:
            nonlocal started
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            started = True
            async for event in self._events:
                await send({"type": "http.response.body", "body": event, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        task = asyncio.ensure_future(stream())
        try:
            await run_until_disconnect(receive, task)
        except (ClientGone, ClientDisconnect, OSError):
            pass
        except asyncio.CancelledError:
            # the server cancels responses still running when its shutdown grace period ends
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
            with contextlib.suppress(Exception):
                await self._finish(send, started)
        finally:
            with contextlib.suppress(Exception):
                await self._events.aclose()
            self._on_close()

    async def _finish(self, send: Send, started: bool) -> None:
        if not started:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        for event in self._final_events() if callable(self._final_events) else self._final_events:
            await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
