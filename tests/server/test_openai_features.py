"""Tools, reasoning, logprobs, sampling controls, structured output and batched prompts, through the `openai`
client against a real server on the built-in model (random weights: tests force the shapes they need with
`tool_choice` or guided decoding, which run the same parsers a real model's text would)."""

import concurrent.futures
import json
import random
import re

import jsonschema
import pytest
from openai import OpenAI

from hybridcache.models.builtin import BUILTIN_NAME

from .inprocess_server import serving

MODEL = BUILTIN_NAME
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "current weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}},
                                       "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client():
    with serving(reasoning_parser="qwen3") as base_url:
        yield OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def _check_call(call, tools=TOOLS):
    schema = next(t["function"]["parameters"] for t in tools if t["function"]["name"] == call.function.name)
    jsonschema.validate(json.loads(call.function.arguments), schema)
    assert call.type == "function" and call.id.startswith("call_")


def _tool_turn(messages, call, result):
    return [*messages,
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": call.id, "type": "function",
                 "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
            {"role": "tool", "tool_call_id": call.id, "content": result}]


def _stream_message(stream):
    """Accumulate a streamed chat choice 0 as the client would: content, reasoning, tool calls by index."""
    content, reasoning, calls, finish = "", "", {}, None
    for event in stream:
        if not event.choices:
            continue
        choice = event.choices[0]
        delta = choice.delta
        content += delta.content or ""
        reasoning += getattr(delta, "reasoning_content", None) or ""
        for call in delta.tool_calls or []:
            entry = calls.setdefault(call.index, {"id": None, "name": "", "arguments": ""})
            entry["id"] = call.id or entry["id"]
            entry["name"] += call.function.name or ""
            entry["arguments"] += call.function.arguments or ""
        finish = choice.finish_reason or finish
    return content, reasoning, [calls[i] for i in sorted(calls)], finish


def test_tool_round_trip(client):
    first = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=120, temperature=0.8, seed=1)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    _check_call(call)
    messages = _tool_turn(USER, call, '{"temperature": 21}')
    final = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="none",
                                           max_tokens=8, temperature=0)
    assert final.choices[0].message.tool_calls is None
    assert final.choices[0].finish_reason in ("stop", "length") and final.choices[0].message.content is not None
    # the second turn's prompt starts with the first turn's prompt and the call as generated: the cache covers both
    covered = first.usage.prompt_tokens + first.usage.completion_tokens - 1  # the last token was never fed back
    assert final.usage.prompt_tokens_details.cached_tokens >= covered


def test_tool_round_trip_streamed(client):
    stream = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, tool_choice="required",
                                            parallel_tool_calls=False, max_tokens=120, temperature=0.8, seed=2,
                                            stream=True)
    content, _, calls, finish = _stream_message(stream)
    assert finish == "tool_calls" and len(calls) == 1 and content == ""
    call = calls[0]
    schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == call["name"])
    jsonschema.validate(json.loads(call["arguments"]), schema)
    messages = [*USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call["id"], "type": "function", "function": {"name": call["name"], "arguments": call["arguments"]}}]},
        {"role": "tool", "tool_call_id": call["id"], "content": "sunny"}]
    stream = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=6,
                                            temperature=0, stream=True, response_format={"type": "text"},
                                            extra_body={"guided_regex": "[a-z]{6}"})
    content, _, calls, finish = _stream_message(stream)
    assert re.fullmatch("[a-z]{6}", content) and calls == [] and finish in ("stop", "length")


def test_named_tool_choice_calls_that_tool(client):
    for seed in range(3):
        response = client.chat.completions.create(
            model=MODEL, messages=USER, tools=TOOLS, max_tokens=120, temperature=1.0, seed=seed,
            tool_choice={"type": "function", "function": {"name": "get_time"}})
        (call,) = response.choices[0].message.tool_calls
        assert call.function.name == "get_time"
        _check_call(call)


CALL_TEXT = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "utc"}}\n</tool_call>'


def test_auto_parses_calls_and_none_leaves_text(client):
    forced = {"guided_regex": re.escape(CALL_TEXT)}
    auto = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, max_tokens=80, temperature=0,
                                          extra_body=forced)
    (call,) = auto.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_time", {"zone": "utc"})
    assert auto.choices[0].finish_reason == "tool_calls" and auto.choices[0].message.content is None
    none = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, tool_choice="none",
                                          max_tokens=80, temperature=0, extra_body=forced)
    assert none.choices[0].message.tool_calls is None and none.choices[0].message.content == CALL_TEXT
    assert none.choices[0].finish_reason == "stop"


def test_tool_choice_errors(client):
    import openai

    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS,
                                       tool_choice={"type": "function", "function": {"name": "nope"}})
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        client.chat.completions.create(model=MODEL, messages=USER, tool_choice="required")


THINKING = "<think>\n[a-z]{3,10}( [a-z]{2,6}){0,3}\n</think>\n\n[a-z]{2,8}"


def test_reasoning_split(client):
    response = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=80, temperature=1.0, seed=3,
                                              extra_body={"guided_regex": THINKING})
    message = response.choices[0].message
    assert re.fullmatch("[a-z]{3,10}( [a-z]{2,6}){0,3}", message.reasoning_content)
    assert re.fullmatch("[a-z]{2,8}", message.content)
    stream = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=80, temperature=1.0, seed=3,
                                            stream=True, extra_body={"guided_regex": THINKING})
    content, reasoning, _, finish = _stream_message(stream)
    assert (reasoning, content) == (message.reasoning_content, message.content) and finish == "stop"


def test_enable_thinking_false_reaches_the_template(client):
    response = client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=10, temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}, "guided_regex": "[a-z]{4}"})
    thinking_off = response.usage.prompt_tokens
    plain = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=1, temperature=0)
    assert thinking_off == plain.usage.prompt_tokens + len("<think>\n\n</think>\n\n")
    assert response.choices[0].message.reasoning_content is None


def test_chat_logprobs(client):
    response = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=5, temperature=0,
                                              logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    entries = response.choices[0].logprobs.content
    assert len(entries) == 5
    for entry in entries:
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token  # greedy: the chosen token is the likeliest
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob >= entry.top_logprobs[2].logprob
    # a token inside a character is "" until the one that completes it (vLLM's); bytes that never form one are
    # U+FFFD in the text
    assert "".join(e.token for e in entries) == response.choices[0].message.content.replace("\ufffd", "")
    stream = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=5, temperature=0, stream=True,
                                            logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    streamed = [e for event in stream if event.choices and event.choices[0].logprobs
                for e in event.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 5)) for e in streamed] == [(e.token, round(e.logprob, 5)) for e in entries]


def test_completion_logprobs_echo_and_batched_prompts(client):
    response = client.completions.create(model=MODEL, prompt=["ab", "cd"], n=2, max_tokens=3, temperature=0,
                                         logprobs=2, echo=True, extra_body={"ignore_eos": True})
    assert [c.index for c in response.choices] == [0, 1, 2, 3]
    assert [c.text[:2] for c in response.choices] == ["ab", "ab", "cd", "cd"]
    for c in response.choices:
        # echo: the prompt's two tokens lead (the first with no logprob), then the three generated ones
        assert c.logprobs.tokens[:2] == list(c.text[:2]) and len(c.logprobs.tokens) == 5
        assert c.logprobs.text_offset[:3] == [0, 1, 2]
        assert c.logprobs.token_logprobs[0] is None and c.logprobs.top_logprobs[0] is None
        assert all(lp <= 0 for lp in c.logprobs.token_logprobs[1:])
        # top_logprobs maps token text to logprob: byte tokens that decode to the same U+FFFD share an entry;
        # a prompt token's holds the token itself and the two likeliest
        assert 1 <= len(c.logprobs.top_logprobs[1]) <= 3
        assert all(1 <= len(top) <= 2 for top in c.logprobs.top_logprobs[2:])
    assert response.usage.completion_tokens == 12
    stream = client.completions.create(model=MODEL, prompt=["ab", "cd"], n=2, max_tokens=3, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    texts = {}
    for event in stream:
        for c in event.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert texts == {c.index: c.text[2:] for c in response.choices}


def test_logit_bias_min_tokens_and_penalties(client, tokenizer):
    (z,) = tokenizer.encode("z")
    response = client.completions.create(model=MODEL, prompt="hi", max_tokens=4, temperature=0,
                                         logit_bias={str(z): 100})
    assert response.choices[0].text == "zzzz"
    (im_end,) = [t for t in tokenizer.encode("<|im_end|>")]
    response = client.completions.create(model=MODEL, prompt="hi", max_tokens=10, temperature=0,
                                         logit_bias={str(im_end): 100}, extra_body={"min_tokens": 3})
    assert response.usage.completion_tokens == 4 and response.choices[0].finish_reason == "stop"
    # a strong presence penalty forbids repeats: greedy biased towards "z" must move on after one "z"
    response = client.completions.create(model=MODEL, prompt="hi", max_tokens=3, temperature=0,
                                         logit_bias={str(z): 5}, presence_penalty=2.0, frequency_penalty=2.0,
                                         extra_body={"repetition_penalty": 1.5, "min_p": 0.1})
    assert response.choices[0].text.count("z") <= 1


def _random_schema(rng: random.Random, depth: int = 0) -> dict:
    kinds = ["string", "integer", "boolean", "enum", "array", "number"] + (["object"] if depth < 2 else [])
    kind = rng.choice(kinds)
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(1, 6)}
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 100)}
    if kind == "number":
        return {"type": "number", "minimum": -10, "maximum": 10}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "x", "yz"], rng.randint(1, 3))}
    if kind == "array":
        return {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                "maxItems": rng.randint(1, 3)}
    names = rng.sample(["a", "b", "c", "id", "name", "ok"], rng.randint(1, 3))
    properties = {name: _random_schema(rng, depth + 1) for name in names}
    required = [name for name in names if rng.random() < 0.7]
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


@pytest.mark.parametrize("n", [1, 4])
def test_json_schema_responses_validate(client, n):
    """50 random schemas, sent 8 at a time (the engine batches them; each request's grammar is its own)."""
    rng = random.Random(n)
    schemas = []
    for i in range(50):
        schema = {"type": "object", "properties": {"v": _random_schema(rng)}, "required": ["v"]}
        if i % 2:
            schema = _random_schema(rng, depth=0)  # any type at the top, objects nested up to 2 levels
        schemas.append(schema)

    def ask(i: int):
        return client.chat.completions.create(
            model=MODEL, messages=USER, max_tokens=400, temperature=1.0, seed=i, n=n,
            response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schemas[i]}})

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(ask, range(len(schemas))))
    for schema, response in zip(schemas, responses, strict=True):
        assert len(response.choices) == n
        for choice in response.choices:
            assert choice.finish_reason == "stop", (schema, choice.message.content)
            jsonschema.validate(json.loads(choice.message.content), schema)


def test_json_object(client):
    response = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=200, temperature=1.0, seed=5,
                                              response_format={"type": "json_object"})
    assert isinstance(json.loads(response.choices[0].message.content), dict)


def test_five_turn_agent_conversation_keeps_hitting_the_cache(client):
    messages = [{"role": "system", "content": "You are an agent."}, *USER]
    previous_total = 0
    for turn in range(5):
        response = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS,
                                                  tool_choice="required", parallel_tool_calls=False, max_tokens=120,
                                                  temperature=1.0, seed=turn)
        (call,) = response.choices[0].message.tool_calls
        if turn:
            # everything before this turn's new tool result: the previous prompt and the call it generated, except
            # that call's last token (sampled, so never run through the model)
            assert response.usage.prompt_tokens_details.cached_tokens >= previous_total - 1, (turn, response.usage)
        previous_total = response.usage.prompt_tokens + response.usage.completion_tokens
        messages = _tool_turn(messages, call, f"result {turn}")
