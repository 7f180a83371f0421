"""`/v1/messages` and `/v1/messages/count_tokens` (Anthropic's Messages API) through the `anthropic` SDK and raw
HTTP: text whole and streamed (the chat route's answer, Anthropic's events), a tool call and its result sent back,
stop_sequences, max_tokens, system prompts, prefill, the prefix cache's hit as `cache_read_input_tokens`, token
counts, `x-api-key` and Bearer keys, and 400s in Anthropic's error shape that leave the engine intact."""

from __future__ import annotations

import base64
import io
import json
import re
import time

import httpx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridcache.models.builtin import BUILTIN_NAME
from hybridcache.server.anthropic_protocol import anthropic_error_body, messages_param

from .inprocess_server import serving

anthropic = pytest.importorskip("anthropic")

MODEL = BUILTIN_NAME
KEY = "sk-anthropic-test"
KEYED = {"x-api-key": KEY}
BEARER = {"Authorization": f"Bearer {KEY}"}
WEATHER = {"name": "get_weather", "description": "current weather",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                            "required": ["city"], "additionalProperties": False}}
QUESTION = "What is the weather in Paris?"
# ignore_eos: this server's extension, as in a chat request (the SDK sends both, and temperature, in extra_body:
# its newest releases dropped temperature, top_p and top_k from their signatures)
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server():
    with serving(reasoning_parser="qwen3", enable_debug_endpoints=True, api_key=KEY) as base_url:
        yield base_url, anthropic.Anthropic(base_url=base_url, api_key=KEY, max_retries=0, timeout=120)


def post(base_url: str, path: str, body: dict, headers: dict | None = None) -> httpx.Response:
    return httpx.post(f"{base_url}{path}", json=body, headers=KEYED if headers is None else headers, timeout=120)


def chat(base_url: str, messages: list[dict], **fields) -> dict:
    response = post(base_url, "/v1/chat/completions", {"model": MODEL, "messages": messages, **fields}, BEARER)
    assert response.status_code == 200, response.text
    return response.json()


def events_of(response: httpx.Response) -> list[tuple[str, dict]]:
    """(event name, data) of each server-sent event; every event's `event:` line names its data's type."""
    events = []
    for block in response.text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines())
        data = json.loads(lines["data"])
        assert lines["event"] == data["type"]
        events.append((lines["event"], data))
    return events


def assert_engine_intact(base_url: str) -> None:
    assert httpx.get(f"{base_url}/health", timeout=10).status_code == 200
    deadline = time.monotonic() + 30
    while True:  # the check needs an idle engine: aborted requests may still be winding down
        check = httpx.get(f"{base_url}/debug/engine", headers=KEYED, timeout=30)
        if check.status_code != 409 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert check.status_code == 200 and check.json()["integrity"] == "ok", check.text


def test_text_message_is_the_chat_routes_answer(server):
    base_url, client = server
    message = client.messages.create(model=MODEL, max_tokens=8, system="Be brief.",
                                     messages=[{"role": "user", "content": QUESTION}], extra_body={"temperature": 0})
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    answer = chat(base_url, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}],
                  max_tokens=8, temperature=0)
    choice, chat_usage = answer["choices"][0], answer["usage"]
    assert "".join(b.text for b in message.content if b.type == "text") == (choice["message"]["content"] or "")
    assert "".join(b.thinking for b in message.content if b.type == "thinking") == \
        (choice["message"]["reasoning"] or "")
    usage = message.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == chat_usage["prompt_tokens"]
    assert usage.cache_creation_input_tokens == 0
    assert usage.output_tokens == chat_usage["completion_tokens"]
    assert message.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[choice["finish_reason"]]
    assert message.stop_sequence is None


def test_streamed_events_build_the_same_message(server):
    base_url, client = server
    request = {"model": MODEL, "max_tokens": 10, "messages": [{"role": "user", "content": QUESTION}], **GREEDY}
    whole = post(base_url, "/v1/messages", request).json()
    streamed = post(base_url, "/v1/messages", {**request, "stream": True})
    assert streamed.status_code == 200 and streamed.headers["content-type"].startswith("text/event-stream")
    events = events_of(streamed)
    kinds = [kind for kind, _ in events]
    assert kinds[:2] == ["message_start", "ping"] and kinds[-2:] == ["message_delta", "message_stop"]
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["output_tokens"] == 0
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == len(whole["content"])
    text = "".join(d["delta"]["text"] for k, d in events if k == "content_block_delta"
                   and d["delta"]["type"] == "text_delta")
    assert text == "".join(b["text"] for b in whole["content"] if b["type"] == "text")
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None} == \
        {k: whole[k] for k in ("stop_reason", "stop_sequence")}
    assert delta["usage"]["output_tokens"] == whole["usage"]["output_tokens"] == 10
    # the SDK's stream helper rebuilds the message from the events
    with client.messages.stream(model=MODEL, max_tokens=10, messages=request["messages"], extra_body=GREEDY) as stream:
        streamed_text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed_text == text
    assert [b.model_dump(exclude={"signature"}, exclude_none=True) for b in final.content] == \
        [{k: v for k, v in b.items() if k != "signature"} for b in whole["content"]]
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 10


def test_tool_use_then_its_result(server, tokenizer):
    base_url, client = server
    messages = [{"role": "user", "content": QUESTION}]
    forced = {"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "get_weather"},
              "extra_body": {"temperature": 0}}
    first = client.messages.create(model=MODEL, max_tokens=150, messages=messages, **forced)
    calls = [b for b in first.content if b.type == "tool_use"]
    assert len(calls) == 1 and calls[0].name == "get_weather", first.content
    assert isinstance(calls[0].input["city"], str)
    assert first.stop_reason == "tool_use"
    with client.messages.stream(model=MODEL, max_tokens=150, messages=messages, **forced) as stream:
        streamed = stream.get_final_message()
    assert [(b.name, b.input) for b in streamed.content if b.type == "tool_use"] == [(calls[0].name, calls[0].input)]
    assert streamed.stop_reason == "tool_use"
    # the assistant turn sent back as the SDK returned it, then the tool's result
    turn2 = [*messages, {"role": "assistant", "content": [b.model_dump() for b in first.content]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": calls[0].id,
                                           "content": "sunny, 21 C"}]}]
    second = client.messages.create(model=MODEL, max_tokens=6, tools=[WEATHER], messages=turn2,
                                    extra_body={"temperature": 0})
    assert second.stop_reason in ("end_turn", "max_tokens", "tool_use")
    prompt_tokens = second.usage.input_tokens + second.usage.cache_read_input_tokens
    assert second.usage.cache_read_input_tokens >= first.usage.input_tokens - 64  # the earlier turn, from the cache
    reasoning = "".join(b.thinking for b in first.content if b.type == "thinking")
    chat_messages = [{"role": "user", "content": QUESTION},
                     {"role": "assistant", "content": "", "tool_calls": [
                         {"id": calls[0].id, "type": "function",
                          "function": {"name": "get_weather", "arguments": calls[0].input}}],
                      **({"reasoning_content": reasoning} if reasoning else {})},
                     {"role": "tool", "tool_call_id": calls[0].id, "content": "sunny, 21 C"}]
    tools = [{"type": "function", "function": {"name": WEATHER["name"], "description": WEATHER["description"],
                                                "parameters": WEATHER["input_schema"]}}]
    assert prompt_tokens == len(tokenizer.encode(tokenizer.apply_chat_template(chat_messages, tools=tools)))
    assert client.messages.count_tokens(model=MODEL, tools=[WEATHER], messages=turn2).input_tokens == prompt_tokens


def test_stop_sequences_and_max_tokens(server):
    base_url, _ = server
    request = {"model": MODEL, "max_tokens": 12, "messages": [{"role": "user", "content": QUESTION}], **GREEDY}
    plain = post(base_url, "/v1/messages", request).json()
    text = plain["content"][0]["text"]
    assert plain["stop_reason"] == "max_tokens" and plain["usage"]["output_tokens"] == 12
    stop = text[3:5]
    cut = post(base_url, "/v1/messages", {**request, "stop_sequences": ["never-said", stop]}).json()
    assert cut["stop_reason"] == "stop_sequence" and cut["stop_sequence"] == stop
    assert "".join(b["text"] for b in cut["content"] if b["type"] == "text") == text[:text.index(stop)]
    streamed = events_of(post(base_url, "/v1/messages", {**request, "stop_sequences": [stop], "stream": True}))
    assert streamed[-2][1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": stop}
    short = post(base_url, "/v1/messages", {**request, "max_tokens": 3}).json()
    assert short["stop_reason"] == "max_tokens" and short["usage"]["output_tokens"] == 3


def test_end_turn_when_the_output_format_ends_the_reply(server):
    base_url, _ = server
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    message = post(base_url, "/v1/messages", {
        "model": MODEL, "max_tokens": 200, "temperature": 0, "messages": [{"role": "user", "content": "ok?"}],
        "output_config": {"format": {"type": "json_schema", "schema": schema}}}).json()
    assert message["stop_reason"] == "end_turn", message
    text = "".join(b["text"] for b in message["content"] if b["type"] == "text")
    assert isinstance(json.loads(text)["ok"], bool)


def test_system_as_a_string_or_as_blocks(server):
    base_url, _ = server
    user = [{"role": "user", "content": "Hello"}]

    def counted(**fields) -> int:
        response = post(base_url, "/v1/messages/count_tokens", {"model": MODEL, "messages": user, **fields})
        assert response.status_code == 200, response.text
        return response.json()["input_tokens"]

    as_string = counted(system="You answer in French.")
    assert as_string == counted(system=[{"type": "text", "text": "You answer in French.",
                                         "cache_control": {"type": "ephemeral"}}])
    # Claude Code's per-request billing header is dropped, as vLLM drops it: it would end every shared prefix
    billed = [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1; cch=1a2b3c;"},
              {"type": "text", "text": "You answer in French."}]
    assert counted(system=billed) == as_string
    assert counted(messages=[{"role": "system", "content": "You answer in French."}, *user]) == as_string
    tokenized = post(base_url, "/tokenize", {"messages": [{"role": "system", "content": "You answer in French."},
                                                          *user]}).json()
    assert as_string == tokenized["count"] > counted()
    message = post(base_url, "/v1/messages", {"model": MODEL, "max_tokens": 2, "system": billed, "messages": user})
    usage = message.json()["usage"]
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] == as_string


def test_prefill_continues_the_last_assistant_message(server):
    base_url, _ = server
    messages = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": "The weather is"}]
    message = post(base_url, "/v1/messages", {"model": MODEL, "max_tokens": 6, "messages": messages, **GREEDY}).json()
    answer = chat(base_url, messages, max_tokens=6, add_generation_prompt=False, continue_final_message=True,
                  **GREEDY)
    assert "".join(b["text"] for b in message["content"] if b["type"] == "text") == \
        (answer["choices"][0]["message"]["content"] or "")
    count = post(base_url, "/v1/messages/count_tokens", {"model": MODEL, "messages": messages}).json()
    assert count["input_tokens"] == answer["usage"]["prompt_tokens"]


def test_reasoning_is_a_thinking_block_whole_and_streamed(server):
    """With a reasoning parser, what the model writes in its think block is a thinking block (here the prefill opens
    the block): whole, as thinking_delta events and a signature_delta, and through the SDK's stream helper."""
    base_url, client = server
    messages = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": "<think>\nPlanning"}]
    request = {"model": MODEL, "max_tokens": 8, "messages": messages, **GREEDY}
    whole = post(base_url, "/v1/messages", request).json()
    (block,) = whole["content"]
    answer = chat(base_url, messages, max_tokens=8, add_generation_prompt=False, continue_final_message=True,
                  **GREEDY)
    assert block["type"] == "thinking" and block["thinking"] == answer["choices"][0]["message"]["reasoning"]
    assert isinstance(block["signature"], str)
    events = events_of(post(base_url, "/v1/messages", {**request, "stream": True}))
    deltas = [d["delta"] for k, d in events if k == "content_block_delta"]
    assert "".join(d.get("thinking", "") for d in deltas) == block["thinking"]
    assert deltas[-1]["type"] == "signature_delta"
    assert [d["content_block"] for k, d in events if k == "content_block_start"] == \
        [{"type": "thinking", "thinking": "", "signature": ""}]
    with client.messages.stream(model=MODEL, max_tokens=8, messages=messages, extra_body=GREEDY) as stream:
        final = stream.get_final_message()
    assert [(b.type, b.thinking) for b in final.content] == [("thinking", block["thinking"])]
    # the thinking block sent back (signature and all) renders as the turn's reasoning
    turn2 = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": [block, {
        "type": "text", "text": "Sunny."}]}, {"role": "user", "content": "Thanks"}]
    counted = post(base_url, "/v1/messages/count_tokens", {"model": MODEL, "messages": turn2}).json()
    tokenized = post(base_url, "/tokenize", {"messages": [turn2[0], {
        "role": "assistant", "content": "Sunny.", "reasoning_content": block["thinking"]}, turn2[2]]}).json()
    assert counted["input_tokens"] == tokenized["count"]


def test_cache_read_is_the_chat_routes_cached_tokens(server):
    base_url, client = server
    messages = [{"role": "user", "content": "Summarize this. " + "The quick brown fox jumps over the dog. " * 40}]
    cold = client.messages.create(model=MODEL, max_tokens=2, messages=messages)
    warm = client.messages.create(model=MODEL, max_tokens=2, messages=messages)
    assert warm.usage.cache_read_input_tokens > 0
    assert warm.usage.cache_read_input_tokens + warm.usage.input_tokens == \
        cold.usage.cache_read_input_tokens + cold.usage.input_tokens
    cached = chat(base_url, messages, max_tokens=2)["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert warm.usage.cache_read_input_tokens == cached
    streamed = events_of(post(base_url, "/v1/messages", {"model": MODEL, "max_tokens": 2, "messages": messages,
                                                         "stream": True}))
    assert streamed[0][1]["message"]["usage"]["cache_read_input_tokens"] == cached
    assert streamed[-2][1]["usage"]["cache_read_input_tokens"] == cached


def test_count_tokens_is_the_rendered_prompt(server, tokenizer):
    base_url, client = server
    messages = [{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]},
                {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": QUESTION}]
    counted = client.messages.count_tokens(model=MODEL, system="Be brief.", messages=messages, tools=[WEATHER])
    message = client.messages.create(model=MODEL, max_tokens=2, system="Be brief.", messages=messages,
                                     tools=[WEATHER])
    assert counted.input_tokens == message.usage.input_tokens + message.usage.cache_read_input_tokens
    tokenized = post(base_url, "/tokenize", {"messages": [{"role": "system", "content": "Be brief."}, {
        "role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]},
        *messages[1:]], "tools": [{"type": "function", "function": {
            "name": "get_weather", "description": "current weather", "parameters": WEATHER["input_schema"]}}]})
    assert counted.input_tokens == tokenized.json()["count"]


def test_api_key_as_x_api_key_or_bearer(server):
    base_url, _ = server
    body = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        for headers in ({}, {"x-api-key": "wrong"}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            refused = post(base_url, path, body, headers)
            assert refused.status_code == 401, (path, headers)
            assert refused.json() == {"type": "error", "error": {"type": "authentication_error",
                                                                 "message": refused.json()["error"]["message"]}}
            assert "x-api-key" in refused.json()["error"]["message"]
        for headers in (KEYED, BEARER, {"x-api-key": KEY, "Authorization": "Bearer wrong"}):
            assert post(base_url, path, body, headers).status_code == 200, (path, headers)
    # the key in x-api-key opens the OpenAI routes too
    chat_body = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    assert post(base_url, "/v1/chat/completions", chat_body, KEYED).status_code == 200
    assert post(base_url, "/v1/chat/completions", chat_body, {"x-api-key": "wrong"}).status_code == 401
    bearer_client = anthropic.Anthropic(base_url=base_url, auth_token=KEY, max_retries=0, timeout=120)
    assert bearer_client.messages.count_tokens(model=MODEL, messages=body["messages"]).input_tokens > 0
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=base_url, api_key="wrong", max_retries=0).messages.create(**body)


def test_the_sdks_typed_errors(server):
    _, client = server
    with pytest.raises(anthropic.BadRequestError) as error:
        client.messages.create(model=MODEL, max_tokens=4, messages=[])
    assert error.value.body["error"]["type"] == "invalid_request_error" and "messages" in error.value.message
    with pytest.raises(anthropic.NotFoundError) as error:
        client.messages.create(model="claude-sonnet-4-5", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert error.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as error:
        client.messages.count_tokens(model=MODEL, messages=[{"role": "robot", "content": "hi"}])
    assert "messages.0.role" in error.value.message


def _png_base64() -> str:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(np.zeros((8, 8, 3), dtype=np.uint8)).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


@pytest.mark.parametrize("arguments, wanted", [("null", {}), ("[]", {"arguments": []}), ("3", {"arguments": 3}),
                                               ("{}", {})])
def test_a_tool_use_input_is_always_an_object_the_next_turn_takes_back(server, arguments, wanted):
    """A tool call whose arguments are null or not an object (a model calling a tool without parameters) became a
    tool_use block with input None or [] (Anthropic's type is an object); sent back as the SDK returned it, every
    later turn of the conversation was a 400."""
    base_url, client = server
    tool = {"name": "get_time", "description": "current time", "input_schema": {"type": "object", "properties": {}}}
    out = '<tool_call>\n{"name": "get_time", "arguments": ' + arguments + '}\n</tool_call>'
    forced = {"structured_outputs": {"regex": re.escape(out)}, "temperature": 0}
    history = [{"role": "user", "content": "what time is it?"}]
    first = client.messages.create(model=MODEL, max_tokens=100, messages=history, tools=[tool], extra_body=forced)
    (call,) = [b for b in first.content if b.type == "tool_use"]
    assert call.input == wanted and first.stop_reason == "tool_use"
    with client.messages.stream(model=MODEL, max_tokens=100, messages=history, tools=[tool],
                                extra_body=forced) as stream:
        assert [b.input for b in stream.get_final_message().content if b.type == "tool_use"] == [wanted]
    history += [{"role": "assistant", "content": [b.model_dump() for b in first.content]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "12:00"}]}]
    assert client.messages.create(model=MODEL, max_tokens=2, messages=history, tools=[tool]).content is not None
    history[1]["content"] = [{**b, "input": None} if b["type"] == "tool_use" else b for b in history[1]["content"]]
    assert client.messages.count_tokens(model=MODEL, messages=history, tools=[tool]).input_tokens > 0  # null: {}


def test_output_config_effort_takes_anthropics_levels(server):
    """`max` (Anthropic's and vLLM's highest level) was a 400: the chat route's levels stop at xhigh."""
    _, client = server
    for effort in ("low", "medium", "high", "xhigh", "max"):
        reply = client.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "hi"}],
                                       extra_body={"output_config": {"effort": effort}})
        assert reply.usage.output_tokens == 2


LONG = "word " * 6000
MISSING = object()
BOTH, MESSAGES_ONLY = ("/v1/messages", "/v1/messages/count_tokens"), ("/v1/messages",)


@pytest.mark.parametrize("body, status, field, paths", [
    ({"max_tokens": MISSING}, 400, "max_tokens", MESSAGES_ONLY),
    ({"max_tokens": 0}, 400, "max_tokens", MESSAGES_ONLY),
    ({"max_tokens": 10**6}, 400, "max_tokens", MESSAGES_ONLY),
    ({"model": MISSING}, 400, "model", BOTH),
    ({"messages": []}, 400, "messages", BOTH),
    ({"messages": [{"role": "tool", "content": "hi"}]}, 400, "messages.0.role", BOTH),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, 400,
     "messages.0.content.0.type", BOTH),
    ({"messages": [{"role": "user", "content": [{"text": "no type"}]}]}, 400, "messages.0.content.0.type", BOTH),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, 400, "messages.0.content.0.text",
     BOTH),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "f", "input": {}}]}]}, 400,
     "messages.0.content.0.type", BOTH),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "content": "x"}]}]}, 400,
     "messages.0.content.0.tool_use_id", BOTH),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "a"}]}]}, 400,
     "messages.0.content.0.type", BOTH),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "a", "content": ["a.txt"]}]}]},
     400, "messages.0.content.0.content.0", BOTH),  # (a 500 before: a plain string where a block goes)
    ({"output_config": {"effort": "extreme"}}, 400, "output_config.effort", MESSAGES_ONLY),
    ({"tool_choice": {"type": "any"}}, 400, "tool_choice of type 'any' needs tools", BOTH),  # (said "required")
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": _png_base64()}}]}]}, 400, "messages.0.content.0.type",
     BOTH),
    ({"messages": [{"role": "user", "content": LONG}]}, 400, "messages", MESSAGES_ONLY),
    ({"tools": [{"name": "f"}]}, 400, "tools.0.input_schema", BOTH),
    ({"tools": [{"name": "f", "input_schema": ["not", "an", "object"]}]}, 400, "tools.0.input_schema", BOTH),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400, "tools.0.type", BOTH),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool"}}, 400, "tool_choice.name", BOTH),
    ({"tools": [WEATHER], "tool_choice": {"type": "sometimes"}}, 400, "tool_choice.type", BOTH),
    ({"tools": [{"name": "f", "input_schema": {"type": "object", "properties": {"a": {"type": "strin"}}}}],
      "tool_choice": {"type": "any"}}, 400, "tool_choice", MESSAGES_ONLY),
    ({"stop_sequences": "END"}, 400, "stop_sequences", MESSAGES_ONLY),
    ({"temperature": "hot"}, 400, "temperature", MESSAGES_ONLY),
    ({"top_k": -5}, 400, "top_k", MESSAGES_ONLY),
    ({"output_config": {"format": {"type": "json_schema", "schema": "x"}}}, 400, "output_config.format", BOTH),
    ({"model": "claude-sonnet-4-5"}, 404, "model", BOTH),
])
def test_bad_requests_are_anthropic_errors_naming_the_field(server, body, status, field, paths):
    base_url, _ = server
    request = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], **body}
    request = {k: v for k, v in request.items() if v is not MISSING}
    for path in paths:
        response = post(base_url, path, request)
        assert response.status_code == status, (path, response.text)
        error = response.json()
        assert error["type"] == "error" and set(error["error"]) == {"type", "message"}
        assert error["error"]["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
        assert field in error["error"]["message"], error
    assert_engine_intact(base_url)


def test_unknown_methods_and_paths_under_messages_are_anthropic_errors(server):
    """A GET of /v1/messages (405) and an unknown /v1/messages/... path (404) answered in OpenAI's error shape."""
    base_url, _ = server
    for response, status in ((httpx.get(f"{base_url}/v1/messages", headers=KEYED, timeout=30), 405),
                             (post(base_url, "/v1/messages/batches", {}), 404)):
        assert response.status_code == status
        assert response.json()["type"] == "error" and set(response.json()["error"]) == {"type", "message"}
    elsewhere = httpx.get(f"{base_url}/v1/nothing", timeout=30).json()  # other paths keep OpenAI's shape
    assert "type" not in elsewhere and {"message", "type", "param", "code"} == set(elsewhere["error"])


def test_a_user_message_of_empty_text_stays_a_user_turn(server, tokenizer):
    """A user message whose only block is empty text was dropped; a last one then made the reply a prefill of
    the assistant message before it. It is an empty user turn, as content "" is."""
    base_url, _ = server
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    as_blocks = [*history, {"role": "user", "content": [{"type": "text", "text": ""}]}]
    as_text = [*history, {"role": "user", "content": ""}]
    counted = [post(base_url, "/v1/messages/count_tokens", {"model": MODEL, "messages": m}).json()["input_tokens"]
               for m in (as_blocks, as_text)]
    rendered = tokenizer.apply_chat_template(as_text, add_generation_prompt=True)
    assert counted == [len(tokenizer.encode(rendered))] * 2


def test_a_body_that_is_not_json_is_an_anthropic_error(server):
    base_url, _ = server
    response = httpx.post(f"{base_url}/v1/messages", content=b"{", headers={**KEYED, "content-type": "text/plain"})
    assert response.status_code == 415 and response.json()["error"]["type"] == "invalid_request_error"
    response = httpx.post(f"{base_url}/v1/messages", content=b"{", headers={**KEYED,
                                                                           "content-type": "application/json"})
    assert response.status_code == 400 and "JSON" in response.json()["error"]["message"]


_PLAIN = st.text(st.characters(codec="utf-8"), min_size=1, max_size=20)
_EDGE = st.sampled_from([
    None, True, 0, -1, 2**31, 2**64, 0.5, float("nan"), "", "x", "\ud800", [], [None], {}, [5], [{"type": "text"}],
    [{"type": "image", "source": {"type": "base64"}}], [{"type": "tool_use", "id": 5}], [{"type": "tool_result"}],
    [{"type": "thinking"}], {"type": "tool"}, {"type": "any"}, [{"name": "f", "input_schema": {"type": "strin"}}],
    {"format": {"type": "json_schema", "schema": {"type": "nope"}}},
])
_ANY = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), _PLAIN),
                    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(_PLAIN, inner, max_size=3)),
                    max_leaves=8)
_BLOCK = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": _PLAIN}),
    st.fixed_dictionaries({"type": st.just("tool_result"), "tool_use_id": st.just("call_1"),
                           "content": st.one_of(_PLAIN, st.just([{"type": "text", "text": "ok"}]),
                                                st.lists(_ANY, max_size=2))}),
)
_MESSAGE = st.one_of(
    st.fixed_dictionaries({"role": st.just("user"), "content": st.one_of(_PLAIN, st.lists(_BLOCK, min_size=1,
                                                                                           max_size=2))}),
    st.fixed_dictionaries({"role": st.just("assistant"), "content": st.one_of(_PLAIN, st.just([
        {"type": "thinking", "thinking": "hm", "signature": "s"},
        {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"city": "Oslo"}}]))}),
)
_VALID = {
    "system": st.one_of(_PLAIN, st.just([{"type": "text", "text": "Be brief."}])),
    "temperature": st.floats(min_value=0, max_value=1), "top_p": st.floats(min_value=0.05, max_value=1),
    "top_k": st.integers(min_value=1, max_value=50), "tools": st.just([WEATHER]),
    "tool_choice": st.sampled_from([{"type": "auto"}, {"type": "none"}]), "stream": st.booleans(),
    "stop_sequences": st.lists(_PLAIN, max_size=2), "metadata": st.just({"user_id": "u"}),
    "thinking": st.just({"type": "enabled", "budget_tokens": 1024}),
}
_BODY = st.fixed_dictionaries({"model": st.just(MODEL), "messages": st.lists(_MESSAGE, min_size=1, max_size=3),
                               "max_tokens": st.integers(min_value=1, max_value=6)}, optional=_VALID)
_FIELDS = st.sampled_from(sorted({*_VALID, "model", "messages", "max_tokens", "output_config"}))
_MUTATIONS = st.dictionaries(st.one_of(_FIELDS, _FIELDS, _PLAIN), st.one_of(_EDGE, _ANY), max_size=2)


def test_fuzzed_messages_requests_never_get_a_5xx(server):
    """60 requests or 30 s: valid bodies with up to two fields replaced by edge values or arbitrary JSON; every
    answer is a 2xx or an Anthropic error object of a 4xx, and the engine's integrity check passes afterwards
    (400 requests, once: 326 answered 200, 74 answered 400, none 5xx)."""
    base_url, _ = server
    statuses: dict[int, int] = {}
    failures: list[str] = []
    deadline = time.monotonic() + 30

    @settings(max_examples=60, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(_BODY, _MUTATIONS)
    def one(body, mutations):
        if time.monotonic() > deadline:
            return
        body = {**body, **mutations}
        response = httpx.post(f"{base_url}/v1/messages", content=json.dumps(body),
                              headers={**KEYED, "content-type": "application/json"}, timeout=60)
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        if response.status_code >= 500:
            failures.append(f"{response.status_code} {body!r}: {response.text[:300]}")
        elif response.status_code >= 400 and response.json().get("type") != "error":
            failures.append(f"{response.status_code} not an Anthropic error {body!r}: {response.text[:300]}")

    one()
    print(f"\nmessages fuzz: statuses {dict(sorted(statuses.items()))}")
    assert not failures, "\n".join(failures[:10])
    assert statuses.get(200, 0) >= 4 and sum(statuses.values()) >= 20
    assert_engine_intact(base_url)


@pytest.fixture(scope="module")
def vl_server(tmp_path_factory):
    from hybridcache.models.vl_folders import write_tiny_vl_model

    from .server_process import SMALL_ENGINE, running_server

    model = write_tiny_vl_model(tmp_path_factory.mktemp("vl"))
    with running_server(str(model), *SMALL_ENGINE, tmp_dir=tmp_path_factory.mktemp("vl_server")) as vl:
        yield vl.base_url


def test_an_image_block_is_the_chat_routes_image_part(vl_server):
    pytest.importorskip("PIL")
    name = httpx.get(f"{vl_server}/v1/models", timeout=10).json()["data"][0]["id"]
    png = _png_base64()
    greedy = {"max_tokens": 5, "temperature": 0, "ignore_eos": True}
    message = httpx.post(f"{vl_server}/v1/messages", json={"model": name, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "Describe it."},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": png}}]}], **greedy},
        timeout=120).json()
    answer = httpx.post(f"{vl_server}/v1/chat/completions", json={"model": name, "messages": [{
        "role": "user", "content": [{"type": "text", "text": "Describe it."},
                                    {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png}"}}]}],
        **greedy}, timeout=120).json()
    assert message["content"][0]["text"] == answer["choices"][0]["message"]["content"]
    assert message["usage"]["input_tokens"] + message["usage"]["cache_read_input_tokens"] == \
        answer["usage"]["prompt_tokens"] > 20  # the image's tokens counted
    counted = httpx.post(f"{vl_server}/v1/messages/count_tokens", json={"model": name, "messages": [{
        "role": "user", "content": [{"type": "text", "text": "Describe it."}, {"type": "image", "source": {
            "type": "base64", "media_type": "image/png", "data": png}}]}]}, timeout=120).json()
    assert counted["input_tokens"] == answer["usage"]["prompt_tokens"]
    bad = httpx.post(f"{vl_server}/v1/messages", json={"model": name, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "file", "file_id": "f"}}]}], **greedy}, timeout=120)
    assert bad.status_code == 400 and "messages.0.content.0.source" in bad.json()["error"]["message"]


def test_error_bodies_and_field_names():
    assert anthropic_error_body(503, "busy") == {"type": "error", "error": {"type": "overloaded_error",
                                                                           "message": "busy"}}
    assert anthropic_error_body(400, "must be positive", "max_tokens")["error"]["message"] == \
        "max_tokens: must be positive"
    assert anthropic_error_body(500, "boom")["error"]["type"] == "api_error"
    assert messages_param("messages.3.content.0") == "messages"
    assert messages_param("tools.1.function.parameters.properties") == "tools.1.input_schema.properties"
    assert messages_param("stop") == "stop_sequences" and messages_param("stop_token_ids") == "stop_token_ids"
    assert messages_param("response_format.json_schema.schema") == "output_config.format"
