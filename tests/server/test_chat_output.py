"""Reasoning split and tool-call parsing, whole and streamed (pure functions; no server)."""

import json
import random

import pytest

from hybridcache.server import reasoning
from hybridcache.server.chat_output import ChatOutputOptions, ChoiceStream, final_message, finish_reason
from hybridcache.server.tool_parsers import parse_tool_calls

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "metric": {"type": "boolean"}, "tags": {"type": "array"}}}}}]

JSON_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
XML_CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n<parameter=days>\n3\n"
            "</parameter>\n<parameter=metric>\ntrue\n</parameter>\n<parameter=tags>\n[\"a\", \"b\"]\n</parameter>\n"
            "</function>\n</tool_call>")


def test_qwen3_json_block():
    parsed = parse_tool_calls("Let me check.\n" + JSON_CALL, TOOLS)
    assert parsed.content == "Let me check."
    (call,) = parsed.tool_calls
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris", "days": 2}
    assert call.id.startswith("call_")


def test_qwen3_coder_xml_block_converts_types_from_the_schema():
    (call,) = parse_tool_calls(XML_CALL, TOOLS).tool_calls
    assert json.loads(call.arguments) == {"city": "New York", "days": 3, "metric": True, "tags": ["a", "b"]}


def test_xml_parameters_typed_by_any_of_enum_or_const_convert_and_null_is_null():
    """Pydantic's Optional[int] is `anyOf` with no `type`, an enum of numbers has only `enum`: their values stayed
    strings, and "null" stayed "null". vLLM's qwen3_coder parser converts them; "null" is null where the schema
    allows null, and a parameter the schema does not name keeps its text, as vLLM's parser now has it."""
    properties = {"limit": {"anyOf": [{"type": "integer"}, {"type": "null"}]}, "level": {"enum": [1, 2, 3]},
                  "mode": {"enum": ["fast", "slow"]}, "flag": {"const": True}, "note": {"type": "string"},
                  "maybe": {"oneOf": [{"type": "string"}, {"type": "null"}]}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                          "properties": properties}}}]
    params = {"limit": "5", "level": "2", "mode": "fast", "flag": "true", "note": "12", "maybe": "null",
              "other": "NULL"}
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    (call,) = parse_tool_calls(f"<tool_call>\n<function=f>\n{body}</function>\n</tool_call>", tools).tool_calls
    assert json.loads(call.arguments) == {"limit": 5, "level": 2, "mode": "fast", "flag": True, "note": "12",
                                          "maybe": None, "other": "NULL"}


def test_xml_arguments_are_strict_json_and_a_ref_names_its_model():
    """A number parameter written NaN / Infinity came back as `{"h": NaN}`, which no strict JSON parser takes; a
    pydantic Optional[Model] (`anyOf: [{$ref}, {type: null}]`) kept its object as a string (a review found both)."""
    parameters = {"type": "object", "$defs": {"Box": {"type": "object", "properties": {"x": {"type": "integer"}}}},
                  "properties": {"h": {"type": "number"}, "g": {"anyOf": [{"$ref": "#/$defs/Box"}, {"type": "null"}]},
                                 "p": {"properties": {"y": {}}}, "u": {"$ref": "#/$defs/Unknown"}}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": parameters}}]
    params = {"h": "NaN", "g": '{"x": 1}', "p": '{"y": 2}', "u": "[1, 2]"}
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    (call,) = parse_tool_calls(f"<tool_call>\n<function=f>\n{body}</function>\n</tool_call>", tools).tool_calls
    arguments = json.loads(call.arguments, parse_constant=lambda name: pytest.fail(f"{name} in the arguments"))
    assert arguments == {"h": "NaN", "g": {"x": 1}, "p": {"y": 2}, "u": [1, 2]}
    (nan_json,) = parse_tool_calls('<tool_call>\n{"name": "f", "arguments": {"h": NaN}}\n</tool_call>',
                                   tools).tool_calls or (None,)
    assert nan_json is None  # not JSON: not a call


def test_two_calls_and_a_broken_block():
    parsed = parse_tool_calls(JSON_CALL + "\n" + XML_CALL, TOOLS)
    assert [c.name for c in parsed.tool_calls] == ["get_weather"] * 2 and parsed.content == ""
    broken = "text <tool_call>\nnot json\n</tool_call>"
    parsed = parse_tool_calls(broken, TOOLS)
    assert parsed.tool_calls == () and parsed.content == broken


def test_an_unclosed_final_block_is_parsed():
    (call,) = parse_tool_calls(JSON_CALL[: -len("</tool_call>")], TOOLS).tool_calls
    assert call.name == "get_weather"


BARE_CALL = ("<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n</parameter>\n"
             "</function>")


@pytest.mark.parametrize("text", [BARE_CALL, "Let me check.\n" + BARE_CALL, BARE_CALL[: -len("</function>")]])
def test_a_function_block_without_tool_call_tags_is_a_call_streamed_and_not(text):
    """vLLM's qwen3_coder parser takes a `<function=...>` block the model writes without the `<tool_call>` around it
    as a call; it stayed in the content."""
    options = ChatOutputOptions(parse_tools=True, tools=TOOLS)
    message = final_message(text, options)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == [
        ("get_weather", {"city": "Paris", "days": 2})]
    assert message["content"] == ("Let me check." if text.startswith("Let") else None)
    stream = ChoiceStream(options)
    deltas = [stream.update(text[:cut], finished=False) for cut in range(1, len(text) + 1)]
    deltas.append(stream.update(text, finished=True))
    assert "".join(d.content for d in deltas) == (message["content"] or "")
    assert [c.name for d in deltas for _, c in d.tool_calls] == ["get_weather"]


@pytest.mark.parametrize("before", ["", "Let me check.\n"])
@pytest.mark.parametrize("after", ["\nThe weather follows.", "\n\n",
                                   "\nmore\n" + XML_CALL + "\nand <tool_call>x</tool_call>"])
def test_text_after_the_first_call_is_dropped_streamed_and_not(before, after):
    """vLLM's qwen3_coder and hermes parsers give as content the text before the first call only; the text after a
    call was kept, with its leading newline."""
    text = before + JSON_CALL + after
    options = ChatOutputOptions(parse_tools=True, tools=TOOLS)
    message = final_message(text, options)
    assert message["content"] == (before.strip() or None)
    assert len(message["tool_calls"]) == 1 + ("more" in after)
    assert parse_tool_calls(text, TOOLS).content == before.strip()
    stream = ChoiceStream(options)
    deltas = [stream.update(text[:cut], finished=False) for cut in range(1, len(text) + 1)]
    deltas.append(stream.update(text, finished=True))
    assert "".join(d.content for d in deltas) == before.strip()
    assert len([call for d in deltas for call in d.tool_calls]) == len(message["tool_calls"])


def test_plain_text_is_untouched():
    assert parse_tool_calls("a < b and <tool", TOOLS).content == "a < b and <tool"
    assert parse_tool_calls("a <function= b", TOOLS).content == "a <function= b"


@pytest.mark.parametrize("text, in_reasoning, expected", [
    ("<think>\nplan it\n</think>\n\nHello", False, ("plan it", "Hello")),
    ("plan it\n</think>\n\nHello", True, ("plan it", "Hello")),
    ("Hello", False, (None, "Hello")),
    ("<think>\nunfinished", False, ("unfinished", "")),
    ("  <think>x</think>y", False, ("x", "y")),
    # the prompt opened the block and the model repeats the tag: dropped, as vLLM's qwen3 parser does
    ("<think>\nplan it\n</think>\n\nHello", True, ("plan it", "Hello")),
    ("\n<think>\nunfinished", True, ("unfinished", "")),
])
def test_reasoning_split(text, in_reasoning, expected):
    parts = reasoning.split(text, in_reasoning=in_reasoning, finished=True)
    assert (parts.reasoning, parts.content) == expected


def test_starts_in_reasoning_reads_the_prompt():
    assert reasoning.starts_in_reasoning("<|im_start|>assistant\n<think>\n")
    assert not reasoning.starts_in_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not reasoning.starts_in_reasoning("<|im_start|>assistant\n")


CASES = [
    ("<think>\nI should call it.\n</think>\n\nSure.\n" + JSON_CALL + "\n" + XML_CALL, False),
    ("reasoning first\n</think>\n\n" + JSON_CALL, True),
    ("<think>\nrepeated tag\n</think>\n\n" + JSON_CALL, True),
    ("<think>\n\n</think>\n\nJust text with a < sign and </think> later.", False),
    ("no think, a <tool_call> that is not one </tool_call> end", False),
    ("<think>\nbare\n</think>\n\nSure.\n" + BARE_CALL, False),
]


@pytest.mark.parametrize("text, in_reasoning", CASES)
def test_streamed_deltas_add_up_to_the_final_message(text, in_reasoning):
    options = ChatOutputOptions(split_reasoning=True, in_reasoning=in_reasoning, parse_tools=True, tools=TOOLS)
    expected = final_message(text, options)
    rng = random.Random(0)
    for _ in range(20):
        stream = ChoiceStream(options)
        reasoning_text, content, calls = "", "", []
        cut = 0
        while cut < len(text):
            cut = min(len(text), cut + rng.randint(1, 6))
            delta = stream.update(text[:cut], finished=False)
            reasoning_text += delta.reasoning
            content += delta.content
            calls += delta.tool_calls
        delta = stream.update(text, finished=True)
        reasoning_text += delta.reasoning
        content += delta.content
        calls += delta.tool_calls
        assert (reasoning_text or None) == expected["reasoning_content"]
        assert content.strip() == (expected["content"] or "")
        got = [(c.name, json.loads(c.arguments)) for _, c in calls]
        want = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in expected.get("tool_calls", [])]
        assert got == want
        assert [i for i, _ in calls] == list(range(len(calls)))


def test_final_message_shapes():
    options = ChatOutputOptions(split_reasoning=True, parse_tools=True, tools=TOOLS)
    message = final_message("<think>\nhm\n</think>\n\n" + JSON_CALL, options)
    assert message["content"] is None and message["reasoning_content"] == "hm"
    assert message["tool_calls"][0]["type"] == "function"
    assert finish_reason("stop", True) == "tool_calls" and finish_reason("length", True) == "length"
    plain = final_message("<think>a</think>b", ChatOutputOptions())
    assert plain == {"role": "assistant", "content": "<think>a</think>b"}


@pytest.mark.parametrize("text, in_reasoning", [("<think>\ncut short", False), ("cut short", True),
                                                ("<think>\ncut short\n</think>\n\n", False),
                                                ("cut short</think>", True)])
def test_nothing_after_the_reasoning_is_null_content_as_vllm(text, in_reasoning):
    """vLLM's reasoning parsers give content None (null) for a reply cut inside its think block, or that ends with
    it; the message had "". A reply with no think block keeps its text, "" included."""
    options = ChatOutputOptions(split_reasoning=True, in_reasoning=in_reasoning)
    message = final_message(text, options)
    assert (message["reasoning"], message["content"]) == ("cut short", None)
    assert final_message("", ChatOutputOptions(split_reasoning=True))["content"] == ""
    assert final_message("", ChatOutputOptions())["content"] == ""


def _streamed_calls(options: ChatOutputOptions, text: str) -> list[tuple[int, str, dict]]:
    """The (index, name, arguments) of every call a stream fed `text` one character at a time sends."""
    stream = ChoiceStream(options)
    deltas = [stream.update(text[:cut], finished=False) for cut in range(1, len(text) + 1)]
    deltas.append(stream.update(text, finished=True))
    return [(i, c.name, json.loads(c.arguments)) for d in deltas for i, c in d.tool_calls]


WRITE_TOOLS = [{"type": "function", "function": {"name": "write_file", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}}}}}]


@pytest.mark.parametrize("content", ["\n\nimport os\nprint(os.getcwd())\n", "\n", "  indented\n\n", "plain"])
def test_an_xml_value_loses_only_the_newline_the_template_writes_on_each_side(content):
    """Qwen3.5's and Qwen3-Coder's templates write `<parameter=NAME>\\n` + value + `\\n</parameter>`; vLLM's
    qwen3_coder parser removes exactly that one newline each side. Every leading and trailing newline was stripped,
    so a file written through a tool lost its blank first lines and its final newline."""
    sent = {"path": "a.py", "content": content}
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in sent.items())
    text = f"<tool_call>\n<function=write_file>\n{body}</function>\n</tool_call>"
    options = ChatOutputOptions(parse_tools=True, tools=WRITE_TOOLS)
    (call,) = final_message(text, options)["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == sent
    assert _streamed_calls(options, text) == [(0, "write_file", sent)]
    (bare,) = parse_tool_calls("<tool_call>\n<function=write_file>\n<parameter=path>a.py</parameter>\n</function>\n"
                               "</tool_call>", WRITE_TOOLS).tool_calls
    assert json.loads(bare.arguments) == {"path": "a.py"}  # no newline around the value: nothing removed


@pytest.mark.parametrize("closed", [True, False])
def test_every_function_block_in_one_tool_call_is_a_call_streamed_and_not(closed):
    """vLLM's qwen3_coder parser takes every `<function=...>` inside a `<tool_call>`; the second one was dropped."""
    text = ("Let me look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n"
            "<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n<parameter=days>\n2\n</parameter>\n"
            "</function>\n" + ("</tool_call>" if closed else ""))
    options = ChatOutputOptions(parse_tools=True, tools=TOOLS)
    message = final_message(text, options)
    want = [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome", "days": 2})]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == want
    assert message["content"] == "Let me look."
    assert len({c["id"] for c in message["tool_calls"]}) == 2
    assert _streamed_calls(options, text) == [(i, *call) for i, call in enumerate(want)]


def test_parallel_tool_calls_false_keeps_the_first_call_streamed_and_not():
    """vLLM's `maybe_filter_parallel_tool_calls`: with `parallel_tool_calls: false`, only the first call (index 0)
    is returned, whole or streamed; every call was returned."""
    text = "Sure.\n" + JSON_CALL + "\n" + XML_CALL
    options = ChatOutputOptions(parse_tools=True, tools=TOOLS, parallel_tool_calls=False)
    message = final_message(text, options)
    assert [json.loads(c["function"]["arguments"]) for c in message["tool_calls"]] == [{"city": "Paris", "days": 2}]
    assert message["content"] == "Sure."
    assert _streamed_calls(options, text) == [(0, "get_weather", {"city": "Paris", "days": 2})]
    stream = ChoiceStream(options)
    stream.update(text, finished=True)
    assert stream.has_tool_calls  # the finish reason is still "tool_calls"
    assert len(final_message(text, ChatOutputOptions(parse_tools=True, tools=TOOLS))["tool_calls"]) == 2


@pytest.mark.parametrize("parameters", [
    {"type": "object", "properties": ["a"]},
    {"type": "object", "properties": "a"},
    {"type": "object", "properties": {"a": {"$ref": "#/$defs/A"}}, "$defs": ["A"]},
    {"type": "object", "properties": {"a": {"$ref": "#/definitions/A"}}, "definitions": "A"},
    "not a schema",
])
def test_a_tool_whose_properties_or_defs_are_not_objects_still_parses(parameters):
    """`properties` (or `$defs`) that are not objects raised AttributeError in the XML parser: a 500, or a stream
    cut with no error event. They are now ignored: values read as for a tool without a schema."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": parameters}}]
    text = "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</function>\n</tool_call>"
    (call,) = parse_tool_calls(text, tools).tool_calls
    want = {"a": 1} if "$ref" in json.dumps(parameters) else {"a": "1"}  # an unknown `$ref` names an object
    assert (call.name, json.loads(call.arguments)) == ("f", want)
    assert _streamed_calls(ChatOutputOptions(parse_tools=True, tools=tools), text) == [(0, "f", want)]
