"""The tool-call formats of the families served besides Qwen and Nemotron (`tool_formats`, `call_formats`): Kimi
(kimi_k2), Jamba (jamba), LFM2 (lfm2), OLMo 3 (olmo3), bare Python lists (pythonic), Granite 4 (granite4, Qwen's
blocks) and Falcon-H1's JSON list in a `<tool_call>`: whole text and streamed at every split point give the same
content and calls, malformed blocks stay text, Python calls are read as literals only."""

from __future__ import annotations

import json

import pytest

from hybridcache.server.config import ServerConfig
from hybridcache.server.tool_formats import TOOL_CALL_PARSERS, tool_format
from hybridcache.server.tool_parsers import ToolCallStream, parse_tool_calls

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}}}}
TOOLS = [WEATHER, TIME]
CALLS = [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {"zone": "utc"})]

KIMI = ("Let me check.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
        '<|tool_call_argument_begin|>{"city": "Paris", "days": 2}<|tool_call_end|>'
        '<|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>{"zone": "utc"}<|tool_call_end|>'
        "<|tool_calls_section_end|>")
JAMBA = ('Let me check.\n<tool_calls>[{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}, '
         '{"name": "get_time", "arguments": {"zone": "utc"}}]</tool_calls>')
LFM2 = "Let me check.<|tool_call_start|>[get_weather(city='Paris', days=2), get_time(zone=\"utc\")]<|tool_call_end|>"
OLMO3 = 'Let me check.\n<function_calls>get_weather(city="Paris", days=2)\nget_time(zone="utc")</function_calls>'
FALCON = ('Let me check.\n<tool_call>\n[\n  {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}},\n'
          '  {"name": "get_time", "arguments": {"zone": "utc"}}\n]\n</tool_call>')
GRANITE = ('Let me check.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}</tool_call>\n'
           '<tool_call>{"name": "get_time", "arguments": "{\\"zone\\": \\"utc\\"}"}</tool_call>')
SAMPLES = {"kimi_k2": KIMI, "jamba": JAMBA, "lfm2": LFM2, "olmo3": OLMO3, "hermes": FALCON, "granite4": GRANITE}


def _calls(calls) -> list[tuple[str, dict]]:
    return [(call.name, json.loads(call.arguments)) for call in calls]


def _streamed(text: str, parser: str | None, cuts: list[int]) -> tuple[str, list[tuple[int, str, dict]]]:
    """The content and (index, name, arguments) of `text` fed to a `ToolCallStream` up to each cut, then whole."""
    stream, content, calls = ToolCallStream(TOOLS, parser), "", []
    for at in [*cuts, len(text)]:
        content += stream.feed(text[:at], finished=at == len(text))
        calls += [(i, call.name, json.loads(call.arguments)) for i, call in stream.new_calls()]
    return content, calls


@pytest.mark.parametrize("parser", list(SAMPLES))
def test_each_format_gives_its_calls_and_the_content_before_them(parser):
    parsed = parse_tool_calls(SAMPLES[parser], TOOLS, parser)
    assert parsed.content == "Let me check." and _calls(parsed.tool_calls) == CALLS


@pytest.mark.parametrize("parser", list(SAMPLES))
def test_streamed_at_every_split_point_gives_the_same_message(parser):
    text = SAMPLES[parser]
    wanted = ("Let me check.", [(i, *call) for i, call in enumerate(CALLS)])
    for cut in range(1, len(text)):
        assert _streamed(text, parser, [cut]) == wanted, cut
    assert _streamed(text, parser, list(range(1, len(text)))) == wanted


def test_kimi_keeps_the_models_call_ids_and_reads_a_closing_tag_inside_an_argument():
    text = ("<|tool_calls_section_begin|> <|tool_call_begin|> functions.get_time:3 <|tool_call_argument_begin|>"
            '{"zone": "<|tool_call_end|>"}<|tool_call_end|> <|tool_calls_section_end|>')
    parsed = parse_tool_calls(text, TOOLS, "kimi_k2")
    assert [(c.id, c.name) for c in parsed.tool_calls] == [("functions.get_time:3", "get_time")]
    assert json.loads(parsed.tool_calls[0].arguments) == {"zone": "<|tool_call_end|>"}
    assert [c.id for c in parse_tool_calls(KIMI, TOOLS, "kimi_k2").tool_calls] == [
        "functions.get_weather:0", "functions.get_time:1"]
    singular = KIMI.replace("tool_calls_section", "tool_call_section")
    assert _calls(parse_tool_calls(singular, TOOLS, "kimi_k2").tool_calls) == CALLS


def test_python_calls_are_literals_read_with_ast():
    text = ("<|tool_call_start|>[get_weather(city='Par\\'is', days=-2, extra={'a': [1, 2.5, None, True]}, "
            "t=(1, 2))]<|tool_call_end|>")
    parsed = parse_tool_calls(text, TOOLS, "lfm2")
    assert _calls(parsed.tool_calls) == [("get_weather", {"city": "Par'is", "days": -2,
                                                          "extra": {"a": [1, 2.5, None, True]}, "t": [1, 2]})]
    olmo = "<function_calls>get_time(zone=null, dst=true, list=[false])</function_calls>"
    assert _calls(parse_tool_calls(olmo, TOOLS, "olmo3").tool_calls) == [
        ("get_time", {"zone": None, "dst": True, "list": [False]})]
    # (a bare name other than JSON's constants is code, not a literal)
    assert parse_tool_calls("<|tool_call_start|>[f(a=null)]<|tool_call_end|>", TOOLS, "lfm2").tool_calls == ()


MALFORMED = {
    "kimi_k2": ["<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{oops}"
                "<|tool_call_end|><|tool_calls_section_end|>",
                "<|tool_calls_section_begin|>just words<|tool_calls_section_end|>",
                "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>[1]"
                "<|tool_call_end|><|tool_calls_section_end|>",
                "<|tool_calls_section_begin|><|tool_calls_section_end|>"],
    "jamba": ["<tool_calls>[not json]</tool_calls>", "<tool_calls>[]</tool_calls>",
              '<tool_calls>[{"name": 1}]</tool_calls>'],
    "lfm2": ["<|tool_call_start|>[f(1)]<|tool_call_end|>", "<|tool_call_start|>[f(**a)]<|tool_call_end|>",
             "<|tool_call_start|>[f(a=g())]<|tool_call_end|>", "<|tool_call_start|>[f(a={1, 2})]<|tool_call_end|>",
             "<|tool_call_start|>[f(a=1, a=2)]<|tool_call_end|>", "<|tool_call_start|>[x.f(a=1)]<|tool_call_end|>",
             "<|tool_call_start|>[f(a=float('nan'))]<|tool_call_end|>", "<|tool_call_start|>[1, 2]<|tool_call_end|>",
             "<|tool_call_start|>[]<|tool_call_end|>", "<|tool_call_start|>[f(a=1]<|tool_call_end|>",
             "<|tool_call_start|>[f(a=b'x')]<|tool_call_end|>", "<|tool_call_start|>import os<|tool_call_end|>"],
    "olmo3": ["<function_calls>f(a=1\n</function_calls>", "<function_calls>print('hi'); f()</function_calls>",
              "<function_calls></function_calls>"],
}


@pytest.mark.parametrize(("parser", "block"), [(p, b) for p, blocks in MALFORMED.items() for b in blocks])
def test_a_block_that_does_not_parse_stays_content(parser, block):
    text = "Hmm. " + block + " the end"
    parsed = parse_tool_calls(text, TOOLS, parser)
    assert parsed.content == text and parsed.tool_calls == ()
    assert _streamed(text, parser, list(range(1, len(text), 3))) == (text, [])


def test_a_format_reads_only_its_own_blocks():
    """Another family's tags are text: a Kimi reply quoting a Qwen block, or the Qwen parsers reading Kimi's."""
    qwen = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    for parser in ("kimi_k2", "jamba", "lfm2", "olmo3", "pythonic"):
        assert parse_tool_calls(qwen, TOOLS, parser).tool_calls == ()
    for parser in (None, "hermes", "granite4", "qwen3_coder"):
        assert parse_tool_calls(KIMI, TOOLS, parser).content == KIMI


@pytest.mark.parametrize("text", ["[get_weather(city='Paris', days=2), get_time(zone='utc')]",
                                  "  \n[get_weather(city='Paris', days=2),\n get_time(zone='utc')]\n"])
def test_pythonic_reads_a_reply_that_is_one_list_of_calls(text):
    parsed = parse_tool_calls(text, TOOLS, "pythonic")
    assert parsed.content == "" and _calls(parsed.tool_calls) == CALLS
    for cut in range(len(text)):
        assert _streamed(text, "pythonic", [cut]) == ("", [(i, *call) for i, call in enumerate(CALLS)])


@pytest.mark.parametrize("text", ["Sure: [get_time(zone='utc')]", "[1] is a footnote", "[get_time(zone='utc')] ok",
                                  "get_time(zone='utc')", "", "  "])
def test_pythonic_leaves_any_other_reply_as_content(text):
    parsed = parse_tool_calls(text, TOOLS, "pythonic")
    assert parsed.content == text and parsed.tool_calls == ()
    for cut in range(len(text)):
        assert _streamed(text, "pythonic", [cut]) == (text, [])


def test_pythonic_holds_a_reply_starting_with_a_bracket_to_its_end_and_sends_other_text_at_once():
    stream = ToolCallStream(TOOLS, "pythonic")
    assert stream.feed(" [get_time(zone='utc')", finished=False) == ""
    assert stream.feed(" [get_time(zone='utc')]", finished=True) == "" and len(stream.calls) == 1
    stream = ToolCallStream(TOOLS, "pythonic")
    assert stream.feed("Hello wor", finished=False) == "Hello wor"


def test_every_parser_name_is_vllms_and_an_unknown_one_is_refused_naming_them():
    assert set(TOOL_CALL_PARSERS) == {"granite4", "hermes", "jamba", "kimi_k2", "lfm2", "nemotron_json", "olmo3",
                                      "pythonic", "qwen25", "qwen3_coder", "qwen3_xml"}
    with pytest.raises(ValueError, match="unknown tool-call parser 'granite'; known: granite4, hermes, jamba"):
        tool_format("granite")
    with pytest.raises(ValueError, match="known: granite4, hermes"):
        ServerConfig(tool_call_parser="mistral")
    assert tool_format("kimi_k2").tags[:2] == ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>")
