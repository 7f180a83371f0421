"""Anthropic's `/v1/messages` through the router: rendered as the chat request it runs as, so the predicted hit is
the replica's `cache_read_input_tokens`, streamed or not; the key as `x-api-key` (forwarded to the replica);
`count_tokens` passed through; the router's own errors and a cut stream's last event in Anthropic's shape."""

from __future__ import annotations

import json

import httpx

from hybridcache.models.builtin import builtin_model_dir, ensure_builtin_model
from hybridcache.router.app import RouterConfig, build_router_app, record_usage, stream_error, stream_usage
from hybridcache.router.replicas import ReplicaCounters
from hybridcache.tokenizer import Tokenizer
from tests.router.serving import serving_app
from tests.server.conftest import MODEL
from tests.server.inprocess_server import serving
from tests.server.server_process import metric_value

KEY = "sk-router"
SYSTEM = "You are a careful assistant who answers in one short line. " * 3


def _events(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


def test_messages_turns_hit_as_predicted():
    ensure_builtin_model()
    tokenizer = Tokenizer(builtin_model_dir())
    with serving(api_key=KEY) as replica:
        router_app = build_router_app(RouterConfig((replica,), api_key=KEY), tokenizer)
        with serving_app(router_app) as router:
            check_messages_turns(router)


def check_messages_turns(router: str, model: str = MODEL) -> None:
    """Three Messages turns through the router at `router` (its replicas keyed with KEY), the third streamed: each
    turn's `cache_read_input_tokens` is what the router predicted (its /metrics), count_tokens agrees with the
    usage, a keyless request is Anthropic's 401, bad bodies Anthropic's 400 naming the field (also the Ray Serve
    ingress's: tests/router/test_ray_serve.py)."""
    turns = [[{"role": "user", "content": "What is a recurrent state?"}]]
    turns.append(turns[0] + [{"role": "assistant", "content": [{"type": "text", "text": "A fixed-size summary."}]},
                             {"role": "user", "content": "And a checkpoint of it?"}])
    turns.append(turns[1] + [{"role": "assistant", "content": "A copy saved at one exact step."},
                             {"role": "user", "content": [{"type": "text", "text": "Why exact?"}]}])
    with httpx.Client(base_url=router, timeout=120, headers={"x-api-key": KEY}) as client:
        reported = []
        for k, messages in enumerate(turns):
            body = {"model": model, "system": SYSTEM, "messages": messages, "max_tokens": 3}
            if k == 2:  # streamed: the usage comes with message_delta
                response = client.post("/v1/messages", json=body | {"stream": True})
                assert "event: message_stop" in response.text
                usage = next(e["usage"] for e in reversed(_events(response.text)) if e.get("usage"))
            else:
                usage = client.post("/v1/messages", json=body).raise_for_status().json()["usage"]
            reported.append(usage["cache_read_input_tokens"])
            counted = client.post("/v1/messages/count_tokens", json={k: v for k, v in body.items()
                                                                     if k != "max_tokens"})
            assert counted.status_code == 200, counted.text
            prompt_tokens = usage["input_tokens"] + usage["cache_read_input_tokens"]
            assert counted.json()["input_tokens"] == prompt_tokens
        metrics = client.get("/metrics").text
        keyless = httpx.post(f"{router}/v1/messages", json=body, timeout=30)
        bad = client.post("/v1/messages", json=body | {"messages": []})
        bad_block = client.post("/v1/messages", json=body | {"messages": [
            {"role": "user", "content": [{"type": "document"}]}]})
        bad_result = client.post("/v1/messages", json=body | {"messages": [  # (a plain-text 500 before)
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "a", "content": ["a.txt"]}]}]})
        not_json = client.post("/v1/messages", content=b"{", headers={"content-type": "application/json"})
    assert reported[0] == 0 and reported[1] > 0 and reported[2] > reported[1]
    assert metric_value(metrics, "hybridcache_router_predicted_hit_tokens_total") == sum(reported)
    assert metric_value(metrics, "hybridcache_router_reported_hit_tokens_total") == sum(reported)
    assert keyless.status_code == 401 and keyless.json()["error"]["type"] == "authentication_error"
    assert "x-api-key" in keyless.json()["error"]["message"]
    for answer, field in ((bad, "messages"), (bad_block, "messages.0.content.0.type"),
                          (bad_result, "messages.0.content.0.content.0"), (not_json, "JSON")):
        assert answer.status_code == 400 and answer.json()["type"] == "error", answer.text
        assert field in answer.json()["error"]["message"]


def test_a_cut_messages_stream_ends_with_anthropics_error_event():
    event = stream_error({"error": {"message": "replica r failed mid-stream"}}, 502, anthropic=True)
    name, data = event.decode().strip().split("\n")
    assert name == "event: error"
    assert json.loads(data[6:]) == {"type": "error", "error": {"type": "api_error",
                                                               "message": "replica r failed mid-stream"}}
    assert stream_error({"error": {"message": "m"}}, 502, anthropic=False).endswith(b"data: [DONE]\n\n")


def test_anthropic_usage_counts_its_cache_reads():
    counters = ReplicaCounters()
    tail = (b'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":"end_turn"},'
            b'"usage":{"input_tokens":7,"cache_creation_input_tokens":0,"cache_read_input_tokens":32,'
            b'"output_tokens":3}}\n\n')
    record_usage("r", counters, stream_usage(tail), predicted=32)
    assert (counters.reported_hit_tokens, counters.predicted_hit_tokens, counters.prompt_tokens) == (32, 32, 39)
