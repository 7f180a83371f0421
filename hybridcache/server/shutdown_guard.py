"""The answer to a request that the server's shutdown cut short, for every route in one place.

When its grace period (`--shutdown-timeout`) ends, uvicorn cancels the requests still running. One that has not
begun its response (its body still arriving, its prompt rendering or tokenizing, waiting for the engine, or a
non-streaming request still generating) gets 503 with an OpenAI error object here, where it used to get uvicorn's
bare `500 Internal Server Error` and a traceback in the log. A response already begun (a stream) ends as its
route ends it (`EventStreamResponse` sends its final error event and `[DONE]`).
"""

from __future__ import annotations

import asyncio

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from hybridcache.server.error_response import ErrorResponse
from hybridcache.server.errors import error_body

SHUTDOWN_MESSAGE = "the server shut down before this request finished"


class ShutdownGuard:
    """ASGI middleware: an HTTP request cancelled before its response began is answered 503 (see the module
    docstring); the cancellation ends there, as the request does."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def watched_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watched_send)
        except asyncio.CancelledError:
            if started:
                raise
            await ErrorResponse(error_body(503, SHUTDOWN_MESSAGE), status_code=503)(scope, receive, send)
