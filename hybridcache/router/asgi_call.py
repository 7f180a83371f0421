"""One HTTP request through an ASGI app in this process, its response streamed back message by message.

The Ray Serve engine replica (ray_serve.py) runs the `hybridcache serve` application without a socket: every
request goes through the same routes, checks and streaming as over HTTP. `httpx.ASGITransport` would collect a
whole response before returning it; this yields each body message as the app sends it.

    async for message in asgi_request(app, "POST", "/v1/completions", headers, body):
        message["type"] == "http.response.start"   first: status and headers
        message["type"] == "http.response.body"    then: body pieces; the last has more_body False

Closing the iterator early (the caller's client went away, or its task was cancelled) tells the app the client
disconnected (`http.disconnect`), which aborts the request in the engine, and waits for the app to finish.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import Any

APP_EXIT_TIMEOUT_S = 10.0  # how long a closed request's app may take to notice the disconnect


async def asgi_request(app: Any, method: str, path: str, headers: Sequence[tuple[str, str]] = (),
                       body: bytes = b"", query: str = "") -> AsyncIterator[dict]:
    """Run `method path?query` with `headers` and `body` through `app`; yields the response's ASGI messages
    (module docstring). An exception the app raises before its response is complete is raised here."""
    scope = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
        "method": method, "scheme": "http", "path": path, "raw_path": path.encode(), "root_path": "",
        "query_string": query.encode(), "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0),
        "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers]
        + [(b"content-length", str(len(body)).encode())],
    }
    messages: asyncio.Queue[dict | None] = asyncio.Queue()
    gone = asyncio.Event()
    request_sent = False

    async def receive() -> dict:
        nonlocal request_sent
        if not request_sent:
            request_sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        await messages.put(message)

    task = asyncio.ensure_future(app(scope, receive, send))
    task.add_done_callback(lambda _: messages.put_nowait(None))
    try:
        while True:
            message = await messages.get()
            if message is None:  # the app returned (or raised) before it ended its response
                task.result()
                raise RuntimeError(f"{method} {path}: the application ended without completing its response")
            yield message
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                return
    finally:
        gone.set()
        if not task.done():
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(asyncio.shield(task), APP_EXIT_TIMEOUT_S)
            task.cancel()
