"""`--tool-call-parser nemotron_json`: NVIDIA Nemotron-Nano-9B-v2's `<TOOLCALL>[{"name": ..., "arguments": ...},
...]</TOOLCALL>` read into OpenAI `tool_calls`, whole and streamed, by the parser (`tool_parsers`), the chat output
(`chat_output`) and a real server on the built-in model (its text forced with guided regexes) through
/v1/chat/completions, /v1/messages and /v1/responses; without the flag the block is text, as before."""

from __future__ import annotations

import json
import random
import re

import httpx
import pytest
from openai import OpenAI

from hybridcache.cli import build_parser
from hybridcache.models.builtin import BUILTIN_NAME, ensure_builtin_model
from hybridcache.server.chat_output import ChatOutputOptions, ChoiceStream, final_message
from hybridcache.server.cli import server_config
from hybridcache.server.reasoning import ReasoningParser
from hybridcache.server.tool_parsers import ToolCallStream, parse_tool_calls
from hybridcache.tokenizer import Tokenizer

from .inprocess_server import serving

MODEL = BUILTIN_NAME
NEMOTRON = "nemotron_json"
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}}}}
TOOLS = [WEATHER, TIME]
# as the model writes a turn with two calls: text, then one block holding the list
BLOCK = ('<TOOLCALL>[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
         '{"name": "get_time", "arguments": {"zone": "utc"}}]</TOOLCALL>')
TEXT = "Let me look that up.\n" + BLOCK
CALLS = [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "utc"})]


def _calls(parsed) -> list[tuple[str, dict]]:
    return [(call.name, json.loads(call.arguments)) for call in parsed.tool_calls]


def _options(**fields) -> ChatOutputOptions:
    return ChatOutputOptions(parse_tools=True, tools=TOOLS, **{"tool_call_parser": NEMOTRON, **fields})


def _streamed(text: str, options: ChatOutputOptions, seed: int) -> tuple[str, list[tuple[int, str, dict]]]:
    """The content and (index, name, arguments) of `text` fed to a `ChoiceStream` in random pieces."""
    rng = random.Random(seed)
    stream, content, calls, at = ChoiceStream(options), "", [], 0
    while at < len(text):
        at = min(len(text), at + rng.randint(1, 7))
        delta = stream.update(text[:at], finished=at == len(text))
        content += delta.content
        calls += [(i, call.name, json.loads(call.arguments)) for i, call in delta.tool_calls]
    return content, calls


def test_a_list_of_calls_is_one_call_each_with_its_own_id():
    parsed = parse_tool_calls(TEXT + "\ntext after the block is dropped", TOOLS, NEMOTRON)
    assert parsed.content == "Let me look that up."
    assert _calls(parsed) == CALLS
    ids = [call.id for call in parsed.tool_calls]
    assert len(set(ids)) == 2 and all(i.startswith("call_") for i in ids)


@pytest.mark.parametrize("parser", [None, "hermes", "qwen3_coder"])
def test_without_nemotron_json_the_block_is_content(parser):
    """Other models' text is untouched: `<TOOLCALL>` is read only with the nemotron_json parser."""
    parsed = parse_tool_calls(TEXT, TOOLS, parser)
    assert parsed.content == TEXT and parsed.tool_calls == ()
    content, calls = _streamed(TEXT, _options(tool_call_parser=parser), seed=0)
    assert content == TEXT and calls == []


@pytest.mark.parametrize("body", ['[{"name": "get_weather", "arguments": {"city": "Paris"}}',
                                  '{"name": "get_weather", "arguments": {"city": "Paris"}}'],
                         ids=["no-closing-bracket", "no-brackets"])
def test_a_body_without_its_brackets_is_read_as_nvidias_parser_reads_it(body):
    parsed = parse_tool_calls(f"<TOOLCALL>{body}</TOOLCALL>", TOOLS, NEMOTRON)
    assert parsed.content == "" and _calls(parsed) == CALLS[:1]


def test_arguments_as_text_stay_text_and_a_closing_tag_inside_an_argument_does_not_end_the_block():
    text = ('<TOOLCALL>[{"name": "get_weather", "arguments": {"city": "a</TOOLCALL>b"}}, '
            '{"name": "get_time", "arguments": "{\\"zone\\": \\"cet\\"}"}]</TOOLCALL>')
    parsed = parse_tool_calls(text, TOOLS, NEMOTRON)
    assert _calls(parsed) == [("get_weather", {"city": "a</TOOLCALL>b"}), ("get_time", {"zone": "cet"})]
    assert parsed.tool_calls[1].arguments == '{"zone": "cet"}'
    content, calls = _streamed(text, _options(), seed=1)
    assert content == "" and [c[1:] for c in calls] == _calls(parsed)


MALFORMED = ["<TOOLCALL>[not json]</TOOLCALL>", "<TOOLCALL>[]</TOOLCALL>", '<TOOLCALL>[{"name": 3}]</TOOLCALL>',
             '<TOOLCALL>[{"name": "get_time", "arguments": {}}, 5]</TOOLCALL>', '<TOOLCALL>"get_time"</TOOLCALL>',
             "<TOOLCALL>[{\"name\": \"get_time\", \"argu"]


@pytest.mark.parametrize("block", MALFORMED, ids=["not-json", "empty", "name-not-text", "an-item-not-a-call",
                                                  "a-string", "cut-short"])
def test_a_block_that_does_not_parse_stays_content(block):
    text = "Hmm. " + block + " the end"
    parsed = parse_tool_calls(text, TOOLS, NEMOTRON)
    assert parsed.content == text and parsed.tool_calls == ()
    assert _streamed(text, _options(), seed=2) == (text, [])


def test_a_broken_block_then_a_good_one():
    text = "<TOOLCALL>[oops]</TOOLCALL>\n" + BLOCK
    parsed = parse_tool_calls(text, TOOLS, NEMOTRON)
    assert parsed.content == "<TOOLCALL>[oops]</TOOLCALL>" and _calls(parsed) == CALLS


def test_qwen_blocks_are_still_read_with_nemotron_json():
    """Qwen3's blocks (what a forced call was written in before) are still read with nemotron_json."""
    text = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "utc"}}\n</tool_call>'
    assert _calls(parse_tool_calls(text, TOOLS, NEMOTRON)) == CALLS[1:]


def test_an_unclosed_final_block_is_parsed_as_if_closed():
    parsed = parse_tool_calls(TEXT[: -len("</TOOLCALL>")], TOOLS, NEMOTRON)
    assert parsed.content == "Let me look that up." and _calls(parsed) == CALLS


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("text", [TEXT, "Sure: " + BLOCK + "\n\nDone.", "a <TOOL b </TOOLCALL> c <TOOLCALLX"],
                         ids=["content-then-block", "block-then-text", "partial-tags-only"])
def test_streamed_pieces_add_up_to_the_final_message(text, seed):
    message = final_message(text, _options())
    content, calls = _streamed(text, _options(), seed)
    assert content == (message["content"] or "")
    wanted = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message.get("tool_calls", [])]
    assert [c[1:] for c in calls] == wanted and [c[0] for c in calls] == list(range(len(calls)))


def test_streaming_holds_a_possible_block_start_and_sends_the_calls_when_the_block_closes():
    stream = ToolCallStream(TOOLS, NEMOTRON)
    assert stream.feed("Checking <TOOL", finished=False) == "Checking"
    assert stream.feed("Checking <TOOLCALL>[{", finished=False) == ""
    body = TEXT.replace("Let me look that up.\n", "Checking ")
    assert stream.feed(body[:-1], finished=False) == "" and stream.new_calls() == []
    assert stream.feed(body, finished=False) == ""
    assert [(i, c.name) for i, c in stream.new_calls()] == [(0, "get_weather"), (1, "get_time")]


def test_parallel_tool_calls_false_keeps_the_first_call_streamed_and_not():
    options = _options(parallel_tool_calls=False)
    message = final_message(TEXT, options)
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather"]
    assert [c[:2] for c in _streamed(TEXT, options, seed=3)[1]] == [(0, "get_weather")]


def test_nvidias_command_line_reaches_the_server_config():
    """NVIDIA's vLLM recipe for Nemotron-Nano-9B-v2 (the plugin file is not loaded: the parser is built in)."""
    args = build_parser().parse_args(["serve", "--enable-auto-tool-choice", "--tool-parser-plugin",
                                      "nemotron_toolcall_parser_no_streaming.py", "--tool-call-parser", NEMOTRON])
    assert server_config(args, ("m",)).tool_call_parser == NEMOTRON
    assert server_config(build_parser().parse_args(["serve"]), ("m",)).tool_call_parser is None


@pytest.mark.parametrize("parser", list(ReasoningParser))
def test_a_toolcall_block_in_an_unclosed_think_block_stays_reasoning_as_in_vllm(parser):
    """Only `</think>` ends the reasoning before a `<TOOLCALL>` block: vLLM's reasoning parsers that pair with
    nemotron_json (nemotron_v3 and deepseek_r1, which NVIDIA's nano plugins subclass) do not end it at a tool call,
    unlike Qwen's genuine `<tool_call>` (every parser here) and Kimi's section (kimi_k2). A block the model writes
    inside an open think block is reasoning, whole and streamed; closed first, it is the message's calls."""
    options = _options(split_reasoning=True, in_reasoning=True, call_sections=parser.call_sections)
    inside = "plan\n" + BLOCK
    message = final_message(inside, options)
    assert message["reasoning"] == inside and not message.get("tool_calls") and not message["content"]
    assert _streamed(inside, options, seed=3) == ("", [])
    closed = final_message("plan\n</think>\n" + BLOCK, options)
    assert closed["reasoning"] == "plan" and _calls_of(closed) == CALLS


def _calls_of(message: dict) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]]


# --- through a server -----------------------------------------------------------------------------------------------

FORCED = {"guided_regex": re.escape(TEXT)}


@pytest.fixture(scope="module")
def nemotron_server():
    with serving(tool_call_parser=NEMOTRON) as base_url:
        yield base_url, OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def _stream_message(stream) -> tuple[str, list[dict], str | None]:
    content, calls, finish = "", {}, None
    for event in stream:
        if not event.choices:
            continue
        delta = event.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or []:
            entry = calls.setdefault(call.index, {"id": None, "name": "", "arguments": ""})
            entry["id"] = call.id or entry["id"]
            entry["name"] += call.function.name or ""
            entry["arguments"] += call.function.arguments or ""
        finish = event.choices[0].finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


def test_chat_completions_parse_the_block_whole_and_streamed(nemotron_server):
    _, client = nemotron_server
    messages = [{"role": "user", "content": "weather and time?"}]
    response = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=200,
                                              temperature=0, extra_body=FORCED)
    choice = response.choices[0]
    assert choice.message.content == "Let me look that up." and choice.finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == CALLS
    assert len({c.id for c in choice.message.tool_calls}) == 2
    stream = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=200,
                                            temperature=0, stream=True, extra_body=FORCED)
    content, calls, finish = _stream_message(stream)
    assert content == "Let me look that up." and finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == CALLS and all(c["id"] for c in calls)


# tools whose arguments end quickly (a random model's free strings may run past max_tokens)
CLOSED = [{"type": "function", "function": {"name": name, "parameters": {
    "type": "object", "properties": {"unit": {"enum": ["c", "f"]}}, "required": ["unit"],
    "additionalProperties": False}}} for name in ("get_temperature", "get_time")]


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_a_forced_call_is_written_in_nemotrons_own_format(nemotron_server, tool_choice):
    """A forced call (tool_choice "required" or named) is written as the model writes calls, one `<TOOLCALL>` list
    (it was Qwen3's `<tool_call>` block, a format Nemotron was not trained on), and the parser reads it."""
    base_url, _ = nemotron_server
    body = {"model": MODEL, "messages": [{"role": "user", "content": "time?"}], "tools": CLOSED, "max_tokens": 200,
            "temperature": 0, "tool_choice": tool_choice, "return_token_ids": True}
    choice = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=120).raise_for_status().json()[
        "choices"][0]
    text = Tokenizer(ensure_builtin_model()).decode(choice["token_ids"])
    assert choice["finish_reason"] == ("tool_calls" if tool_choice == "required" else "stop")
    assert text.startswith("<TOOLCALL>[{") and text.endswith("}]</TOOLCALL>"), text
    calls = choice["message"]["tool_calls"]
    assert [call["function"]["name"] for call in calls] == [c["name"] for c in json.loads(text[10:-11])]
    assert all(isinstance(json.loads(call["function"]["arguments"]), dict) for call in calls)
    if isinstance(tool_choice, dict):
        assert [call["function"]["name"] for call in calls] == ["get_time"]


def test_messages_route_gives_tool_use_blocks_whole_and_streamed(nemotron_server):
    base_url, _ = nemotron_server
    body = {"model": MODEL, "max_tokens": 200, "messages": [{"role": "user", "content": "weather and time?"}],
            "tools": [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in TOOLS],
            "structured_outputs": {"regex": re.escape(TEXT)}, "temperature": 0}
    response = httpx.post(f"{base_url}/v1/messages", json=body, timeout=120)
    assert response.status_code == 200, response.text
    message = response.json()
    assert message["stop_reason"] == "tool_use"
    assert [b["text"] for b in message["content"] if b["type"] == "text"] == ["Let me look that up."]
    assert [(b["name"], b["input"]) for b in message["content"] if b["type"] == "tool_use"] == CALLS
    streamed = httpx.post(f"{base_url}/v1/messages", json={**body, "stream": True}, timeout=120)
    events = [json.loads(line[len("data: "):]) for line in streamed.text.splitlines() if line.startswith("data: ")]
    starts = [e["content_block"] for e in events if e["type"] == "content_block_start"]
    assert [b["name"] for b in starts if b["type"] == "tool_use"] == ["get_weather", "get_time"]
    inputs = "".join(e["delta"].get("partial_json", "") for e in events if e["type"] == "content_block_delta")
    assert inputs == "".join(json.dumps(arguments) for _, arguments in CALLS)
    assert [e["delta"]["stop_reason"] for e in events if e["type"] == "message_delta"] == ["tool_use"]


def test_responses_route_gives_function_calls(nemotron_server):
    _, client = nemotron_server
    response = client.responses.create(model=MODEL, input="weather and time?", tools=[
        {"type": "function", **t["function"]} for t in TOOLS], max_output_tokens=200, temperature=0,
        extra_body={"structured_outputs": {"regex": re.escape(TEXT)}})
    calls = [(item.name, json.loads(item.arguments)) for item in response.output if item.type == "function_call"]
    assert calls == CALLS and response.output_text == "Let me look that up."


def test_without_the_flag_the_server_leaves_the_block_as_content():
    with serving() as base_url:
        client = OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)
        response = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                  tools=TOOLS, max_tokens=200, temperature=0, extra_body=FORCED)
    assert response.choices[0].message.content == TEXT and response.choices[0].message.tool_calls is None
    assert response.choices[0].finish_reason == "stop"
