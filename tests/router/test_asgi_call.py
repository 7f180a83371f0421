"""asgi_request: an app's response streamed back message by message; closing early tells the app its client
disconnected; an app that fails before completing its response raises."""

from __future__ import annotations

import asyncio

import pytest

from hybridcache.router.asgi_call import asgi_request


def _app(log: list):
    async def app(scope, receive, send):
        log.append((scope["method"], scope["path"], scope["query_string"], dict(scope["headers"])))
        request = await receive()
        log.append(request["body"])
        if scope["path"] == "/fail":
            raise RuntimeError("app failed")
        await send({"type": "http.response.start", "status": 201, "headers": [(b"content-type", b"text/plain")]})
        for piece in (b"a", b"b", b"c"):
            await send({"type": "http.response.body", "body": piece, "more_body": True})
            if scope["path"] == "/slow":
                await asyncio.sleep(0.01)
        if scope["path"] == "/slow":
            log.append((await receive())["type"])  # the caller closed the iterator: a disconnect
            return
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    return app


def test_messages_stream_in_order_with_the_request_as_given():
    log: list = []

    async def run():
        return [m async for m in asgi_request(_app(log), "POST", "/x", [("Authorization", "Bearer k")], b"{}",
                                              query="since=3")]

    messages = asyncio.run(run())
    assert messages[0] == {"type": "http.response.start", "status": 201, "headers": [(b"content-type", b"text/plain")]}
    assert [m["body"] for m in messages[1:]] == [b"a", b"b", b"c", b""]
    method, path, query, headers = log[0]
    assert (method, path, query) == ("POST", "/x", b"since=3") and headers[b"authorization"] == b"Bearer k"
    assert headers[b"content-length"] == b"2" and log[1] == b"{}"


def test_closing_early_is_a_disconnect_and_a_failing_app_raises():
    log: list = []

    async def first_two():
        stream = asgi_request(_app(log), "GET", "/slow")
        got = [await stream.__anext__(), await stream.__anext__()]
        await stream.aclose()
        return got

    got = asyncio.run(first_two())
    assert got[1]["body"] == b"a" and log[-1] == "http.disconnect"

    async def failing():
        return [m async for m in asgi_request(_app(log), "GET", "/fail")]

    with pytest.raises(RuntimeError, match="app failed"):
        asyncio.run(failing())
