"""The router against fake replicas: a 503 or an unreachable replica before the first byte sends the request to
another one; a stream cut mid-way ends with an error event and [DONE]; with no replica up, a clear 503."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from hybridcache.cache.events import CacheEvent, EventKind
from hybridcache.cache.trie import chain_hash, root_hash
from hybridcache.router.app import RouterConfig, build_router_app, replica_verdict
from hybridcache.router.policy import RoutingConfig
from hybridcache.server.shutdown_guard import SHUTDOWN_MESSAGE
from tests.router.serving import replica_app, serving_app, wait_until
from tests.server.server_process import free_port

PROMPT = list(range(1, 21))


def _fake_replica(mode: str, hit_step: int = 0, epoch: str = "e0") -> FastAPI:
    """A replica whose cache holds one checkpoint of PROMPT at `hit_step` (none for 0) and whose completions
    answer as `mode` says: ok, 503, timeout (a request_timeout 503), busy (a 503 with Retry-After), stream-cut (one
    chunk, then the connection drops)."""
    app = FastAPI()
    app.state.calls = 0
    app.state.epoch = epoch
    events = []
    if hit_step:
        root = root_hash(None)
        events.append(CacheEvent(EventKind.CHECKPOINT_STORED, anchor_hash=root, step=hit_step,
                                 tail_hash=chain_hash(root, tuple(PROMPT[:hit_step]), ())).to_json())

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/cache/events")
    async def cache_events(since: int | None = None):
        fresh = since is None
        return {"block_size": 16, "full_prompt_hits": False, "reset": fresh, "next": len(events),
                "events": events if fresh else [], "epoch": app.state.epoch}

    @app.post("/v1/completions")
    async def completions():
        app.state.calls += 1
        if mode == "503":
            return JSONResponse({"error": {"message": "engine dead"}}, status_code=503)
        if mode == "timeout":  # `hybridcache serve --request-timeout`: this request's own outcome
            return JSONResponse({"error": {"message": "ran past the timeout", "code": "request_timeout"}},
                                status_code=503, headers={"x-should-retry": "false"})
        if mode == "shut-down":  # the replica's shutdown cut the request (`ShutdownGuard`)
            return JSONResponse({"error": {"message": SHUTDOWN_MESSAGE}}, status_code=503)
        if mode == "busy":  # `--max-queued-requests`: a full queue
            return JSONResponse({"error": {"message": "the server is busy"}}, status_code=503,
                                headers={"Retry-After": "1"})
        if mode == "stream-cut":
            async def events_then_cut():
                yield b'data: {"choices": [{"index": 0, "text": "a"}]}\n\n'
                await asyncio.sleep(0.05)
                raise RuntimeError("replica died")
            return StreamingResponse(events_then_cut(), media_type="text/event-stream")
        return {"choices": [{"index": 0, "text": "ok"}],
                "usage": {"prompt_tokens": len(PROMPT), "completion_tokens": 1,
                          "prompt_tokens_details": {"cached_tokens": hit_step}}}

    return app


def _router(urls, policy: str = "checkpoint"):
    return build_router_app(RouterConfig(tuple(urls), RoutingConfig(policy), poll_interval_s=30.0), tokenizer=None)


def _metric(text: str, name: str, url: str | None = None) -> float:
    key = f'{name}{{replica="{url}"}}' if url else name
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(key + " ")))


def test_best_replica_failing_before_its_first_byte_is_retried_on_another():
    failing, healthy = _fake_replica("503", hit_step=12), _fake_replica("ok")
    with serving_app(failing) as bad, serving_app(healthy) as good, serving_app(_router([bad, good])) as router:
        response = httpx.post(f"{router}/v1/completions", json={"prompt": PROMPT, "max_tokens": 1}, timeout=30)
        assert response.status_code == 200 and response.json()["choices"][0]["text"] == "ok"
        assert failing.state.calls == 1 and healthy.state.calls == 1  # the predicted hit was tried first
        metrics = httpx.get(f"{router}/metrics").text
        assert _metric(metrics, "hybridcache_router_requests_retried_away_total", bad) == 1
        assert _metric(metrics, "hybridcache_router_replica_up", bad) == 0
        assert _metric(metrics, "hybridcache_router_requests_routed_total", good) == 1
        assert _metric(metrics, "hybridcache_router_retries_total") == 1
        health = httpx.get(f"{router}/health").json()
        assert [r["up"] for r in health["replicas"]] == [False, True]


def test_a_replicas_request_timeout_is_the_answer_not_a_fault():
    """A 503 for a request that ran past the replica's --request-timeout is that request's outcome: it reached the
    client as the replica sent it, the replica stays up, nothing was run again elsewhere (it was retried on every
    replica, doubling the wait, and marked each one down; found by a bug hunt)."""
    slow, other = _fake_replica("timeout", hit_step=12), _fake_replica("ok")
    with serving_app(slow) as first, serving_app(other) as second, serving_app(_router([first, second])) as router:
        response = httpx.post(f"{router}/v1/completions", json={"prompt": PROMPT, "max_tokens": 1}, timeout=30)
        assert response.status_code == 503 and response.json()["error"]["code"] == "request_timeout"
        assert response.headers["x-should-retry"] == "false"  # relayed: the SDKs must not send it again either
        assert (slow.state.calls, other.state.calls) == (1, 0)
        assert [r["up"] for r in httpx.get(f"{router}/health").json()["replicas"]] == [True, True]


def test_a_request_timeout_in_anthropics_shape_is_the_answer_too():
    """Anthropic's error object has no `code`: a /v1/messages request past a replica's --request-timeout was read
    as the replica being down, sent again to every replica and marked each one down (hunt 210). The replica's
    `x-should-retry: false` says it is the request's own outcome, whatever the body's shape."""
    body = json.dumps({"type": "error", "error": {"type": "overloaded_error", "message": "ran past the timeout"}})
    assert replica_verdict(503, {"x-should-retry": "false"}, body.encode()) == "answer"
    assert replica_verdict(503, {"X-Should-Retry": "false"}, body.encode()) == "answer"
    assert replica_verdict(503, {}, body.encode()) == "down"
    assert replica_verdict(503, {"retry-after": "1"}, body.encode()) == "busy"


def test_a_busy_replica_is_passed_over_not_marked_down():
    """A full queue (503 with Retry-After) sends the request to another replica and keeps the busy one up (and its
    index); with every replica busy the client gets the 503 and its Retry-After."""
    busy, other = _fake_replica("busy", hit_step=12), _fake_replica("ok")
    with serving_app(busy) as first, serving_app(other) as second, serving_app(_router([first, second])) as router:
        response = httpx.post(f"{router}/v1/completions", json={"prompt": PROMPT, "max_tokens": 1}, timeout=30)
        assert response.status_code == 200 and (busy.state.calls, other.state.calls) == (1, 1)
        metrics = httpx.get(f"{router}/metrics").text
        assert _metric(metrics, "hybridcache_router_replica_up", first) == 1
        assert _metric(metrics, "hybridcache_router_indexed_checkpoints", first) == 1
    with serving_app(_fake_replica("busy")) as only, serving_app(_router([only])) as router:
        response = httpx.post(f"{router}/v1/completions", json={"prompt": PROMPT, "max_tokens": 1}, timeout=30)
        assert response.status_code == 503 and response.headers["retry-after"] == "1"
        assert "busy" in response.json()["error"]["message"]


def test_a_request_every_replicas_shutdown_cut_gets_the_shutdown_answer():
    """serve --data-parallel-size shutting down: each replica answers a request it was running with its 503 "the
    server shut down before this request finished"; the router tried the next, and when none could take it answered
    its own "no replica could take the request: ... answered 503" (hunt 180). One replica cut it and another is up:
    the other runs it."""
    first, second = _fake_replica("shut-down", hit_step=12), _fake_replica("shut-down")
    with serving_app(first) as a, serving_app(second) as b, serving_app(_router([a, b])) as router:
        response = httpx.post(f"{router}/v1/completions", json={"prompt": PROMPT, "max_tokens": 1}, timeout=30)
        assert response.status_code == 503 and response.json()["error"]["message"] == SHUTDOWN_MESSAGE
        assert (first.state.calls, second.state.calls) == (1, 1)
    cut, other = _fake_replica("shut-down", hit_step=12), _fake_replica("ok")
    with serving_app(cut) as a, serving_app(other) as b, serving_app(_router([a, b])) as router:
        response = httpx.post(f"{router}/v1/completions", json={"prompt": PROMPT, "max_tokens": 1}, timeout=30)
        assert response.status_code == 200 and (cut.state.calls, other.state.calls) == (1, 1)


def test_predicted_and_reported_hits_and_an_unreachable_replica():
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    hit = _fake_replica("ok", hit_step=12)
    with serving_app(hit) as good, serving_app(_router([dead, good])) as router:
        for _ in range(2):
            response = httpx.post(f"{router}/v1/completions", json={"prompt": PROMPT}, timeout=30)
            assert response.status_code == 200
        metrics = httpx.get(f"{router}/metrics").text
        assert _metric(metrics, "hybridcache_router_replica_up", dead) == 0
        assert _metric(metrics, "hybridcache_router_predicted_hit_tokens_total", good) == 24
        assert _metric(metrics, "hybridcache_router_reported_hit_tokens_total", good) == 24
        assert _metric(metrics, "hybridcache_router_indexed_checkpoints", good) == 1


def test_stream_cut_mid_way_ends_with_an_error_event():
    with serving_app(_fake_replica("stream-cut")) as cut, serving_app(_router([cut])) as router:
        with httpx.stream("POST", f"{router}/v1/completions", json={"prompt": PROMPT, "stream": True},
                          timeout=30) as response:
            assert response.status_code == 200
            lines = [line for line in response.iter_lines() if line]
        assert lines[0].startswith('data: {"choices"')
        assert "failed mid-stream" in lines[-2] and "bad_gateway" in lines[-2]
        assert lines[-1] == "data: [DONE]"
        assert _metric(httpx.get(f"{router}/metrics").text, "hybridcache_router_failed_total") == 1
        assert httpx.get(f"{router}/health").json()["replicas"][0]["in_flight"] == 0


def test_no_replica_up_is_a_clear_503():
    dead = f"http://127.0.0.1:{free_port()}"
    with serving_app(_router([dead])) as router:
        response = httpx.post(f"{router}/v1/completions", json={"prompt": PROMPT}, timeout=30)
        assert response.status_code == 503 and "no replica could take the request" in response.text
        assert httpx.get(f"{router}/health").status_code == 503
        bad = httpx.post(f"{router}/v1/completions", content=b"{", headers={"content-type": "application/json"})
        assert bad.status_code == 400 and "not valid JSON" in bad.text
        deep = httpx.post(f"{router}/v1/completions", content=b"[" * 100_000,
                          headers={"content-type": "application/json"})
        assert deep.status_code == 400 and "nested too deeply" in deep.json()["error"]["message"]
        unknown = httpx.get(f"{router}/v1/nope")  # OpenAI's error shape, as a replica answers it
        assert unknown.status_code == 404 and unknown.json()["error"]["message"] == "GET /v1/nope: Not Found"


def test_a_restarted_replica_is_indexed_again_from_a_snapshot():
    """Event numbers of the old log mean nothing in a new one: an epoch change drops the index, and the next poll
    takes a snapshot."""
    from hybridcache.router.replicas import Replica

    app = _fake_replica("ok", hit_step=12, epoch="before")

    async def run() -> list[int]:
        replica = Replica("http://replica")
        seen = []
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app)) as client:
            for step in range(4):
                if step == 2:
                    app.state.epoch = "after"  # the replica restarted
                await replica.poll(client, 5.0)
                seen.append(replica.predict([PROMPT]).cached_len)
        return seen

    assert asyncio.run(run()) == [12, 12, 0, 12]


def test_the_router_polls_with_the_replicas_api_key():
    app = _fake_replica("ok", hit_step=12)
    open_events = next(r.endpoint for r in app.routes if getattr(r, "path", "") == "/v1/cache/events")
    app.router.routes = [r for r in app.routes if getattr(r, "path", "") != "/v1/cache/events"]

    @app.get("/v1/cache/events")
    async def keyed_events(request: Request, since: int | None = None):
        if request.headers.get("authorization") != "Bearer k":
            return JSONResponse({"error": {"message": "invalid or missing API key"}}, status_code=401)
        return await open_events(since)

    with serving_app(app) as replica:
        for key, up in ((None, False), ("k", True)):
            config = RouterConfig((replica,), poll_interval_s=30.0, api_key=key)
            with serving_app(build_router_app(config, tokenizer=None)) as router:
                headers = {"Authorization": f"Bearer {key}"} if key else {}
                health = httpx.get(f"{router}/health", headers=headers).json()
                assert [r["up"] for r in health["replicas"]] == [up], (key, health)


def _slow_replica(work_s: float, stream_pause_s: float = 0.0) -> FastAPI:
    """A replica whose completions take `work_s` seconds (watching for the client's disconnect, as `serve` does:
    `state.log` records "aborted" or "finished"); a stream sends one chunk, then nothing for `stream_pause_s`."""
    app = replica_app()
    app.state.log = []

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        app.state.log.append("start")
        if body.get("stream"):
            async def one_chunk_then_pause():
                yield b'data: {"choices": [{"index": 0, "text": "a"}]}\n\n'
                try:
                    await asyncio.sleep(stream_pause_s)
                except asyncio.CancelledError:
                    app.state.log.append("aborted")
                    raise
                yield b"data: [DONE]\n\n"
            return StreamingResponse(one_chunk_then_pause(), media_type="text/event-stream")
        deadline = asyncio.get_running_loop().time() + work_s
        while asyncio.get_running_loop().time() < deadline:
            if await request.is_disconnected():
                app.state.log.append("aborted")
                return JSONResponse({}, status_code=499)
            await asyncio.sleep(0.02)
        app.state.log.append("finished")
        return {"choices": [{"index": 0, "text": "ok"}]}

    return app


def test_a_client_gone_before_its_non_streamed_response_aborts_it_on_the_replica():
    """A client that gives up on a non-streamed request closes the router's request to the replica, which aborts
    it (the router kept waiting for the whole answer, so the engine ran all max_tokens for no one; found by a bug
    hunt); the replica's in-flight count drops once and it stays up."""
    slow = _slow_replica(work_s=5.0)
    with serving_app(slow) as replica, serving_app(_router([replica])) as router:
        with contextlib.suppress(httpx.ReadTimeout):
            httpx.post(f"{router}/v1/completions", json={"prompt": PROMPT, "max_tokens": 1000}, timeout=0.5)
        assert wait_until(lambda: "aborted" in slow.state.log, 3.0), slow.state.log
        assert slow.state.log == ["start", "aborted"]
        health = httpx.get(f"{router}/health").json()["replicas"][0]
        assert health["in_flight"] == 0 and health["up"]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_replica_slower_than_the_request_timeout_is_a_504_not_a_fault(stream):
    """Past the router's request_timeout_s, a replica that took the request is slow, not down: the client gets a
    504 naming it (a stream: a 504 error event and [DONE]), the request is closed (the replica aborts it) and not
    sent to another replica, and the replica stays up (it was marked down and the request run on every replica
    in turn, then a 503; found by a bug hunt)."""
    slow, other = _slow_replica(work_s=3.0, stream_pause_s=3.0), _slow_replica(work_s=0.0)
    with serving_app(slow) as first, serving_app(other) as second:
        config = RouterConfig((first, second), RoutingConfig("round-robin"), poll_interval_s=30.0,
                              request_timeout_s=0.5)
        with serving_app(build_router_app(config, tokenizer=None)) as router:
            body = {"prompt": PROMPT, "max_tokens": 100, "stream": stream}
            with httpx.stream("POST", f"{router}/v1/completions", json=body, timeout=30) as response:
                text = response.read().decode()
            if stream:
                assert response.status_code == 200 and text.endswith("data: [DONE]\n\n")
                error = json.loads(text.split("data: ")[-2])["error"]
            else:
                assert response.status_code == 504 and response.headers["x-should-retry"] == "false"
                error = json.loads(text)["error"]
            assert first in error["message"] and error["code"] == "replica_timeout"
            assert wait_until(lambda: "aborted" in slow.state.log, 3.0), slow.state.log
            assert (slow.state.log, other.state.log) == (["start", "aborted"], [])
            metrics = httpx.get(f"{router}/metrics").text
            assert _metric(metrics, "hybridcache_router_replica_up", first) == 1
            assert _metric(metrics, "hybridcache_router_retries_total") == 0
            assert _metric(metrics, "hybridcache_router_failed_total") == 1
            assert _metric(metrics, "hybridcache_router_in_flight", first) == 0


def test_no_request_timeout_by_default():
    """As a replica's `--request-timeout`, the router's default waits as long as the replica takes."""
    assert RouterConfig(("http://127.0.0.1:1",)).request_timeout_s is None
    with pytest.raises(ValueError, match="request_timeout_s must be > 0"):
        RouterConfig(("http://127.0.0.1:1",), request_timeout_s=0)


def test_models_and_stored_responses_do_not_wait_on_a_hung_replica():
    """A replica whose /v1/models and /v1/responses/{id} hang: /v1/models comes from the next replica and the
    stored response is a 504 naming the replica, both within the poll timeout (both waited with no limit)."""
    hung, other = replica_app(), replica_app()

    @hung.get("/v1/models")
    async def hung_models():
        await asyncio.sleep(3)

    @hung.get("/v1/responses/{stored_id}")
    async def hung_response(stored_id: str):
        await asyncio.sleep(3)

    @other.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "m", "object": "model"}]}

    with serving_app(hung) as first, serving_app(other) as second:
        config = RouterConfig((first, second), poll_interval_s=30.0, poll_timeout_s=0.5)
        with serving_app(build_router_app(config, tokenizer=None)) as router:
            start = time.monotonic()
            models = httpx.get(f"{router}/v1/models", timeout=30)
            assert models.status_code == 200 and models.json()["data"][0]["id"] == "m"
            stored = httpx.get(f"{router}/v1/responses/resp_x", timeout=30)
            assert stored.status_code == 504 and first in stored.json()["error"]["message"]
            assert time.monotonic() - start < 2.5


def test_a_continuation_on_a_busy_owner_gets_its_retry_after():
    """A `previous_response_id` turn whose replica is busy gets that replica's 503 and its Retry-After, as any
    request on a busy fleet does (it got the router's own 503 without Retry-After)."""
    app = replica_app()

    @app.get("/v1/responses/{stored_id}")
    async def stored(stored_id: str):
        return {"object": "response", "id": stored_id}

    @app.post("/v1/responses")
    async def responses():
        return JSONResponse({"error": {"message": "the server is busy"}}, status_code=503,
                            headers={"Retry-After": "7"})

    with serving_app(app) as url, serving_app(_router([url])) as router:
        body = {"model": "m", "input": "hi", "previous_response_id": "resp_1"}
        response = httpx.post(f"{router}/v1/responses", json=body, timeout=30)
        assert response.status_code == 503 and response.headers.get("retry-after") == "7"
        assert response.json()["error"]["message"] == "the server is busy"
