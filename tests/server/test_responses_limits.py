"""/v1/responses under the server's limits, and bodies that used to answer 500: a full waiting queue is a 503
with Retry-After and a request past --request-timeout is a 503 (or a final error event), as for chat
completions; malformed `text.format`, reasoning items and `tool_choice` are 400s naming the field. Tool calls
through chat completions and /v1/responses alike: `parallel_tool_calls`, the prompt a conversation renders in either
shape, calls sent back without arguments, and an error mid-stream. In process, over engine loop stand-ins (no model
runs: `ScriptedLoop` answers a given text)."""

from __future__ import annotations

import asyncio
import json

import pytest
from fastapi.testclient import TestClient

from hybridcache.models.builtin import builtin_model_dir
from hybridcache.outputs import CompletionOutput, RequestOutput
from hybridcache.server.app import ServedModel, build_app
from hybridcache.server.config import ServerConfig
from hybridcache.server.errors import APIError
from hybridcache.server.limits import QueueFull, ServerLimits
from hybridcache.server.protocol import ChatCompletionRequest, parse_request
from hybridcache.server.responses_api import input_messages, response_format
from hybridcache.tokenizer import Tokenizer

TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


class StandInLoop:
    """An engine loop that refuses every request with QueueFull (`full`), or takes it and never answers."""

    running = healthy = True
    last_error = None
    state = None

    def __init__(self, full: bool) -> None:
        self.full = full
        self.aborted: list[str] = []

    async def add(self, request_id, prompt, params, mm_inputs=(), checkpoints_at=(), *, cache_salt=None,
                  final_only=False) -> asyncio.Queue:
        return (await self.add_many([request_id], [prompt], params, [mm_inputs], [checkpoints_at]))[0]

    async def add_many(self, request_ids, prompts, params, mm_inputs=None, checkpoints_at=None, echo_only=False, *,
                       cache_salt=None, final_only=False):
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
    assert response.headers["x-should-retry"] == "false"  # (the OpenAI SDKs' retries would run it twice more)
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


class ScriptedLoop(StandInLoop):
    """An engine loop that answers every request with `text` at once (finished), or with the start of it and then
    `error` (what the engine loop puts on a request's queue when it fails); `prompts` records the prompt ids of
    every request it took."""

    def __init__(self, text: str, error: Exception | None = None) -> None:
        super().__init__(full=False)
        self.text = text
        self.error = error
        self.prompts: list[list[int]] = []

    async def add_many(self, request_ids, prompts, params, mm_inputs=None, checkpoints_at=None, echo_only=False, *,
                       cache_salt=None, final_only=False):
        sinks = []
        for request_id, prompt in zip(request_ids, prompts):
            self.prompts.append(list(prompt))
            sink: asyncio.Queue = asyncio.Queue()
            finished = self.error is None
            text = self.text if finished else self.text[: len(self.text) // 2]
            completion = CompletionOutput(0, text, [1] * max(1, len(text) // 4), finish_reason="stop" if finished
                                          else None)
            sink.put_nowait(RequestOutput(request_id, None, list(prompt), [completion], finished=finished))
            if not finished:
                sink.put_nowait(self.error)
            sinks.append(sink)
        return sinks


def _events(client: TestClient, path: str, body: dict) -> list[str]:
    """The `data:` payloads of a streamed response, in order."""
    with client.stream("POST", path, json={**body, "stream": True}) as streamed:
        assert streamed.status_code == 200
        return [line[6:] for line in streamed.iter_lines() if line.startswith("data: ")]


def _chat_calls(client: TestClient, body: dict, stream: bool) -> list[tuple[int, dict]]:
    """(index, arguments) of the tool calls of choice 0 of a chat completion, streamed or not."""
    if not stream:
        response = client.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        calls = response.json()["choices"][0]["message"].get("tool_calls") or []
        return [(i, json.loads(c["function"]["arguments"])) for i, c in enumerate(calls)]
    events = _events(client, "/v1/chat/completions", body)
    assert events[-1] == "[DONE]"
    deltas = [call for e in events[:-1] for call in json.loads(e)["choices"][0]["delta"].get("tool_calls") or []]
    return [(c["index"], json.loads(c["function"]["arguments"])) for c in deltas]


def _response_calls(client: TestClient, body: dict, stream: bool) -> list[dict]:
    """The arguments of a /v1/responses answer's function_call items, streamed (each `output_item.done`, and the
    final response's output, which must agree) or not."""
    if not stream:
        response = client.post("/v1/responses", json=body)
        assert response.status_code == 200, response.text
        output = response.json()["output"]
    else:
        events = [json.loads(e) for e in _events(client, "/v1/responses", body)]
        assert events[-1]["type"] == "response.completed"
        done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
        output = events[-1]["response"]["output"]
        assert [i["type"] for i in done] == [i["type"] for i in output]
    return [json.loads(item["arguments"]) for item in output if item["type"] == "function_call"]


ZONE = {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}}
TWO_CALLS = ('<tool_call>\n{"name": "get_time", "arguments": {"zone": "utc"}}\n</tool_call>\n'
             '<tool_call>\n{"name": "get_time", "arguments": {"zone": "cet"}}\n</tool_call>')


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("parallel", [True, False])
def test_parallel_tool_calls_false_keeps_only_the_first_call(tokenizer, parallel, stream):
    """vLLM's `maybe_filter_parallel_tool_calls` (OpenAI: "at most one tool call"): with `parallel_tool_calls:
    false` a chat message, a chat stream and a /v1/responses output hold the first call only; every call was kept."""
    client = _client(tokenizer, ScriptedLoop("Checking.\n" + TWO_CALLS))
    want = [{"zone": "utc"}, {"zone": "cet"}] if parallel else [{"zone": "utc"}]
    chat = {"messages": [{"role": "user", "content": "time?"}], "parallel_tool_calls": parallel,
            "tools": [{"type": "function", "function": {"name": "get_time", "parameters": ZONE}}]}
    assert _chat_calls(client, chat, stream) == list(enumerate(want))
    responses = {"input": "time?", "parallel_tool_calls": parallel,
                 "tools": [{"type": "function", "name": "get_time", "parameters": ZONE}]}
    assert _response_calls(client, responses, stream) == want


def test_a_tool_whose_properties_are_not_an_object_answers_its_call(tokenizer):
    """A tool with `properties: ["a"]` made the XML parser raise: the chat answer was a 500 and the stream broke
    off without an error event or [DONE] (vLLM's parser survives such a schema)."""
    client = _client(tokenizer, ScriptedLoop("<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</function>\n"
                                             "</tool_call>"))
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": ["a"]}}}]
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": tools}
    assert _chat_calls(client, body, stream=False) == _chat_calls(client, body, stream=True) == [(0, {"a": "1"})]


def test_an_unexpected_error_mid_stream_ends_it_with_an_error_event(tokenizer):
    """An error other than a timeout or an engine failure while a stream runs (a bug rendering a chunk) cut the
    connection with no error event and no [DONE]; it is now a final error event, as the timeout's."""
    client = _client(tokenizer, ScriptedLoop("Hello there, how are you", error=RuntimeError("boom")))
    events = _events(client, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["type"] == "internal_error" and "boom" in error["message"]
    assert any(json.loads(e)["choices"][0]["delta"].get("content") for e in events[:-2])  # the text before it
    events = [json.loads(e) for e in _events(client, "/v1/responses", {"input": "hi"})]
    assert events[-1]["type"] == "error" and events[-1]["code"] == "internal_error" and "boom" in events[-1]["message"]


def test_text_parts_render_as_the_chat_endpoints_and_metadata_is_bounded_as_openai(tokenizer):
    """Several input_text parts of one message were glued with "" before the chat template saw them; the same parts
    sent to chat completions join with a newline for a template that takes strings (vLLM's): the prompts differed.
    `metadata` (kept with a stored response) took any size; OpenAI's: 16 pairs of strings, keys <= 64 characters,
    values <= 512."""
    loop = ScriptedLoop("ok")
    client = _client(tokenizer, loop)
    parts = [{"type": "input_text", "text": "Translate the next line."}, {"type": "input_text", "text": "Bonjour"}]
    chat_parts = [{"type": "text", "text": part["text"]} for part in parts]
    chat = _prompt(client, loop, "/v1/chat/completions", {"messages": [{"role": "user", "content": chat_parts}]})
    responses = _prompt(client, loop, "/v1/responses", {"input": [{"role": "user", "content": parts}],
                                                        "store": False})
    assert responses == chat and "line.\nBonjour" in tokenizer.decode(responses)
    for metadata in ({"k": "v" * 513}, {"k" * 65: "v"}, {str(i): "v" for i in range(17)}, {"k": {"nested": 1}}):
        response = client.post("/v1/responses", json={"input": "hi", "metadata": metadata})
        assert response.status_code == 400 and response.json()["error"]["param"].startswith("metadata"), metadata
    assert client.post("/v1/responses", json={"input": "hi", "metadata": {"k" * 64: "v" * 512}}).status_code == 200


def test_a_stream_cut_by_the_shutdown_numbers_its_error_event_after_the_last(tokenizer, monkeypatch):
    """The shutdown's error event of a Responses stream was built before the stream began, numbered 0."""
    from hybridcache.server import responses_api

    captured = {}
    original = responses_api.EventStreamResponse

    def capture(events, on_close, final_events=()):
        captured["final"] = final_events
        return original(events, on_close=on_close, final_events=final_events)

    monkeypatch.setattr(responses_api, "EventStreamResponse", capture)
    events = [json.loads(e) for e in _events(_client(tokenizer, ScriptedLoop("Hello there")), "/v1/responses",
                                             {"input": "hi"})]
    [final] = captured["final"]()  # what a cut right after those events sends
    shutdown = json.loads(final.decode().split("data: ", 1)[1])
    assert shutdown["type"] == "error" and shutdown["code"] == "server_shutdown"
    assert shutdown["sequence_number"] == events[-1]["sequence_number"] + 1


TIME_TOOL = {"type": "function", "name": "get_time", "parameters": ZONE}
CHAT_TIME_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": ZONE}}


def _prompt(client: TestClient, loop: ScriptedLoop, path: str, body: dict) -> list[int]:
    """The prompt ids a request hands the engine."""
    response = client.post(path, json=body)
    assert response.status_code == 200, response.text
    return loop.prompts[-1]


def test_a_turn_of_text_then_a_call_renders_the_same_prompt_as_chat_and_as_responses_items(tokenizer):
    """A turn that wrote text and then called a tool is output items [message, function_call]; sent back as input
    items (a stateless client's `input += response.output`) they became two assistant turns, so the prompt differed
    from the same conversation sent to chat completions (and from the turn the model wrote: the prefix cache missed
    from there). vLLM merges a function_call into the assistant message before it."""
    loop = ScriptedLoop("It is noon.")
    client = _client(tokenizer, loop)
    call = {"name": "get_time", "arguments": '{"zone": "utc"}'}
    items = [{"role": "user", "content": "time?"},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me check."}]},
             {"type": "function_call", "call_id": "call_1", **call},
             {"type": "function_call", "call_id": "call_2", **call},
             {"type": "function_call_output", "call_id": "call_1", "output": "12:00"},
             {"type": "function_call_output", "call_id": "call_2", "output": "12:00"}]
    messages = [{"role": "user", "content": "time?"},
                {"role": "assistant", "content": "Let me check.", "tool_calls": [
                    {"id": f"call_{i}", "type": "function", "function": call} for i in (1, 2)]},
                {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
                {"role": "tool", "tool_call_id": "call_2", "content": "12:00"}]
    chat = _prompt(client, loop, "/v1/chat/completions", {"messages": messages, "tools": [CHAT_TIME_TOOL]})
    responses = _prompt(client, loop, "/v1/responses", {"input": items, "tools": [TIME_TOOL], "store": False})
    assert tokenizer.decode(responses) == tokenizer.decode(chat)
    assert responses == chat
    assert [m["role"] for m in input_messages(items)] == ["user", "assistant", "tool", "tool"]


# Qwen3.5's / Qwen3-Coder's rendering of an earlier call (it iterates over the arguments), reduced to what matters
ITEMS_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content or '' }}"
                  "{% for tc in m.tool_calls or [] %}<tool_call>\n<function={{ tc.function.name }}>\n"
                  "{% for k, v in tc.function.arguments|items %}<parameter={{ k }}>\n{{ v }}\n</parameter>\n"
                  "{% endfor %}</function>\n</tool_call>{% endfor %}<|im_end|>\n{% endfor %}<|im_start|>assistant\n")


@pytest.mark.parametrize("template", [None, ITEMS_TEMPLATE], ids=["builtin_template", "qwen35_style_template"])
@pytest.mark.parametrize("arguments", ["", None, " "])
def test_a_call_sent_back_without_arguments_renders_as_no_arguments(tokenizer, template, arguments):
    """An earlier call sent back with `"arguments": ""` rendered `"arguments": }` (a template iterating over them:
    a 400), and null was a 400; vLLM reads both as {}. The same for a /v1/responses function_call item."""
    if template is not None:
        tokenizer = Tokenizer(builtin_model_dir())
        tokenizer.chat_template = template
    loop = ScriptedLoop("It is noon.")
    client = _client(tokenizer, loop)

    def chat(sent) -> list[int]:
        messages = [{"role": "user", "content": "time?"},
                    {"role": "assistant", "content": None, "tool_calls": [
                        {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": sent}}]},
                    {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]
        return _prompt(client, loop, "/v1/chat/completions", {"messages": messages, "tools": [CHAT_TIME_TOOL]})

    expected = chat({})
    assert chat(arguments) == expected
    items = [{"role": "user", "content": "time?"},
             {"type": "function_call", "call_id": "call_1", "name": "get_time", "arguments": arguments},
             {"type": "function_call_output", "call_id": "call_1", "output": "12:00"}]
    body = {"input": items, "tools": [TIME_TOOL], "store": False}
    assert _prompt(client, loop, "/v1/responses", body) == expected


def test_stored_responses_are_bounded_by_their_bytes_too():
    """The store kept the newest 1,024 responses whatever their size: 20 MB bodies (text a prompt never renders,
    e.g. a function_call's call_id, passes the prompt-length check) held 421 MB after 20 requests, up to 256 GiB
    at the default --max-request-bytes (hunt 181). Now also at most `max_bytes` of text, the oldest dropped first,
    and the newest kept whatever its size."""
    from hybridcache.server.responses_api import ResponseStore, _Stored

    store = ResponseStore(capacity=100, max_bytes=10_000)
    for i in range(5):
        store.put(f"r{i}", _Stored([{"role": "user", "content": "x" * 3_000}], {"id": f"r{i}"}))
    assert store.num_bytes <= 10_000
    for i in (0, 1):
        with pytest.raises(APIError, match="r" + str(i)):
            store.get(f"r{i}", "previous_response_id")
    assert [store.get(f"r{i}", "p").body["id"] for i in (2, 3, 4)] == ["r2", "r3", "r4"]
    store.put("big", _Stored([{"role": "user", "content": "y" * 50_000}], {}))  # alone over the budget: kept
    assert store.get("big", "p").messages[0]["content"] == "y" * 50_000
    with pytest.raises(APIError):
        store.get("r4", "p")
    store.put("big", _Stored([], {}))  # stored again under its id: its old size is not counted twice
    assert store.num_bytes < 100


def test_stored_responses_count_the_memory_of_wide_text():
    """The byte bound counted characters: 30 MiB of emoji held 120 MiB under a 40 MiB bound (CPython keeps 4 bytes
    a character for such text; hunt 194). Each string now counts what it takes in memory."""
    from hybridcache.server.responses_api import ResponseStore, _Stored

    store = ResponseStore(capacity=100, max_bytes=10_000)
    store.put("wide", _Stored([{"role": "user", "content": "\U0001F600" * 3_000}], {}))
    assert store.num_bytes >= 12_000  # over the bound alone: the newest is kept, but counted as it is
    store.put("next", _Stored([{"role": "user", "content": "x"}], {}))
    with pytest.raises(APIError):
        store.get("wide", "p")
