"""Chat through the router to a real replica: the router renders the messages as the replica does, so its
predicted hit equals the `cached_tokens` the replica reports, streamed (with include_usage) or not."""

from __future__ import annotations

import json

import httpx

from hybridcache.models.builtin import builtin_model_dir, ensure_builtin_model
from hybridcache.router.app import RouterConfig, build_router_app
from hybridcache.tokenizer import Tokenizer
from tests.router.serving import serving_app
from tests.server.conftest import MODEL
from tests.server.inprocess_server import serving
from tests.server.server_process import metric_value


def test_chat_turns_hit_as_predicted():
    ensure_builtin_model()
    tokenizer = Tokenizer(builtin_model_dir())
    system = {"role": "system", "content": "You are a careful assistant who answers in one short line. " * 3}
    turns = [[system, {"role": "user", "content": "What is a recurrent state?"}]]
    turns.append(turns[0] + [{"role": "assistant", "content": "A fixed-size summary of the past."},
                             {"role": "user", "content": "And a checkpoint of it?"}])
    turns.append(turns[1] + [{"role": "assistant", "content": "A copy saved at one exact step."},
                             {"role": "user", "content": "Why exact?"}])
    with serving() as replica:
        router_app = build_router_app(RouterConfig((replica,)), tokenizer)
        with serving_app(router_app) as router, httpx.Client(base_url=router, timeout=120) as client:
            reported = []
            for k, messages in enumerate(turns):
                body = {"model": MODEL, "messages": messages, "max_tokens": 3}
                if k == 2:  # streamed: the usage comes with the last chunk
                    body |= {"stream": True, "stream_options": {"include_usage": True}}
                    with client.stream("POST", "/v1/chat/completions", json=body) as response:
                        events = [json.loads(line[6:]) for line in response.iter_lines()
                                  if line.startswith("data: {")]
                    usage = next(e["usage"] for e in reversed(events) if e.get("usage"))
                else:
                    usage = client.post("/v1/chat/completions", json=body).raise_for_status().json()["usage"]
                reported.append(usage["prompt_tokens_details"]["cached_tokens"])
                assert usage["prompt_tokens"] == len(tokenizer.encode(tokenizer.apply_chat_template(messages)))
            metrics = client.get("/metrics").text
            assert client.get("/health").json()["replicas"][0]["in_flight"] == 0
    assert reported[0] == 0 and reported[1] > 0 and reported[2] > reported[1]
    assert metric_value(metrics, "hybridcache_router_predicted_hit_tokens_total") == sum(reported)
    assert metric_value(metrics, "hybridcache_router_reported_hit_tokens_total") == sum(reported)


def test_invocations_through_the_router_hit_as_predicted():
    """SageMaker's /invocations was a 404 at the router: it is predicted as the chat or completion request its body
    is, and sent on as /invocations."""
    ensure_builtin_model()
    tokenizer = Tokenizer(builtin_model_dir())
    messages = [{"role": "system", "content": "You answer in one short line. " * 6},
                {"role": "user", "content": "What is a recurrent state?"}]
    with serving() as replica:
        router_app = build_router_app(RouterConfig((replica,)), tokenizer)
        with serving_app(router_app) as router, httpx.Client(base_url=router, timeout=120) as client:
            reported = []
            for body in ({"model": MODEL, "messages": messages, "max_tokens": 2},
                         {"model": MODEL, "messages": messages, "max_tokens": 2},
                         {"model": MODEL, "prompt": "A recurrent state is " * 12, "max_tokens": 2},
                         {"model": MODEL, "prompt": "A recurrent state is " * 12, "max_tokens": 2}):
                answer = client.post("/invocations", json=body)
                assert answer.status_code == 200, answer.text
                assert answer.json()["object"] == ("chat.completion" if "messages" in body else "text_completion")
                reported.append(answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
            neither = client.post("/invocations", json={"model": MODEL, "input": "hi"})
            metrics = client.get("/metrics").text
    assert reported[1] > 0 and reported[3] > 0
    assert metric_value(metrics, "hybridcache_router_predicted_hit_tokens_total") == sum(reported)
    assert neither.status_code == 400 and "messages" in neither.json()["error"]["message"]
