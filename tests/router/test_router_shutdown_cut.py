"""`hybridcache router --shutdown-timeout T`: what still runs when the grace period ends is cut as serve cuts it.
A stream ends with the final error event and `data: [DONE]` (it used to end with neither: curl rc 18), a
request not yet answered gets 503 with the same message (it used to get uvicorn's bare 500)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Iterator

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from hybridcache.router.app import RouterConfig, build_router_app
from hybridcache.router.policy import RoutingConfig
from hybridcache.server.shutdown_guard import SHUTDOWN_MESSAGE
from hybridcache.server.uvicorn_server import Server
from tests.router.serving import replica_app, serving_app
from tests.server.server_process import free_port

GRACE_S = 0.3


def _endless_replica(reached: threading.Event, aborted: threading.Event) -> FastAPI:
    """A replica whose stream never ends and whose non-streamed answer never comes: it waits until the router
    closes the request (`aborted`)."""
    app = replica_app()

    @app.post("/v1/completions")
    async def completions(request: Request):
        reached.set()
        if not (await request.json()).get("stream"):
            while not await request.is_disconnected():
                await asyncio.sleep(0.02)
            aborted.set()
            return {}

        async def events():
            while True:
                yield b'data: {"choices": [{"index": 0, "text": "a", "finish_reason": null}]}\n\n'
                await asyncio.sleep(0.02)
        return StreamingResponse(events(), media_type="text/event-stream")

    return app


@contextlib.contextmanager
def _router(replica_url: str) -> Iterator[tuple[str, Server]]:
    """The router on a free port in a thread, with a `GRACE_S` graceful shutdown (as `--shutdown-timeout`)."""
    app = build_router_app(RouterConfig((replica_url,), RoutingConfig("checkpoint"), poll_interval_s=30.0),
                           tokenizer=None)
    port = free_port()
    server = Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", access_log=False,
                                   lifespan="on", timeout_graceful_shutdown=GRACE_S))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                break
        assert time.monotonic() < deadline and thread.is_alive(), "the router did not start"
        time.sleep(0.05)
    try:
        yield url, server
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        assert not thread.is_alive()


def test_a_stream_cut_by_the_shutdown_ends_with_the_final_error_event_and_done():
    reached, aborted = threading.Event(), threading.Event()
    with serving_app(_endless_replica(reached, aborted)) as replica_url, _router(replica_url) as (url, server):
        body = {"prompt": [1, 2, 3], "max_tokens": 4000, "stream": True}
        lines = []
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as response:
            assert response.status_code == 200
            for line in response.iter_lines():  # ends cleanly: a cut body would raise here
                if line:
                    lines.append(line)
                if len(lines) == 3:
                    server.should_exit = True  # SIGTERM
    assert lines[-1] == "data: [DONE]"
    final = json.loads(lines[-2].removeprefix("data: "))
    assert final["error"]["message"] == SHUTDOWN_MESSAGE
    assert all(json.loads(line.removeprefix("data: "))["choices"][0]["text"] == "a" for line in lines[:-2])


def test_a_request_not_yet_answered_at_the_shutdown_gets_503():
    reached, aborted = threading.Event(), threading.Event()
    with serving_app(_endless_replica(reached, aborted)) as replica_url, _router(replica_url) as (url, server):
        result: dict = {}

        def ask():
            result["response"] = httpx.post(f"{url}/v1/completions", json={"prompt": [1, 2, 3]}, timeout=30)

        client = threading.Thread(target=ask)
        client.start()
        assert reached.wait(10)
        server.should_exit = True  # SIGTERM
        client.join(timeout=10)
        assert aborted.wait(10), "the router did not close its request to the replica"
    response = result["response"]
    assert response.status_code == 503
    assert response.json()["error"]["message"] == SHUTDOWN_MESSAGE
