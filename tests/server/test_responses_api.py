"""`/v1/responses` through the `openai` client's `responses.create` (text, streamed events, a forced tool call and its
result sent back, `previous_response_id`, `store: false`) and through openai-agents' default model (the Responses
API); `/tokenize`, `/detokenize` and `/version`."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Annotated

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openai import AsyncOpenAI, OpenAI
from pydantic import BaseModel, Field

from hybridcache.models.builtin import BUILTIN_NAME

from .inprocess_server import serving

MODEL = BUILTIN_NAME
WEATHER = {"type": "function", "name": "get_weather", "description": "current weather",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                          "required": ["city"], "additionalProperties": False}}
QUESTION = "What is the weather in Paris?"


class Report(BaseModel):
    city: str = Field(max_length=8)
    sunny: bool


@pytest.fixture(scope="module")
def server():
    with serving(reasoning_parser="qwen3", enable_debug_endpoints=True) as base_url:
        yield base_url, OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def chat_prompt_tokens(tokenizer, messages, tools=None):
    return len(tokenizer.encode(tokenizer.apply_chat_template(messages, tools=tools)))


def test_text_response_and_usage(server, tokenizer):
    _, client = server
    response = client.responses.create(model=MODEL, input=QUESTION, instructions="Be brief.", max_output_tokens=8,
                                       temperature=0)
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.status in ("completed", "incomplete")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}]
    assert response.usage.input_tokens == chat_prompt_tokens(tokenizer, messages)
    assert 1 <= response.usage.output_tokens <= 8
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens
    assert response.usage.output_tokens_details.reasoning_tokens <= response.usage.output_tokens
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    assert response.output_text == (chat.choices[0].message.content or "")
    assert response.usage.output_tokens_details.reasoning_tokens == \
        chat.usage.completion_tokens_details.reasoning_tokens  # one count for both endpoints
    assert [i.type for i in response.output if i.type != "reasoning"] == (["message"] if response.output_text else [])
    again = client.responses.create(model=MODEL, input=QUESTION, instructions="Be brief.", max_output_tokens=8,
                                    temperature=0)
    assert again.usage.input_tokens_details.cached_tokens > 0  # the same prompt: the prefix cache covers it
    assert client.responses.retrieve(response.id).output_text == response.output_text


def test_vllm_sampling_fields_act_as_in_a_chat_request(server):
    """vLLM's ResponsesRequest takes seed, stop, top_k, logit_bias, penalties, ignore_eos, ... into its sampling:
    each acts here as in the chat request the response runs as (they were ignored)."""
    base_url, _ = server
    messages = [{"role": "user", "content": QUESTION}]

    def both(**fields):
        chat = httpx.post(f"{base_url}/v1/chat/completions", json={
            "model": MODEL, "messages": messages, "max_tokens": 12, **fields}, timeout=120).json()
        response = httpx.post(f"{base_url}/v1/responses", json={
            "model": MODEL, "input": QUESTION, "max_output_tokens": 12, **fields}, timeout=120).json()
        message = [i for i in response["output"] if i["type"] == "message"]
        return chat["choices"][0]["message"]["content"] or "", message[0]["content"][0]["text"] if message else ""

    plain, _ = both(temperature=0, ignore_eos=True)
    cases = [dict(temperature=1.0, seed=1234), dict(temperature=0, logit_bias={"33": 100}),
             dict(temperature=2.0, top_k=1, seed=5), dict(temperature=0, ignore_eos=True, repetition_penalty=1.5,
                                                           presence_penalty=1.0, frequency_penalty=0.5),
             dict(temperature=0, ignore_eos=True, stop=[plain[3:5]], include_stop_str_in_output=True)]
    for fields in cases:
        chat, response = both(**fields)
        assert response == chat, fields
    assert both(temperature=0, logit_bias={"33": 100})[1].startswith("B")  # the bias took hold
    assert both(temperature=0, ignore_eos=True, stop=[plain[3:5]])[1] == plain[:plain.index(plain[3:5])]


def test_truncation_auto_keeps_the_last_tokens_that_fit(server):
    base_url, _ = server
    long_input = "many words here " * 2000
    body = {"model": MODEL, "input": long_input, "max_output_tokens": 4, "temperature": 0}
    refused = httpx.post(f"{base_url}/v1/responses", json=body, timeout=120)
    assert refused.status_code == 400, refused.text
    kept = httpx.post(f"{base_url}/v1/responses", json={**body, "truncation": "auto"}, timeout=120)
    assert kept.status_code == 200, kept.text
    assert 0 < kept.json()["usage"]["input_tokens"] <= 4096


def test_streamed_events_match_the_response(server):
    _, client = server
    kwargs = dict(model=MODEL, input=QUESTION, max_output_tokens=12, temperature=0)
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(stream=True, **kwargs))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert text == final.output_text == whole.output_text
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert [i.content[0].text for i in final.output if i.type == "reasoning"] == ([reasoning] if reasoning else [])
    assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done") == len(final.output)
    assert final.usage.output_tokens == whole.usage.output_tokens and final.status == whole.status
    with client.responses.stream(**kwargs) as stream:  # the client's helper rebuilds the response from the events
        for _ in stream:
            pass
        rebuilt = stream.get_final_response()
    assert rebuilt.output_text == whole.output_text
    assert [i.type for i in rebuilt.output] == [i.type for i in whole.output]


def test_output_text_logprobs_when_included(server):
    _, client = server
    kwargs = dict(model=MODEL, input=QUESTION, max_output_tokens=12, temperature=0)
    plain = client.responses.create(**kwargs)
    assert all(not part.logprobs for item in plain.output if item.type == "message" for part in item.content)
    whole = client.responses.create(include=["message.output_text.logprobs"], top_logprobs=3, **kwargs)
    assert whole.output_text == plain.output_text
    (message,) = [item for item in whole.output if item.type == "message"]
    entries = message.content[0].logprobs
    assert len(entries) == whole.usage.output_tokens  # every output token, as vLLM's (reasoning included)
    for entry in entries:
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.logprob - 1e-6  # the likeliest first
        assert entry.bytes == list(entry.token.encode())
    events = list(client.responses.create(stream=True, include=["message.output_text.logprobs"], top_logprobs=3,
                                          **kwargs))
    streamed = [e for event in events if event.type == "response.output_text.delta" for e in event.logprobs]
    assert streamed  # the content's tokens; those of the reasoning before them are not listed
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in entries[-len(streamed):]]
    (done,) = [e for e in events if e.type == "response.output_text.done"]
    assert [e.token for e in done.logprobs] == [e.token for e in streamed]
    final = [item for item in events[-1].response.output if item.type == "message"][0]
    assert [e.token for e in final.content[0].logprobs] == [e.token for e in streamed]
    with pytest.raises(openai.BadRequestError) as error:
        client.responses.create(include=["message.output_text.logprobs"], top_logprobs=-1, **kwargs)
    assert error.value.body["param"] == "top_logprobs"


def test_tool_call_and_its_result(server, tokenizer):
    _, client = server
    first = client.responses.create(model=MODEL, input=QUESTION, tools=[WEATHER], tool_choice="required",
                                    max_output_tokens=150, temperature=0)
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1, first.output
    assert calls[0].name == "get_weather"
    assert isinstance(json.loads(calls[0].arguments)["city"], str)
    # the whole conversation sent back, as a client without stored responses does
    items = [{"role": "user", "content": QUESTION}, *[i.model_dump(exclude_none=True) for i in first.output],
             {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny, 21 C"}]
    second = client.responses.create(model=MODEL, input=items, tools=[WEATHER], max_output_tokens=6, temperature=0)
    assert second.status in ("completed", "incomplete")
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 64  # the earlier turn
    # the same turn through previous_response_id renders the same prompt
    chained = client.responses.create(model=MODEL, previous_response_id=first.id, tools=[WEATHER],
                                      input=[items[-1]], max_output_tokens=6, temperature=0)
    assert chained.usage.input_tokens == second.usage.input_tokens
    assert chained.output_text == second.output_text
    messages = [{"role": "user", "content": QUESTION},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": calls[0].call_id, "type": "function",
                     "function": {"name": "get_weather", "arguments": json.loads(calls[0].arguments)}}],
                 **({"reasoning_content": r} if (r := "".join(i.content[0].text for i in first.output
                                                              if i.type == "reasoning")) else {})},
                {"role": "tool", "tool_call_id": calls[0].call_id, "content": "sunny, 21 C"}]
    tools = [{"type": "function", "function": {k: WEATHER[k] for k in ("name", "description", "parameters")}}]
    assert second.usage.input_tokens == chat_prompt_tokens(tokenizer, messages, tools)


def test_store_false_and_bad_requests(server):
    _, client = server
    unstored = client.responses.create(model=MODEL, input="hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, input="again", previous_response_id=unstored.id, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.BadRequestError) as error:
        client.responses.create(model=MODEL, input="hi", tools=[{"type": "web_search"}])
    assert error.value.body["param"] == "tools.0.type"
    with pytest.raises(openai.BadRequestError) as error:
        client.responses.create(model=MODEL, input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": "data:,"}]}])
    assert error.value.body["param"] == "input.0.content.0"


def test_openai_agents_default_client(server):
    agents = pytest.importorskip("agents")
    base_url, _ = server
    agents.set_tracing_disabled(True)
    model = agents.OpenAIResponsesModel(model=MODEL, openai_client=AsyncOpenAI(base_url=f"{base_url}/v1",
                                                                               api_key="unused", max_retries=0))

    @agents.function_tool
    def get_weather(city: Annotated[str, Field(max_length=8)]) -> str:
        """Current weather in a city."""
        return f"sunny in {city}"

    tool_agent = agents.Agent(name="weather", model=model, tools=[get_weather], tool_use_behavior="stop_on_first_tool",
                              model_settings=agents.ModelSettings(tool_choice="required", max_tokens=150,
                                                                           temperature=0, parallel_tool_calls=False))
    # structured output (text.format json_schema): the grammar ends the answer, so it completes
    report_agent = agents.Agent(name="report", model=model, output_type=Report,
                                model_settings=agents.ModelSettings(max_tokens=150, temperature=0))

    async def run_both():
        return (await agents.Runner.run(tool_agent, QUESTION), await agents.Runner.run(report_agent, QUESTION))

    called, reported = asyncio.run(run_both())  # one event loop: the client's connections belong to it
    assert called.final_output.startswith("sunny in ")
    assert isinstance(reported.final_output, Report)


def test_tokenize_detokenize_version(server, tokenizer):
    base_url, _ = server
    text = "The quick brown fox"
    body = httpx.post(f"{base_url}/tokenize", json={"model": MODEL, "prompt": text, "return_token_strs": True}).json()
    assert body["tokens"] == tokenizer.encode(text) and body["count"] == len(body["tokens"])
    assert body["max_model_len"] > 0
    # vLLM's token_strs: the vocabulary's strings, which map back to the ids (decoded per token, the bytes of a
    # character were each U+FFFD)
    for prompt in (text, "€5 a 日本"):
        tokenized = httpx.post(f"{base_url}/tokenize", json={"prompt": prompt, "return_token_strs": True}).json()
        assert tokenized["token_strs"] == tokenizer.hf.convert_ids_to_tokens(tokenized["tokens"])
        assert tokenizer.hf.convert_tokens_to_ids(tokenized["token_strs"]) == tokenized["tokens"]
    messages = [{"role": "user", "content": text}]
    chat = httpx.post(f"{base_url}/tokenize", json={"messages": messages}).json()
    assert chat["tokens"] == tokenizer.encode(tokenizer.apply_chat_template(messages))
    assert httpx.post(f"{base_url}/detokenize", json={"tokens": body["tokens"]}).json() == {"prompt": text}
    missing = httpx.post(f"{base_url}/detokenize", json={})  # vLLM's DetokenizeRequest requires tokens
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "tokens"
    assert httpx.post(f"{base_url}/detokenize", json={"tokens": []}).json() == {"prompt": ""}
    bad = httpx.post(f"{base_url}/detokenize", json={"tokens": [1, 10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens.1"
    assert httpx.post(f"{base_url}/tokenize", json={}).status_code == 400
    assert isinstance(httpx.get(f"{base_url}/version").json()["version"], str)


@pytest.mark.parametrize("body, param", [
    ({"input": 5}, "input"),
    ({"input": [5]}, "input.0"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input.0.role"),
    ({"input": [{"type": "function_call", "name": "f"}]}, "input.0"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input.0.call_id"),
    ({"input": [{"type": "file_search_call"}]}, "input.0.type"),
    ({"input": "hi", "tools": [{"type": "function"}]}, "tools.0.name"),
    ({"input": "hi", "tool_choice": "required"}, "tool_choice"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "background": True}, "background"),
    ({"input": "hi", "temperature": "hot"}, "temperature"),
    ({"input": "hi", "top_k": -5}, "top_k"),
    ({"input": "hi", "seed": "x"}, "seed"),
    ({"input": "hi", "truncation": "sometimes"}, "truncation"),
])
def test_bad_responses_bodies_are_400s_naming_the_field(server, body, param):
    base_url, _ = server
    response = httpx.post(f"{base_url}/v1/responses", json={"model": MODEL, **body}, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["message"] and error["param"] == param
    assert httpx.get(f"{base_url}/health").status_code == 200


@pytest.mark.parametrize("fmt, words", [
    ({"type": "json_schema", "name": "x"}, "text.format.schema must be a JSON schema object"),
    ({"type": "grammar"}, "text.format.type must be 'text', 'json_object' or 'json_schema', got 'grammar'"),
])
def test_a_bad_text_format_message_names_the_responses_fields(server, fmt, words):
    """Hunt 166, bug 4: the message quoted the chat fields it became (`response_format.json_schema.schema`,
    `response_format.type`), which this request never sent."""
    base_url, _ = server
    response = httpx.post(f"{base_url}/v1/responses", json={"model": MODEL, "input": "hi", "text": {"format": fmt}},
                          timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "text.format" and words in error["message"]
    assert "response_format" not in error["message"]


_PLAIN = st.text(st.characters(codec="utf-8"), min_size=1, max_size=20)
_EDGE = st.sampled_from([
    None, True, 0, -1, 2**31, 2**64, 0.5, float("nan"), float("inf"), "", "x", "\ud800", [], [None], {}, [5],
    [{"type": "message"}], [{"role": "user", "content": [{"type": "input_image"}]}],
    [{"type": "function_call", "call_id": 5, "name": "f"}], [{"type": "function_call_output", "call_id": "c"}],
    [{"type": "function"}], {"type": "function", "name": "nope"}, {"format": {"type": "json_schema"}},
])
_ANY = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), _PLAIN),
                    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(_PLAIN, inner, max_size=3)),
                    max_leaves=8)
_ITEM = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "developer", "assistant"]),
                           "content": st.one_of(_PLAIN, st.lists(st.fixed_dictionaries(
                               {"type": st.sampled_from(["input_text", "output_text"]), "text": _PLAIN}),
                               min_size=1, max_size=2))}),
    st.fixed_dictionaries({"type": st.just("function_call"), "call_id": st.just("call_1"),
                           "name": st.just("get_weather"), "arguments": st.just('{"city": "Oslo"}')}),
    st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": st.just("call_1"), "output": _PLAIN}),
)
_VALID = {
    "model": st.just(MODEL), "instructions": _PLAIN, "temperature": st.floats(min_value=0, max_value=2),
    "top_p": st.floats(min_value=0.05, max_value=1), "tools": st.just([WEATHER]),
    "tool_choice": st.sampled_from(["none", "auto"]), "parallel_tool_calls": st.booleans(), "stream": st.booleans(),
    "store": st.booleans(), "text": st.just({"format": {"type": "text"}}), "metadata": st.just({"k": "v"}),
    "user": _PLAIN, "truncation": st.just("disabled"), "include": st.just([]),
}
_BODY = st.fixed_dictionaries({"input": st.one_of(_PLAIN, st.lists(_ITEM, min_size=1, max_size=3)),
                               "max_output_tokens": st.integers(min_value=1, max_value=6)}, optional=_VALID)
_FIELDS = st.sampled_from(sorted({*_VALID, "input", "max_output_tokens", "previous_response_id", "background",
                                  "conversation", "prompt", "reasoning"}))
_MUTATIONS = st.dictionaries(st.one_of(_FIELDS, _FIELDS, _PLAIN), st.one_of(_EDGE, _ANY), max_size=2)


def test_fuzzed_responses_requests_never_get_a_5xx(server):
    """40 requests or 30 s: valid bodies with up to two fields replaced by edge values or arbitrary JSON; every
    answer is a 2xx or a 4xx naming its field, and the engine's integrity check passes afterwards."""
    base_url, _ = server
    statuses: dict[int, int] = {}
    failures: list[str] = []
    deadline = time.monotonic() + 30

    @settings(max_examples=40, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(_BODY, _MUTATIONS)
    def one(body, mutations):
        if time.monotonic() > deadline:
            return
        body = {**body, **mutations}
        response = httpx.post(f"{base_url}/v1/responses", content=json.dumps(body),
                              headers={"content-type": "application/json"}, timeout=60)
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        if response.status_code >= 500:
            failures.append(f"{response.status_code} {body!r}: {response.text[:300]}")
        elif response.status_code >= 400 and response.json()["error"]["param"] is None:
            failures.append(f"{response.status_code} with no param {body!r}: {response.text[:300]}")

    one()
    print(f"\nresponses fuzz: statuses {dict(sorted(statuses.items()))}")
    assert not failures, "\n".join(failures[:10])
    assert statuses.get(200, 0) >= 4 and sum(statuses.values()) >= 20
    deadline = time.monotonic() + 30
    while True:  # the check needs an idle engine: aborted streams may still be winding down
        check = httpx.get(f"{base_url}/debug/engine", timeout=30)
        if check.status_code != 409 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert check.status_code == 200 and check.json()["integrity"] == "ok", check.text


def test_reasoning_effort_reaches_the_template_and_stream_may_be_null():
    """A Responses request's `reasoning.effort` was dropped (a chat request's `reasoning_effort` reaches the chat
    template as vLLM passes it), and `stream: null` was a 400 (vLLM's Optional[bool]); found by a review."""
    from hybridcache.server.responses_api import ResponsesRequest, chat_request

    body = ResponsesRequest.model_validate({"input": "hi", "reasoning": {"effort": "high", "summary": "auto"},
                                            "stream": None})
    assert not body.stream
    messages = [{"role": "user", "content": "hi"}]
    assert chat_request(body, messages)["reasoning_effort"] == "high"
    assert "reasoning_effort" not in chat_request(ResponsesRequest.model_validate({"input": "hi"}), messages)
    with pytest.raises(ValueError, match="effort"):
        ResponsesRequest.model_validate({"input": "hi", "reasoning": {"effort": "bogus"}})
