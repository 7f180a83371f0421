"""/v1/responses under the server's limits, and bodies that used to answer 500: a full waiting queue is a 503
with Retry-After and a request past --request-timeout is a 503 (or a final error event), as for chat
completions; malformed `text.format`, reasoning items and `tool_choice` are 400s naming the field. In process,
over an engine loop stand-in (no model runs)."""

from __future__ import annotations

import asyncio
import json

import pytest
from fastapi.testclient import TestClient

from hybridcache.server.app import ServedModel, build_app
from hybridcache.server.config import ServerConfig
from hybridcache.server.errors import APIError
from hybridcache.server.limits import QueueFull, ServerLimits
from hybridcache.server.protocol import ChatCompletionRequest, parse_request
from hybridcache.server.responses_api import input_messages, response_format

TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


class StandInLoop:
    """An engine loop that refuses every request with QueueFull (`full`), or takes it and never answers."""

    running = healthy = True
    last_error = None
    state = None

    def __init__(self, full: bool) -> None:
        self.full = full
        self.aborted: list[str] = []

    async def add(self, request_id, prompt, params, mm_inputs=(), checkpoints_at=()) -> asyncio.Queue:
        return (await self.add_many([request_id], [prompt], params, [mm_inputs], [checkpoints_at]))[0]

    async def add_many(self, request_ids, prompts, params, mm_inputs=None, checkpoints_at=None):
        if self.full:
            raise QueueFull("the server is busy (--max-queued-requests)")
        return [asyncio.Queue() for _ in request_ids]

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def _client(tokenizer, loop: StandInLoop, **limits) -> TestClient:
    config = ServerConfig(limits=ServerLimits(**limits))
    return TestClient(build_app(loop, ServedModel(tokenizer=tokenizer, max_model_len=4096), config, metrics=None))


def test_a_full_queue_is_a_503_with_retry_after(tokenizer):
    client = _client(tokenizer, StandInLoop(full=True))
    for path, body in (("/v1/responses", {"input": "hi"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        response = client.post(path, json=body)
        assert response.status_code == 503, (path, response.text)
        assert response.json()["error"]["code"] == "queue_full" and response.headers["retry-after"] == "1"


def test_a_response_past_the_request_timeout_is_a_503_and_aborted(tokenizer):
    loop = StandInLoop(full=False)
    client = _client(tokenizer, loop, request_timeout_s=0.2)
    response = client.post("/v1/responses", json={"input": "hi"})
    assert response.status_code == 503 and response.json()["error"]["code"] == "request_timeout", response.text
    assert len(loop.aborted) == 1
    with client.stream("POST", "/v1/responses", json={"input": "hi", "stream": True}) as streamed:
        events = [json.loads(line[6:]) for line in streamed.iter_lines() if line.startswith("data: ")]
    assert events[-1]["type"] == "error" and events[-1]["code"] == "request_timeout"


@pytest.mark.parametrize("body, param", [
    ({"input": "x", "text": {"format": "json_object"}}, "text.format"),
    ({"input": "x", "text": {"format": 5}}, "text.format"),
    ({"input": [{"type": "reasoning", "content": [{"type": "reasoning_text", "text": None}]},
               {"role": "user", "content": "x"}]},
     "input.0.content.0.text"),
    ({"input": [{"type": "reasoning", "content": [{"type": "reasoning_text", "text": 5}]}]}, "input.0.content.0.text"),
    ({"input": [{"type": "reasoning", "content": "thought"}]}, "input.0.content"),
    ({"input": [{"type": "reasoning", "summary": ["thought"]}]}, "input.0.summary.0.text"),
])
def test_malformed_responses_bodies_are_400s_naming_the_field(tokenizer, body, param):
    response = _client(tokenizer, StandInLoop(full=False)).post("/v1/responses", json=body)
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


def test_reasoning_items_still_join_the_next_assistant_message():
    items = [{"type": "reasoning", "summary": [{"type": "summary_text", "text": "a"}]},
             {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "b"}]},
             {"role": "assistant", "content": "c"}]
    assert input_messages(items) == [{"role": "assistant", "content": "c", "reasoning_content": "ab"}]
    assert response_format({"format": {"type": "json_object"}}) == {"type": "json_object"}


@pytest.mark.parametrize("tool_choice", [{"type": "function", "function": "get_time"},
                                         {"type": "function", "function": {"name": 5}},
                                         {"type": "function"}])
def test_a_malformed_named_tool_choice_is_a_400(tool_choice):
    body = parse_request(ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "tools": [TIME],
                                                 "tool_choice": tool_choice})
    with pytest.raises(APIError) as info:
        body.guided()
    assert info.value.status == 400 and info.value.param == "tool_choice"
