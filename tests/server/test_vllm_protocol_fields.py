"""vLLM request fields and response details a hunt found missing or different (each test fails on the old code):
`reasoning_effort: "none"` turning thinking off, `truncate_prompt_tokens: -1` and `truncation_side`, chat `echo`,
`include_reasoning: false`, vLLM fields refused rather than ignored, a named `tool_choice`'s finish reason and
content, `GET /load`, and `usage.completion_tokens_details.reasoning_tokens`. Routes run against in-process servers
on the built-in model (one with max_model_len 256, one with the qwen3 reasoning parser); the rest without one."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time

import httpx
import pytest

from hybridcache.config import EngineConfig
from hybridcache.server.app import LoadCounting, ServerLoad
from hybridcache.server.chat_output import ChatOutputOptions, ThinkMarkers, final_message, reasoning_tokens
from hybridcache.server.errors import APIError
from hybridcache.server.protocol import ChatCompletionRequest, CompletionRequest, Truncation, parse_request
from hybridcache.server.reasoning import ReasoningParser
from tests.server.conftest import MODEL
from tests.server.inprocess_server import serving

MAX_MODEL_LEN = 256
SMALL = EngineConfig(block_size=16, max_model_len=MAX_MODEL_LEN, num_blocks=512)
USER = [{"role": "user", "content": "hi"}]
THINK_TEXT = "<think>\nplan\n</think>\n\nHi"  # forced with guided_regex: the reasoning is "plan", the content "Hi"
TOOLS = [{"type": "function", "function": {"name": "get_w", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["a", "b"]}}, "required": ["city"],
    "additionalProperties": False}}}]


@pytest.fixture(scope="module")
def small():
    with serving(SMALL) as url, httpx.Client(base_url=url, timeout=60) as http:
        yield http


@pytest.fixture(scope="module")
def server():
    with serving() as url, httpx.Client(base_url=url, timeout=60) as http:
        yield http


@pytest.fixture(scope="module")
def thinking():
    with serving(reasoning_parser=ReasoningParser.QWEN3) as url, httpx.Client(base_url=url, timeout=60) as http:
        yield http


def _ok(response: httpx.Response) -> dict:
    assert response.status_code == 200, response.text
    return response.json()


def _error(response: httpx.Response) -> dict:
    assert response.status_code == 400, response.text
    return response.json()["error"]


def _events(response: httpx.Response) -> list[dict]:
    assert response.status_code == 200, response.text
    lines = [line[len("data: "):] for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def _streamed(http: httpx.Client, body: dict) -> list[dict]:
    return _events(http.post("/v1/chat/completions", json={**body, "stream": True}))


def _deltas(events: list[dict], key: str) -> list[str]:
    return [c["delta"][key] for e in events for c in e["choices"] if c["delta"].get(key)]


# ------------------------------------------------------------------------------------ 1. reasoning_effort "none"
@pytest.mark.parametrize("extra, defaults, thinking_on", [
    ({"reasoning_effort": "none"}, {}, False),
    ({"reasoning_effort": "low"}, {}, True),
    ({"reasoning_effort": "none"}, {"enable_thinking": True}, False),  # the server's default lies underneath
    ({"reasoning_effort": "high"}, {"enable_thinking": False}, True),
    ({"reasoning_effort": "none", "chat_template_kwargs": {"enable_thinking": True}}, {}, True),  # the request's own
], ids=["none", "low", "none-over-server-default", "high-over-server-default", "request-kwargs-win"])
def test_reasoning_effort_sets_enable_thinking_as_vllm(extra, defaults, thinking_on):
    body = parse_request(ChatCompletionRequest, {"messages": USER, **extra})
    assert body.template_kwargs(defaults)["enable_thinking"] is thinking_on
    assert "enable_thinking" not in parse_request(ChatCompletionRequest, {"messages": USER}).template_kwargs({})


def test_reasoning_effort_none_renders_the_prompt_without_thinking(server):
    def prompt(extra: dict) -> tuple[str, int]:
        tokenized = _ok(server.post("/tokenize", json={"messages": USER, **extra}))
        text = _ok(server.post("/detokenize", json={"tokens": tokenized["tokens"]}))["prompt"]
        return text, tokenized["count"]

    off, num_off = prompt({"chat_template_kwargs": {"enable_thinking": False}})
    assert off.endswith("<think>\n\n</think>\n\n") and off != prompt({})[0]
    assert prompt({"reasoning_effort": "none"})[0] == off
    chat = _ok(server.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 1,
                                                         "reasoning_effort": "none"}))
    assert chat["usage"]["prompt_tokens"] == num_off
    # /v1/responses takes it as reasoning.effort, through the same chat path
    response = _ok(server.post("/v1/responses", json={"model": MODEL, "input": "hi", "max_output_tokens": 1,
                                                       "reasoning": {"effort": "none"}}))
    assert response["usage"]["input_tokens"] == num_off


# ------------------------------------------------------------------------------------ 2. truncate_prompt_tokens -1
LONG_IDS = [(i % 200) + 10 for i in range(MAX_MODEL_LEN + 50)]


def test_minus_one_keeps_the_room_max_tokens_leaves(small):
    for extra, kept in (({"max_tokens": 5}, MAX_MODEL_LEN - 5), ({}, MAX_MODEL_LEN - 16)):  # 16: the default
        body = {"prompt": LONG_IDS, "truncate_prompt_tokens": -1, "return_token_ids": True, **extra}
        choice = _ok(small.post("/v1/completions", json=body))["choices"][0]
        assert choice["prompt_token_ids"] == LONG_IDS[-kept:]
    chat = {"messages": [{"role": "user", "content": "word " * 200}], "max_tokens": 6, "truncate_prompt_tokens": -1}
    assert _ok(small.post("/v1/chat/completions", json=chat))["usage"]["prompt_tokens"] == MAX_MODEL_LEN - 6


def test_a_k_that_leaves_no_room_for_max_tokens_is_refused(small):
    body = {"prompt": LONG_IDS, "max_tokens": 5, "truncate_prompt_tokens": MAX_MODEL_LEN - 4}
    error = _error(small.post("/v1/completions", json=body))
    assert error["param"] == "truncate_prompt_tokens" and f"[1, {MAX_MODEL_LEN - 5}]" in error["message"]
    assert _ok(small.post("/v1/completions", json={**body, "truncate_prompt_tokens": MAX_MODEL_LEN - 5}))
    with pytest.raises(APIError) as info:
        parse_request(CompletionRequest, {"prompt": "x", "truncate_prompt_tokens": 0}).truncation(256, 16)
    assert info.value.param == "truncate_prompt_tokens"


# ------------------------------------------------------------------------------------ 3. truncation_side
def test_truncation_side_right_keeps_the_first_tokens(small, tokenizer):
    ids = list(range(10, 30))
    for side, kept in (("right", ids[:5]), ("left", ids[-5:]), (None, ids[-5:])):
        body = {"prompt": ids, "max_tokens": 1, "truncate_prompt_tokens": 5, "truncation_side": side,
                "return_token_ids": True}
        assert _ok(small.post("/v1/completions", json=body))["choices"][0]["prompt_token_ids"] == kept
    # a text of any length: only its start is tokenized, and gives the whole text's first tokens
    text = "".join(f"w{i} é€ " for i in range(20_000))
    body = {"prompt": text, "max_tokens": 1, "truncate_prompt_tokens": 100, "truncation_side": "right",
            "return_token_ids": True}
    assert _ok(small.post("/v1/completions", json=body))["choices"][0]["prompt_token_ids"] == \
        tokenizer.encode(text)[:100]
    chat = {"messages": [{"role": "user", "content": "word " * 200}], "max_tokens": 1, "truncate_prompt_tokens": 20,
            "truncation_side": "right", "return_token_ids": True}
    rendered = tokenizer.apply_chat_template([chat["messages"][0]], add_generation_prompt=True, tools=None,
                                             continue_final_message=False, template_kwargs={})
    assert _ok(small.post("/v1/chat/completions", json=chat))["prompt_token_ids"] == tokenizer.encode(rendered)[:20]
    assert _error(small.post("/v1/completions", json={**body, "truncation_side": "middle"}))["param"] == \
        "truncation_side"


def test_truncation_text_window_matches_the_whole_text(tokenizer):
    from hybridcache.server.limits import max_token_bytes

    limit = MAX_MODEL_LEN * max_token_bytes(tokenizer)
    text = "".join(f"w{i} é€ " for i in range(5_000))
    for side, end in (("left", slice(-7, None)), ("right", slice(None, 7))):
        cut = Truncation(7, side)
        window = cut.text_window(text, limit, MAX_MODEL_LEN)
        assert len(window) < len(text) and cut.apply(tokenizer.encode(window)) == tokenizer.encode(text)[end]


# ------------------------------------------------------------------------------------ 3. chat echo
CONTINUED = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "PREFIX "}],
             "add_generation_prompt": False, "continue_final_message": True, "max_tokens": 3, "temperature": 0}


def test_chat_echo_prepends_the_continued_message(server):
    plain = _ok(server.post("/v1/chat/completions", json=CONTINUED))["choices"][0]["message"]["content"]
    echoed = _ok(server.post("/v1/chat/completions", json={**CONTINUED, "echo": True, "n": 2}))
    assert [c["message"]["content"] for c in echoed["choices"]] == ["PREFIX " + plain] * 2
    events = _streamed(server, {**CONTINUED, "echo": True})
    assert _deltas(events, "content")[0] == "PREFIX " and "".join(_deltas(events, "content")) == "PREFIX " + plain
    # a last assistant message under a generation prompt is echoed too; a user's last message is not (vLLM's rule)
    under_prompt = {**CONTINUED, "add_generation_prompt": True, "continue_final_message": False, "echo": True}
    assert _ok(server.post("/v1/chat/completions", json=under_prompt))["choices"][0]["message"]["content"] \
        .startswith("PREFIX ")
    user_last = {"messages": USER, "max_tokens": 3, "temperature": 0}
    assert _ok(server.post("/v1/chat/completions", json={**user_last, "echo": True}))["choices"][0]["message"] == \
        _ok(server.post("/v1/chat/completions", json=user_last))["choices"][0]["message"]


def test_echo_text_follows_vllm():
    parts = [{"role": "user", "content": "q"},
             {"role": "assistant", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    cases = [({"messages": parts}, None),
             ({"messages": parts, "echo": True}, "a\nb"),
             ({"messages": USER, "echo": True}, ""),
             ({"messages": USER, "echo": True, "add_generation_prompt": False}, "hi")]
    for body, echo in cases:
        assert parse_request(ChatCompletionRequest, body).echo_text() == echo
    # with echo the content is never null: a reply of only reasoning has content "" (vLLM: echo + (content or ""))
    options = ChatOutputOptions(split_reasoning=True, echo="")
    assert final_message("<think>x</think>", options)["content"] == ""
    assert final_message("<think>x</think>", ChatOutputOptions(split_reasoning=True))["content"] is None


# ------------------------------------------------------------------------------------ 3. include_reasoning false
FORCED_THINK = {"messages": USER, "max_tokens": 40, "temperature": 0, "guided_regex": re.escape(THINK_TEXT),
                "logprobs": True, "return_token_ids": True}


def test_include_reasoning_false_drops_the_reasoning(thinking):
    shown = _ok(thinking.post("/v1/chat/completions", json=FORCED_THINK))["choices"][0]
    assert shown["message"]["reasoning"] == "plan" and shown["logprobs"] and shown["token_ids"]
    hidden = _ok(thinking.post("/v1/chat/completions", json={**FORCED_THINK, "include_reasoning": False}))
    choice = hidden["choices"][0]
    assert choice["message"]["content"] == "Hi" and choice["message"]["reasoning"] is None
    assert choice["message"]["reasoning_content"] is None
    # as vLLM, neither logprobs nor token ids (they would show the reasoning)
    assert choice["logprobs"] is None and choice["token_ids"] is None and hidden["prompt_token_ids"]
    events = _streamed(thinking, {**FORCED_THINK, "include_reasoning": False})
    assert _deltas(events, "reasoning") == [] and _deltas(events, "reasoning_content") == []
    assert "".join(_deltas(events, "content")) == "Hi"
    assert all(c["logprobs"] is None and "token_ids" not in c for e in events for c in e["choices"])
    assert _deltas(_streamed(thinking, FORCED_THINK), "reasoning")  # (shown by default)


# ------------------------------------------------------------------------------------ 3. fields refused by name
@pytest.mark.parametrize("field, value, neutral", [
    ("logprob_token_ids", [50, 51], None),
    ("priority", 7, 0),
    ("thinking_token_budget", 0, -1),
    ("repetition_detection", {"max_pattern_size": 2, "min_count": 2}, None),
])
def test_vllm_fields_that_change_the_output_are_refused_by_name(field, value, neutral):
    for model, base in ((CompletionRequest, {"prompt": "x"}), (ChatCompletionRequest, {"messages": USER})):
        with pytest.raises(APIError) as info:
            parse_request(model, {**base, field: value})
        assert info.value.param == field and info.value.status == 400 and "not supported" in info.value.message
        assert info.value.body()["error"]["code"] == "unsupported_parameter"
        parse_request(model, {**base, field: neutral})  # what leaving it out means passes
        parse_request(model, {**base, field: None})


def test_priority_is_refused_over_http(server):
    error = _error(server.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "priority": 7}))
    assert error["param"] == "priority" and "priority scheduling" in error["message"]


# ------------------------------------------------------------------------------------ 4. named tool_choice
NAMED = {"messages": [{"role": "user", "content": "weather?"}], "max_tokens": 200, "temperature": 0,
         "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_w"}}}


def test_a_named_tool_call_finishes_with_stop_and_empty_content(server):
    choice = _ok(server.post("/v1/chat/completions", json=NAMED))["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["message"]["content"] == ""
    assert [call["function"]["name"] for call in choice["message"]["tool_calls"]] == ["get_w"]
    events = _streamed(server, NAMED)
    assert [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]] == ["stop"]
    assert _deltas(events, "tool_calls")
    required = _ok(server.post("/v1/chat/completions", json={**NAMED, "tool_choice": "required",
                                                                        "parallel_tool_calls": False}))["choices"][0]
    assert required["finish_reason"] == "tool_calls" and required["message"]["content"] == ""  # (vLLM's "")


# ------------------------------------------------------------------------------------ 4. GET /load
def test_load_counts_generation_requests_in_flight(server):
    assert _ok(server.get("/load")) == {"server_load": 0}
    seen: set[int] = set()
    body = {"prompt": "x", "max_tokens": 60, "ignore_eos": True}
    worker = threading.Thread(target=lambda: server.post("/v1/completions", json=body, timeout=120))
    worker.start()
    while worker.is_alive():
        seen.add(_ok(server.get("/load"))["server_load"])
        time.sleep(0.01)
    worker.join()
    assert 1 in seen and seen <= {0, 1}
    assert _ok(server.get("/load")) == {"server_load": 0}


def test_load_counting_covers_a_response_until_it_ends():
    load = ServerLoad()
    during: list[int] = []

    async def app(scope, receive, send):
        during.append(load.num_requests)
        if scope["path"] == "/v1/responses":
            raise RuntimeError("failed")

    counting = LoadCounting(app, load)

    async def run() -> None:
        await counting({"type": "http", "method": "POST", "path": "/v1/chat/completions"}, None, None)
        await counting({"type": "http", "method": "GET", "path": "/health"}, None, None)
        with pytest.raises(RuntimeError):
            await counting({"type": "http", "method": "POST", "path": "/v1/responses"}, None, None)

    asyncio.run(run())
    assert during == [1, 0, 1] and load.num_requests == 0


# ------------------------------------------------------------------------------------ 4. reasoning_tokens
MARKERS = ThinkMarkers(start_ids=(1,), end_ids=(2,), call_ids=(3,))  # one token per tag, as in Qwen3 tokenizers
CALL = "<tool_call>\n<function=f>\n</function>\n</tool_call>"


@pytest.mark.parametrize("text, ids, in_reasoning, count", [
    ("<think>\nplan\n</think>\n\nHi", [1, 10, 11, 10, 2, 12, 13], False, 3),
    ("plan</think>Hi", [11, 2, 13], True, 1),  # the prompt opened the block
    ("plan and more", [11, 12, 13], True, 3),  # cut inside its reasoning
    ("<think>plan</think>Hi", [1, 11, 2, 13], True, 1),  # a repeated opening tag is not counted
    ("Hello", [5, 6], False, 0),
    ("Hi <think>x</think>", [13, 1, 5, 2], False, 0),  # a tag inside the answer opens no reasoning
    ("plan\n" + CALL, [11, 10, 3, 10, 20, 21], True, 2),  # a call written inside the block ends it (Qwen3.5)
    ("plan</think>\n" + CALL, [11, 2, 10, 3, 20, 21], True, 1),  # a call after the block
], ids=["opened", "prompt-opened", "cut", "repeated-tag", "none", "late-tag", "call-inside", "call-after"])
def test_reasoning_tokens_counts_the_tokens_inside_the_think_block(text, ids, in_reasoning, count):
    options = ChatOutputOptions(split_reasoning=True, in_reasoning=in_reasoning, think_markers=MARKERS)
    assert reasoning_tokens(text, ids, options) == count


def test_usage_reports_reasoning_tokens_with_a_reasoning_parser(thinking, server):
    body = {**FORCED_THINK, "n": 2}
    usage = _ok(thinking.post("/v1/chat/completions", json=body))["usage"]
    assert usage["completion_tokens_details"] == {"reasoning_tokens": 2 * len("\nplan\n")}  # 2 choices, 6 each
    events = _streamed(thinking, {**body, "stream_options": {"include_usage": True}})
    assert events[-1]["usage"]["completion_tokens_details"] == {"reasoning_tokens": 12}
    assert "completion_tokens_details" not in _ok(server.post("/v1/chat/completions", json=body))["usage"]
