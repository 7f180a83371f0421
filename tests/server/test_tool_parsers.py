"""Tool-call parsing edge cases (hunt 162): closing tags inside arguments, and a stream fed in random pieces that
must give the final message's calls and content."""

import json
import random

import pytest

from hybridcache.server.chat_output import ChatOutputOptions, ChoiceStream, final_message
from hybridcache.server.tool_parsers import parse_tool_calls

WRITE_TOOLS = [{"type": "function", "function": {"name": "write_file", "parameters": {"type": "object", "properties": {
    "path": {"type": "string"}, "content": {"type": "string"}}, "required": ["path", "content"]}}}]

# a file about tool calls: every tag of the XML format, closing ones at the end of a line too
TAGS_FILE = ('START = "<tool_call>"\nEND = "</tool_call>"\nPARAM = "</parameter>"\nOPEN = "<parameter="\n'
             'FUNCTION_END = "</function>"\nclosed = "</parameter>\n</function>"\nprint("done")\n')
# a file holding a whole call, as the chat template writes one (its tags begin lines)
NESTED_FILE = ('template = """\n<tool_call>\n<function=write_file>\n<parameter=path>\nx.py\n</parameter>\n'
               '</function>\n</tool_call>\n"""\n')


def _xml(arguments: dict[str, str]) -> str:
    """A write_file call as Qwen3-Coder's and Qwen3.5's templates write it (a newline each side of a value)."""
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in arguments.items())
    return f"<tool_call>\n<function=write_file>\n{body}</function>\n</tool_call>"


def _json(arguments: dict[str, str]) -> str:
    return "<tool_call>\n" + json.dumps({"name": "write_file", "arguments": arguments}) + "\n</tool_call>"


@pytest.mark.parametrize("content", [TAGS_FILE, NESTED_FILE, "</parameter>", "a</parameter>\n\nb"],
                         ids=["tags", "nested-call", "close-alone", "close-then-text"])
@pytest.mark.parametrize("write", [_xml, _json], ids=["xml", "json"])
@pytest.mark.parametrize("after", ["", "\n<tool_call>\n" + json.dumps({"name": "write_file", "arguments": {
    "path": "b.py", "content": ""}}) + "\n</tool_call>"], ids=["alone", "then-a-call"])
def test_closing_tags_inside_an_argument_do_not_end_the_call(content, write, after):
    """A literal `</tool_call>`, `</parameter>`, `<parameter=` or `</function>` in a value ended the call at the
    first closing tag: the file reached the client cut short (XML) or the call was text (JSON). A closing tag ends
    a call only where the body before it is a whole call (vLLM's qwen3_coder parser: a `</parameter>` followed by
    `</function>` or a parameter of the tool, the `</parameter>` of a literal call skipped)."""
    sent = {"path": "a.py", "content": content}
    text = "I'll write it.\n" + write(sent) + after
    parsed = parse_tool_calls(text, WRITE_TOOLS)
    assert parsed.content == "I'll write it."
    calls = [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls]
    assert calls[0] == ("write_file", sent)
    assert len(calls) == 1 + bool(after)
    _assert_streams_as_whole(text, WRITE_TOOLS)


EDGE_TEXTS = [
    "Sure.\n" + _xml({"path": "a.py", "content": TAGS_FILE}),
    _xml({"path": "a.py", "content": NESTED_FILE}) + "\n" + _xml({"path": "b.py", "content": "x"}),
    _json({"path": "a.py", "content": TAGS_FILE}) + "\nthen text",
    "a <tool_call>\nnot json\n</tool_call> and more text",
    "<tool_call>\nnot json\n</tool_call>\n" + _json({"path": "a.py", "content": "x"}),
    "<tool_call>\n<function=write_file>\n<parameter=path>\na.py\n</tool_call>\n" + _xml({"path": "b", "content": ""}),
    _xml({"path": "a.py", "content": "x"})[: -len("</tool_call>")],
    _xml({"path": "a.py", "content": "END = </tool_call>\n"})[: -len("</function>\n</tool_call>")],
    _json({"path": "a.py", "content": "</tool_call> x"})[: -len("\n</tool_call>")],
    "<function=write_file>\n<parameter=content>\n</function>\n</parameter>\n</function>\ntext after",
    _xml({"path": "a.py", "content": "</tool_call>\n<tool_call>\n"}),
]


@pytest.mark.parametrize("text", EDGE_TEXTS)
def test_a_stream_in_random_pieces_is_the_whole_message(text):
    _assert_streams_as_whole(text, WRITE_TOOLS)


def _assert_streams_as_whole(text: str, tools: list[dict], rounds: int = 12) -> None:
    """Streamed in random pieces (1 to 8 characters, or one at a time), the calls and the content are the final
    message's."""
    options = ChatOutputOptions(parse_tools=True, tools=tools)
    message = final_message(text, options)
    want = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])]
    rng = random.Random(len(text))
    for round_ in range(rounds):
        stream, cut, content, calls = ChoiceStream(options), 0, "", []
        while cut < len(text):
            cut = min(len(text), cut + (1 if round_ == 0 else rng.randint(1, 8)))
            delta = stream.update(text[:cut], finished=False)
            content, calls = content + delta.content, calls + delta.tool_calls
        delta = stream.update(text, finished=True)
        content, calls = content + delta.content, calls + delta.tool_calls
        assert [(c.name, c.arguments) for _, c in calls] == want
        assert [i for i, _ in calls] == list(range(len(calls)))
        assert content == (message["content"] or "")


NUMBER_TOOLS = [{"type": "function", "function": {"name": "set_limit", "parameters": {"type": "object", "properties": {
    "value": {"type": "number"}, "box": {"type": "object"}, "note": {"type": "string"}}}}}]


def _set_limit_xml(**values: str) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in values.items())
    return f"Setting it.\n<tool_call>\n<function=set_limit>\n{body}</function>\n</tool_call>"


OVERFLOW_TEXTS = [
    _set_limit_xml(value="1e400"),
    _set_limit_xml(value="-1E400", box='{"a": [1, 2e999]}'),
    'Setting it.\n<tool_call>\n{"name": "set_limit", "arguments": {"value": 1e400}}\n</tool_call>',
    'Setting it.\n<tool_call>\n{"name": "set_limit", "arguments": {"note": "a\\ud800b"}}\n</tool_call>',
    'Setting it.\n<tool_call>\n{"name": "set_\\udfff", "arguments": {}}\n</tool_call>',
    'Setting it.\n<tool_call>\n{"name": "set_limit", "arguments": "{\\"note\\": \\"\\ud800\\"}"}\n</tool_call>',
    'Setting it.\n<tool_call>\n{"name": "set_limit", "arguments": {"box": ' + "[" * 5_000 + "]" * 5_000 +
    "}}\n</tool_call>",
]


@pytest.mark.parametrize("text", OVERFLOW_TEXTS, ids=["xml-1e400", "xml-in-object", "json-1e400", "json-surrogate",
                                                      "json-surrogate-name", "json-surrogate-text", "json-deep"])
def test_numbers_too_large_and_lone_surrogates_give_strict_utf8_json_not_an_error(text):
    """A number too large for a float (1e400) raised from json.dumps(allow_nan=False): a 500, or a stream cut with
    an error event (XML); JSON arguments came back as `{"value": Infinity}`, which is not JSON; a lone surrogate
    escape (`"a\\ud800b"`) raised UnicodeEncodeError when the answer was sent: a 500. Now an XML number too large
    stays text, a JSON call holding one is not a call (its text stays content, as NaN), a lone surrogate in the
    arguments is escaped (`\\ud800`), one in a name or in arguments sent as text makes the block text; a JSON body
    nested too deeply to parse is text too."""
    message = final_message(text, ChatOutputOptions(parse_tools=True, tools=NUMBER_TOOLS))
    json.dumps(message, ensure_ascii=False).encode()  # what the server sends
    calls = message.get("tool_calls", [])
    strict = {"parse_constant": lambda name: pytest.fail(f"{name} in the arguments")}
    arguments = [json.loads(c["function"]["arguments"], **strict) for c in calls]
    if "<function=" in text:
        assert arguments[0]["value"] in ("1e400", "-1E400")
        assert arguments[0].get("box", '{"a": [1, 2e999]}') == '{"a": [1, 2e999]}'
    elif "\\ud800b" in text:
        assert arguments == [{"note": "a\ud800b"}] and message["content"] == "Setting it."
    else:
        assert calls == [] and message["content"] == text
    _assert_streams_as_whole(text, NUMBER_TOOLS)


EDIT_TOOLS = [{"type": "function", "function": {"name": "edit_file", "parameters": {"type": "object", "properties": {
    "path": {"type": "string"}, "old_string": {"type": "string"}, "new_string": {"type": "string"},
    "default": {"anyOf": [{"type": "string"}, {"type": "null"}]}, "nullable": {"type": ["string", "null"]},
    "limit": {"type": "integer"}, "flag": {"type": "boolean"}, "mode": {"enum": ["null", "fast"]}}}}}]


def test_a_string_parameter_written_null_stays_the_string_null():
    """A string parameter whose text is `null` (an SQL file, a sentence) came back as JSON null: an edit_file
    call replacing `NULL` lost its old_string. As vLLM's qwen3_coder parser now has it, a schema that allows
    strings keeps the text unless it allows null too; a non-string type takes "null" and "None" as null; a
    parameter the schema does not name keeps its text."""
    values = {"path": "schema.sql", "old_string": "NULL", "new_string": "null", "default": "null", "nullable": "None",
              "limit": "None", "flag": "NULL", "mode": "null", "unnamed": "null"}
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in values.items())
    text = f"<tool_call>\n<function=edit_file>\n{body}</function>\n</tool_call>"
    (call,) = parse_tool_calls(text, EDIT_TOOLS).tool_calls
    assert json.loads(call.arguments) == {"path": "schema.sql", "old_string": "NULL", "new_string": "null",
                                          "default": None, "nullable": None, "limit": None, "flag": None,
                                          "mode": "null", "unnamed": "null"}
    _assert_streams_as_whole(text, EDIT_TOOLS)
