"""`/v1/responses` through the router. Two real replicas (the built-in model) behind a round-robin router: a turn
with `previous_response_id` goes to the replica that stored the response it continues (the other one has no such
response: 404), streamed or not, and a router that never saw the id finds its replica by asking; behind the
checkpoint router a Responses prompt is predicted as its chat rendering (predicted = reported hits). Fake replicas:
the replica holding a response that is down, or fails before its first byte, is a clear 503 and the request is
sent nowhere else; the stream head and id map."""

from __future__ import annotations

import json

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from hybridcache.models.builtin import builtin_model_dir, ensure_builtin_model
from hybridcache.router.app import RouterConfig, build_router_app
from hybridcache.router.policy import RoutingConfig
from hybridcache.router.responses import ResponseOwners, StreamHead, response_id
from hybridcache.tokenizer import Tokenizer
from tests.router.serving import replica_app, serving_app
from tests.server.conftest import MODEL
from tests.server.inprocess_server import serving
from tests.server.server_process import metric_value

INSTRUCTIONS = "You are a careful assistant who answers in one short line. " * 4


def _turn(client: httpx.Client, text: str, previous: str | None = None, stream: bool = False) -> dict:
    body = {"model": MODEL, "input": text, "instructions": INSTRUCTIONS, "max_output_tokens": 3, "temperature": 0}
    if previous is not None:
        body["previous_response_id"] = previous
    if not stream:
        response = client.post("/v1/responses", json=body)
        assert response.status_code == 200, response.text
        return response.json()
    with client.stream("POST", "/v1/responses", json=body | {"stream": True}) as response:
        assert response.status_code == 200
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    return next(e["response"] for e in events if e.get("type") == "response.completed")


def _holder(replicas: tuple[str, ...], stored_id: str) -> int:
    """The index of the replica that stores `stored_id` (asked directly; exactly one must)."""
    found = [i for i, url in enumerate(replicas) if httpx.get(f"{url}/v1/responses/{stored_id}").status_code == 200]
    assert len(found) == 1, found
    return found[0]


def test_a_continued_response_goes_to_the_replica_that_stored_it():
    ensure_builtin_model()
    tokenizer = Tokenizer(builtin_model_dir())
    with serving() as first, serving() as second:
        replicas = (first, second)
        round_robin = build_router_app(RouterConfig(replicas, RoutingConfig("round-robin")), tokenizer)
        with serving_app(round_robin) as router, httpx.Client(base_url=router, timeout=120) as client:
            ids = [_turn(client, "What is a recurrent state?")["id"]]
            owner = _holder(replicas, ids[0])
            # round-robin alone would send each next turn to the other replica, which would answer 404
            turn = _turn(client, "And a checkpoint of it?", ids[-1])
            assert turn["usage"]["input_tokens_details"]["cached_tokens"] > 0  # it hit the stored conversation
            ids.append(turn["id"])
            ids.append(_turn(client, "Why exact?", ids[-1], stream=True)["id"])  # its id read from the stream
            ids.append(_turn(client, "Thanks.", ids[-1])["id"])
            assert [_holder(replicas, i) for i in ids] == [owner] * 4
            got = client.get(f"/v1/responses/{ids[2]}")
            assert got.status_code == 200 and got.json()["id"] == ids[2]
            unknown = client.post("/v1/responses", json={"model": MODEL, "input": "hi", "max_output_tokens": 1,
                                                         "previous_response_id": "resp_nowhere"})
            assert unknown.status_code == 404 and "resp_nowhere" in unknown.json()["error"]["message"]
            assert client.get("/v1/responses/resp_nowhere").status_code == 404
        fresh = build_router_app(RouterConfig(replicas, RoutingConfig("round-robin")), tokenizer)
        with serving_app(fresh) as router, httpx.Client(base_url=router, timeout=120) as client:
            # this router never saw the ids: it asks the replicas which one holds it, for both turns
            for _ in range(2):
                ids.append(_turn(client, "Once more.", ids[-1])["id"])
            assert [_holder(replicas, i) for i in ids[-2:]] == [owner] * 2
        checkpoint = build_router_app(RouterConfig(replicas), tokenizer)
        with serving_app(checkpoint) as router, httpx.Client(base_url=router, timeout=120) as client:
            hits = [_turn(client, "A fresh question.")["usage"]["input_tokens_details"]["cached_tokens"]
                    for _ in range(2)]
            metrics = client.get("/metrics").text
    assert hits[1] > 0  # the second is routed to where the first saved its prompt's state
    assert metric_value(metrics, "hybridcache_router_predicted_hit_tokens_total") == sum(hits)
    assert metric_value(metrics, "hybridcache_router_reported_hit_tokens_total") == sum(hits)


def _fake_replica(name: str, stored: set[str], fail: bool = False) -> FastAPI:
    """A replica with an empty cache that stores `stored` responses and answers a Responses request with a new
    response (`fail`: 503 before its first byte)."""
    app = replica_app(epoch=name)
    app.state.calls = []

    @app.get("/v1/responses/{stored_id}")
    async def retrieve(stored_id: str):
        if stored_id in stored:
            return {"object": "response", "id": stored_id}
        return JSONResponse({"error": {"message": f"no stored response has the id {stored_id!r}"}}, status_code=404)

    @app.post("/v1/responses")
    async def create(body: dict):
        app.state.calls.append(body.get("previous_response_id"))
        if fail:
            return JSONResponse({"error": {"message": "engine dead"}}, status_code=503)
        stored.add(f"resp_{name}{len(stored)}")
        return {"object": "response", "id": f"resp_{name}{len(stored) - 1}", "output": [],
                "usage": {"input_tokens": 5, "output_tokens": 1, "input_tokens_details": {"cached_tokens": 0}}}

    return app


def test_the_replica_holding_a_response_failing_or_down_is_a_clear_503_and_nothing_goes_elsewhere():
    a, b = _fake_replica("a", {"resp_x"}, fail=True), _fake_replica("b", set())
    with serving_app(a) as url_a, serving_app(b) as url_b:
        app = build_router_app(RouterConfig((url_a, url_b), poll_interval_s=30.0), tokenizer=None)
        with serving_app(app) as router, httpx.Client(base_url=router, timeout=30) as client:
            body = {"model": "m", "input": "hi", "previous_response_id": "resp_x"}
            answer = client.post("/v1/responses", json=body)
            assert answer.status_code == 503
            message = answer.json()["error"]["message"]
            assert "resp_x" in message and url_a in message and "503" in message
            assert a.state.calls == ["resp_x"] and b.state.calls == []  # tried once, on its replica only
            again = client.post("/v1/responses", json=body)  # a is marked down now
            assert again.status_code == 503 and "down" in again.json()["error"]["message"]
            assert a.state.calls == ["resp_x"] and b.state.calls == []
            got = client.get("/v1/responses/resp_x")
            assert got.status_code == 503 and url_a in got.json()["error"]["message"]
            health = client.get("/health").json()
    assert [r["up"] for r in health["replicas"]] == [False, True]


def test_the_stream_head_gives_the_id_once_its_first_event_is_whole():
    created = {"type": "response.created", "response": {"id": "resp_1", "object": "response"}, "sequence_number": 0}
    stream = (b"event: response.created\r\ndata: " + json.dumps(created).encode() + b"\r\n\r\n"
              b"event: response.in_progress\r\ndata: {\"response\": {\"id\": \"resp_1\"}}\r\n\r\n")
    head = StreamHead()
    found = [head.feed(stream[i:i + 7]) for i in range(0, len(stream), 7)]
    assert [f for f in found if f is not None] == ["resp_1"]
    assert found.index("resp_1") == (stream.index(b"\r\n\r\n") + 4 - 1) // 7  # as soon as the event is whole
    assert StreamHead().feed(b"data: {\"choices\": []}\n\n" + b"x" * (1 << 17)) is None
    assert response_id(b'{"object": "response", "id": "resp_2"}') == "resp_2"
    assert response_id(b'{"object": "chat.completion", "id": "chatcmpl-1"}') is None
    assert response_id(b"not json") is None


def test_the_id_map_keeps_the_newest():
    owners = ResponseOwners(capacity=2)
    for i in range(3):
        owners.put(f"resp_{i}", f"replica{i}")
    owners.put("resp_1", "replica1")
    assert (len(owners), owners.get("resp_0"), owners.get("resp_1"), owners.get("resp_2")) == \
        (2, None, "replica1", "replica2")
    with pytest.raises(ValueError, match="capacity"):
        ResponseOwners(0)
