"""The served families' tool-call parsers through a real server on the built-in model (its text forced with guided
regexes, as the nemotron_json tests do): `tool_calls` whole and streamed for each of kimi_k2, jamba, lfm2, olmo3,
pythonic and granite4; a forced call (tool_choice "required" or named) in Jamba's, Kimi's and the Python-call
formats' own syntax, refused with a 400 naming the problem where a schema cannot be written in a Python call. And
the special-token path: a tokenizer whose tool-call tags are special tokens keeps them for the parser and drops the
other special tokens."""

from __future__ import annotations

import ast
import json
import re
import shutil

import httpx
import jsonschema
import pytest
from openai import OpenAI
from transformers import AutoTokenizer

from hybridcache.guided_kimi import TAGS as SECTION_TAGS
from hybridcache.models.builtin import BUILTIN_NAME, ensure_builtin_model
from hybridcache.server.chat_output import ChatOutputOptions, final_message
from hybridcache.server.special_tokens import special_token_texts, strippable
from hybridcache.server.tool_formats import tool_format
from hybridcache.tokenizer import Tokenizer

from .inprocess_server import serving
from .test_tool_formats import CALLS, SAMPLES, TOOLS

MODEL = BUILTIN_NAME
REPLIES = {**SAMPLES, "pythonic": "[get_weather(city='Paris', days=2), get_time(zone='utc')]"}
CONTENT = {parser: "" if parser == "pythonic" else "Let me check." for parser in REPLIES}
MESSAGES = [{"role": "user", "content": "weather and time?"}]


def _stream_message(stream) -> tuple[str, list[tuple[str, dict]], str | None]:
    content, calls, finish = "", {}, None
    for event in stream:
        if not event.choices:
            continue
        delta = event.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or []:
            entry = calls.setdefault(call.index, {"name": "", "arguments": ""})
            entry["name"] += call.function.name or ""
            entry["arguments"] += call.function.arguments or ""
        finish = event.choices[0].finish_reason or finish
    return content, [(calls[i]["name"], json.loads(calls[i]["arguments"])) for i in sorted(calls)], finish


@pytest.mark.parametrize("parser", list(REPLIES))
def test_each_parser_gives_tool_calls_whole_and_streamed(parser):
    forced = {"guided_regex": re.escape(REPLIES[parser])}
    with serving(tool_call_parser=parser) as base_url:
        client = OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)
        response = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=300,
                                                  temperature=0, extra_body=forced)
        choice = response.choices[0]
        assert (choice.message.content or "") == CONTENT[parser] and choice.finish_reason == "tool_calls"
        assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == CALLS
        stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=300,
                                                temperature=0, stream=True, extra_body=forced)
        assert _stream_message(stream) == (CONTENT[parser], CALLS, "tool_calls")
        if parser == "kimi_k2":
            assert [c.id for c in choice.message.tool_calls] == ["functions.get_weather:0", "functions.get_time:1"]


# a tool whose arguments end quickly (a random model's free strings may run past max_tokens)
CLOSED = [{"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"unit": {"enum": ["c", "f"]}}, "required": ["unit"],
    "additionalProperties": False}}}]


def _required_call(parser: str, content: str, max_tokens: int) -> tuple[dict, str]:
    """A greedy chat request forcing a call of CLOSED's tool with `--tool-call-parser parser`: its choice and the
    text of every token it generated (special tokens included)."""
    with serving(tool_call_parser=parser) as base_url:
        body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "tools": CLOSED,
                "max_tokens": max_tokens, "temperature": 0, "tool_choice": "required", "return_token_ids": True}
        choice = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=120).raise_for_status().json()[
            "choices"][0]
    return choice, Tokenizer(ensure_builtin_model()).decode(choice["token_ids"])


def test_a_forced_call_with_jamba_is_written_in_jambas_format():
    choice, text = _required_call("jamba", "time?", 200)
    assert text.startswith("<tool_calls>[{") and text.endswith("}]</tool_calls>"), text
    assert [call["function"]["name"] for call in choice["message"]["tool_calls"]] == ["get_time"]
    assert choice["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_a_forced_call_with_kimi_k2_is_written_in_kimis_section(tool_choice):
    """tool_choice "required" (one call: parallel_tool_calls false) or a named function, with `--tool-call-parser
    kimi_k2`: the output is Kimi's section (no white space, the call's id numbered from 0), read back as the call
    with the model's id; a named function finishes with "stop", "required" with "tool_calls"."""
    with serving(tool_call_parser="kimi_k2") as base_url:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "time?"}], "tools": CLOSED,
                "max_tokens": 300, "temperature": 0, "tool_choice": tool_choice, "parallel_tool_calls": False,
                "return_token_ids": True}
        choice = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=120).raise_for_status().json()[
            "choices"][0]
    text = Tokenizer(ensure_builtin_model()).decode(choice["token_ids"])
    assert re.fullmatch(r"<\|tool_calls_section_begin\|><\|tool_call_begin\|>functions\.get_time:0"
                        r'<\|tool_call_argument_begin\|>\{"unit": "[cf]"\}<\|tool_call_end\|>'
                        r"<\|tool_calls_section_end\|>", text), text
    message = choice["message"]
    assert message["content"] == "" and [(c["id"], c["function"]["name"]) for c in message["tool_calls"]] == [
        ("functions.get_time:0", "get_time")]
    assert json.loads(message["tool_calls"][0]["function"]["arguments"])["unit"] in ("c", "f")
    assert choice["finish_reason"] == ("tool_calls" if tool_choice == "required" else "stop")


# a tool whose every value is bounded (a random model's free strings may run past max_tokens), with values Python
# writes otherwise than JSON (True / False / None), nested in a dict too
SETTINGS = {"type": "function", "function": {"name": "set_mode", "parameters": {
    "type": "object", "properties": {
        "mode": {"enum": ["on", "off"]}, "level": {"type": "integer", "minimum": 0, "maximum": 9},
        "quiet": {"type": "boolean"}, "note": {"type": "null"},
        "opts": {"type": "object", "properties": {"fast": {"type": "boolean"}}, "required": ["fast"],
                 "additionalProperties": False},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
    "required": ["mode", "level", "quiet", "note", "opts"], "additionalProperties": False}}}
PYTHON_CALLS = {"lfm2": r"<\|tool_call_start\|>\[(.*)\]<\|tool_call_end\|>",
                "olmo3": r"<function_calls>(.*)</function_calls>", "pythonic": r"\[(.*)\]"}


def _python_calls(text: str) -> list[tuple[str, dict]]:
    """The calls of a Python call list, read independently of the server's parser: `ast.literal_eval` of each
    keyword's value."""
    return [(call.func.id, {k.arg: ast.literal_eval(k.value) for k in call.keywords})
            for call in ast.parse(f"[{text}]", mode="eval").body.elts]


@pytest.mark.parametrize("parser", list(PYTHON_CALLS))
def test_a_forced_call_with_a_python_call_parser_is_written_as_python_calls(parser):
    """tool_choice "required" (one call) or a named function, with `--tool-call-parser` lfm2, olmo3 or pythonic (it
    was a 400): the output is the format's Python call with the schema's keywords, values as Python literals
    (`True`, `None`), read back as the calls with JSON arguments valid for the schema, whole and streamed; "required"
    finishes with "tool_calls", a named function with "stop"."""
    tools = [SETTINGS, *CLOSED]
    schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in tools}
    with serving(tool_call_parser=parser) as base_url:
        client = OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)
        for tool_choice in ("required", {"type": "function", "function": {"name": "set_mode"}}):
            body = {"model": MODEL, "messages": [{"role": "user", "content": "set it"}], "tools": tools,
                    "max_tokens": 300, "temperature": 0, "tool_choice": tool_choice, "parallel_tool_calls": False,
                    "return_token_ids": True}
            choice = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=120).raise_for_status(
            ).json()["choices"][0]
            text = Tokenizer(ensure_builtin_model()).decode(choice["token_ids"])
            written = re.fullmatch(PYTHON_CALLS[parser], text, re.S)
            assert written is not None and "true" not in written.group(1), text
            wanted = _python_calls(written.group(1))
            calls = [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                     for c in choice["message"]["tool_calls"]]
            assert calls == wanted and len(calls) == 1, text
            for name, arguments in calls:
                jsonschema.validate(arguments, schemas[name])
            if isinstance(tool_choice, dict):
                assert calls[0][0] == "set_mode" and "None" in text and "opts={" in text, text
            assert choice["finish_reason"] == ("tool_calls" if tool_choice == "required" else "stop")
            assert choice["message"]["content"] in ("", None)
            stream = client.chat.completions.create(**{k: v for k, v in body.items() if k != "return_token_ids"},
                                                    stream=True)
            assert _stream_message(stream) == ("", calls, choice["finish_reason"])


def test_python_calls_required_with_parallel_calls_may_write_several():
    """With parallel calls "required" is one or more calls; each one the server reads back is a valid call."""
    choice, text = _required_call("lfm2", "set it", 400)
    written = re.fullmatch(PYTHON_CALLS["lfm2"], text, re.S)
    assert written is not None, text
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in choice["message"]["tool_calls"]]
    assert calls == _python_calls(written.group(1)) and choice["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("parser", list(PYTHON_CALLS))
def test_a_forced_python_call_is_refused_where_its_grammar_cannot_hold_the_schema(parser):
    """A schema keyword only llguidance would enforce (`multipleOf`: llguidance writes JSON values only) and a name
    a Python call cannot carry are 400s that name the problem; tool_choice "auto" still serves."""
    step = {"type": "function", "function": {"name": "step", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "multipleOf": 5}}, "required": ["n"]}}}
    dashed = {"type": "function", "function": {"name": "get-time", "parameters": {"type": "object"}}}
    with serving(tool_call_parser=parser) as base_url:
        for tools, problem in (([step], "multipleOf"), ([dashed], "'get-time'")):
            body = {"model": MODEL, "messages": MESSAGES, "tools": tools, "max_tokens": 20, "tool_choice": "required"}
            response = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=120)
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert problem in error["message"] and "Python" in error["message"], error
            assert error["param"] == "tool_choice", error
        auto = {"model": MODEL, "messages": MESSAGES, "tools": [step], "max_tokens": 5, "tool_choice": "auto"}
        assert httpx.post(f"{base_url}/v1/chat/completions", json=auto, timeout=120).status_code == 200


# --- the tags as special tokens ------------------------------------------------------------------------------------

KIMI_TAGS = list(tool_format("kimi_k2").tags)


@pytest.fixture(scope="module")
def special_tokenizer(tmp_path_factory):
    """The built-in model's tokenizer with Kimi's tags and an end-of-turn token added as special tokens."""
    hf = AutoTokenizer.from_pretrained(ensure_builtin_model())
    hf.add_special_tokens({"additional_special_tokens": [*KIMI_TAGS, "<|im_end|>"]})
    folder = tmp_path_factory.mktemp("special_tokenizer")
    hf.save_pretrained(folder)
    return Tokenizer(folder)


def test_tags_that_are_special_tokens_are_kept_for_the_parser_and_other_special_tokens_dropped(special_tokenizer):
    specials = special_token_texts(special_tokenizer.hf)
    assert set(KIMI_TAGS) | {"<|im_end|>"} <= specials
    ids = special_tokenizer.encode(SAMPLES["kimi_k2"] + "<|im_end|>")
    assert special_tokenizer.decode(ids) == "Let me check." + 'functions.get_weather:0{"city": "Paris", "days": 2}' \
        'functions.get_time:1{"zone": "utc"}'  # (the default decode loses the tags: no call could be read)
    strip = strippable(specials, tool_format("kimi_k2").tags)
    assert strip is not None and "<|im_end|>" in strip and not set(KIMI_TAGS) & set(strip)
    options = ChatOutputOptions(parse_tools=True, tools=TOOLS, tool_call_parser="kimi_k2", strip_tokens=strip)
    message = final_message(special_tokenizer.decode(ids, skip_special_tokens=False), options)
    assert message["content"] == "Let me check."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == CALLS
    plain = "Hi<|im_end|> there<|im_end|>"
    assert final_message(plain, options)["content"] == "Hi there"
    # the Qwen parsers' tags are not special here: the request is decoded as it asks
    assert strippable(specials, tool_format("hermes").tags) is None
    assert strippable(specials, ()) is None


EXTRA = "<|extra_0|>"  # a special token that is no tag: the message must not show it


@pytest.fixture(scope="module")
def kimi_tokens_folder(tmp_path_factory) -> str:
    """A copy of the built-in model whose tokenizer has Kimi's tags and `EXTRA` as special added tokens (ids past
    the tokenizer's 259, inside the model's 320 rows), as Kimi's own tokenizer has its tags."""
    folder = tmp_path_factory.mktemp("kimi_tokens") / "model"
    shutil.copytree(ensure_builtin_model(), folder)
    hf = AutoTokenizer.from_pretrained(folder)
    hf.add_special_tokens({"additional_special_tokens": [*KIMI_TAGS, EXTRA]})
    hf.save_pretrained(folder)
    return str(folder)


def _special_ids(folder: str) -> dict[str, int]:
    hf = AutoTokenizer.from_pretrained(folder)
    ids = dict(zip([*KIMI_TAGS, EXTRA], hf.convert_tokens_to_ids([*KIMI_TAGS, EXTRA])))
    assert len(set(ids.values())) == len(ids) and min(ids.values()) >= 259 and ids.keys() <= special_token_texts(hf)
    return ids


@pytest.mark.parametrize("forced_by", ["guided_regex", "tool_choice"])
def test_tags_generated_as_special_tokens_reach_the_parser_end_to_end(kimi_tokens_folder, forced_by):
    """A served tokenizer whose Kimi tags are special tokens, the model's output forced (a guided regex, or a forced
    call) and the tags and `EXTRA` made its choice wherever the grammar allows them (logit_bias), so they are
    generated as the special tokens' ids: the response carries the calls (a decode that skipped special tokens
    would leave `functions.get_time:0{...}` as content) and no special-token text (`EXTRA` is taken out)."""
    ids = _special_ids(kimi_tokens_folder)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "time?"}], "tools": CLOSED, "max_tokens": 300,
            "temperature": 0, "return_token_ids": True, "logit_bias": {str(i): 100 for i in ids.values()}}
    if forced_by == "guided_regex":
        section = ('<|tool_calls_section_begin|><|tool_call_begin|>functions.get_time:0<|tool_call_argument_begin|>'
                   '{"unit": "c"}<|tool_call_end|><|tool_calls_section_end|>')
        body["guided_regex"] = re.escape(f"Let me{EXTRA} check." + section)
        content, finish = "Let me check.", "tool_calls"
    else:
        body.update(tool_choice={"type": "function", "function": {"name": "get_time"}})
        content, finish = "", "stop"
    with serving(tool_call_parser="kimi_k2", model_path=kimi_tokens_folder) as base_url:
        choice = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=120).raise_for_status().json()[
            "choices"][0]
    generated = set(choice["token_ids"])
    assert {ids[tag] for tag in SECTION_TAGS} <= generated, choice["token_ids"]  # (the tags as special tokens)
    assert (ids[EXTRA] in generated) is (forced_by == "guided_regex")
    message = choice["message"]
    assert message["content"] == content and choice["finish_reason"] == finish
    assert [(c["id"], c["function"]["name"]) for c in message["tool_calls"]] == [("functions.get_time:0", "get_time")]
    assert json.loads(message["tool_calls"][0]["function"]["arguments"])["unit"] in ("c", "f")
