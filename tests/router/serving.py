"""Serve an ASGI app on a free loopback port in a thread of the test process (fake replicas, the router)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import httpx
import uvicorn
from fastapi import FastAPI

from hybridcache.server.uvicorn_server import Server
from tests.server.server_process import free_port


@contextlib.contextmanager
def serving_app(app, health_path: str = "/health") -> Iterator[str]:
    """Yields the base URL once `health_path` answers (any status)."""
    port = free_port()
    server = Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", access_log=False,
                                   lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(httpx.HTTPError):
                httpx.get(f"{url}{health_path}", timeout=1.0)
                break
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError(f"the app at {url} did not start")
            time.sleep(0.05)
        yield url
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def replica_app(epoch: str = "e0") -> FastAPI:
    """A fake replica's app to add routes to: /health answers ok, and /v1/cache/events serves
    `app.state.events` (empty unless a test appends events to it) in the cache epoch `epoch`."""
    app = FastAPI()
    app.state.events = []

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/cache/events")
    async def cache_events(since: int | None = None):
        return {"block_size": 16, "full_prompt_hits": False, "reset": since is None,
                "next": len(app.state.events), "events": app.state.events[since or 0:], "epoch": epoch}

    return app


def wait_until(condition, timeout_s: float) -> bool:
    """Poll `condition` every 20 ms until it holds (True) or `timeout_s` passes (False)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True
