"""What the router logs: a client gone while sending its body is one INFO line and a 499 (it was uvicorn's ERROR
traceback, and five of them in 10 s used up the rate limit that a genuine error's traceback then fell under); a
replica that never comes up is named, with its reason, once per reason (it was never logged: only an up -> down
change was)."""

from __future__ import annotations

import asyncio
import logging

import httpx

from hybridcache.router.app import RouterConfig, build_router_app
from hybridcache.router.replicas import Replica


def _post_cut_mid_body(app) -> list[dict]:
    """POST /v1/completions whose client disconnects after the first part of its body; the messages sent back."""
    incoming = [{"type": "http.request", "body": b'{"prompt": "sec', "more_body": True}, {"type": "http.disconnect"}]
    sent: list[dict] = []

    async def receive() -> dict:
        return incoming.pop(0) if incoming else {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/completions", "raw_path": b"/v1/completions", "root_path": "", "query_string": b"",
             "headers": [(b"host", b"x"), (b"content-type", b"application/json"), (b"content-length", b"1000")],
             "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 8000)}
    asyncio.run(app(scope, receive, send))
    return sent


def test_a_client_gone_mid_upload_is_one_info_line_and_a_499(caplog):
    app = build_router_app(RouterConfig(("http://127.0.0.1:1",), poll_interval_s=30.0), tokenizer=None)
    with caplog.at_level(logging.INFO):
        sent = _post_cut_mid_body(app)
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 499
    assert [r.getMessage() for r in caplog.records if r.name == "hybridcache.router"] == [
        "POST /v1/completions: the client disconnected while sending its request"]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def _polls(replica: Replica, answers: list) -> None:
    """Poll `replica` once per answer: an httpx.Response, or an exception the transport raises."""

    def handler(request: httpx.Request) -> httpx.Response:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    async def run(count: int) -> None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            for _ in range(count):
                await replica.poll(client, 1.0)

    asyncio.run(run(len(answers)))


def test_a_replica_that_never_comes_up_is_logged_once_per_reason(caplog):
    """A 401 at every poll (the replica wants a key the router does not send), then a refused connection: each
    reason logged once, the first failure included; up again, then down: logged again."""
    replica = Replica("http://127.0.0.1:8001")
    snapshot = httpx.Response(200, json={"reset": True, "next": 0, "block_size": 16, "epoch": "e", "events": []})
    with caplog.at_level(logging.INFO, logger="hybridcache.router"):
        _polls(replica, [httpx.Response(401)] * 3 + [httpx.ConnectError("refused")] * 2)
        down = [r.getMessage() for r in caplog.records if r.name == "hybridcache.router" and r.levelname == "WARNING"]
        assert len(down) == 2 and "401 Unauthorized" in down[0] and "ConnectError: refused" in down[1]
        assert all(line.startswith("replica http://127.0.0.1:8001 is down: events poll failed:") for line in down)
        assert not replica.up
        caplog.clear()
        _polls(replica, [snapshot, httpx.ConnectError("refused"), httpx.ConnectError("refused")])
    ours = [r.levelname for r in caplog.records if r.name == "hybridcache.router"]
    assert ours == ["INFO", "WARNING"]  # up, then down (once)
