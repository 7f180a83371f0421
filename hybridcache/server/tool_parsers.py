"""Tool calls in a completion's text, in the Qwen formats, into OpenAI `tool_calls`.

A call is a `<tool_call>...</tool_call>` block whose body is either Qwen3's JSON object::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

or the XML-style function block of Qwen3-Coder and Qwen3.5::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

XML parameter values are text, less the one newline the chat template writes on each side (a value's own leading or
trailing newlines are kept, as vLLM's qwen3_coder parser keeps them); they are converted to the type the tool's JSON
schema allows for that parameter (integer, number, boolean, object, array, null; by its `type`, `anyOf` / `oneOf`
branches or `enum` values), else kept as strings; "null" is null where the schema allows null or no string, as in
vLLM's qwen3_coder parser (a string parameter keeps the text "null", and so does a parameter the schema does not
name). A function block the model writes without the `<tool_call>` around it
(`<function=get_weather>...</function>`) is a call too, as vLLM's qwen3_coder parser takes it, and so is each of
several function blocks written in one `<tool_call>`. A tool whose `parameters.properties` (or `$defs`) is not an
object has its values read as if it had no schema (strings). The text before the first call is the message's
`content`; text after it (between or after the calls) is dropped, as vLLM's qwen3_coder and hermes parsers drop it.
A block that does not parse stays in the content, as text.

A closing tag inside an argument (a file about tool calls, HTML, this very parser) does not end the call: a block
ends at the first closing tag after which its body is a whole call (`_read_block`). An XML value ends at the first
`</parameter>` followed, past white space, by `<parameter=NAME>` with NAME one of the tool's parameters, or by the
function's end (`</function>` that the block's end or another function follows), once the `</parameter>` that close
the `<parameter=` beginning a line inside the value (a literal call) are skipped, as vLLM's qwen3_coder parser
(`_find_true_param_end`); a JSON body is a whole call when it parses::

    <tool_call><function=write_file><parameter=content>END = "</tool_call>"</parameter></function></tool_call>
                                                              ^ not whole here           the end: ^
    (newlines left out)

A block no closing tag makes whole ends at the first one followed by another block or by the end of the text (read
as before: values end at their first `</parameter>`), else at its first one; one never closed is read to the end.

With `--tool-call-parser nemotron_json` (and only then: other models' text is left as it is), NVIDIA's
Nemotron-Nano-9B-v2 format is read too: one `<TOOLCALL>` block holding a JSON list of calls, each its own call::

    <TOOLCALL>[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "now", "arguments": {}}]</TOOLCALL>

A body without its `[` or `]` is read as if it had them, as NVIDIA's parser reads it; a body that is not a list of
calls (each an object with a string `name`) stays text, and so does an empty list. The Qwen blocks are still read
with this parser; a forced call (`tool_choice` "required" or named) is written as such a `<TOOLCALL>` list
(`guided.GuidedSpec.tool_calls`, `tool_format` "nemotron").

The other families' formats (Jamba's `<tool_calls>` list, Kimi's sections, LFM2's and OLMo 3's Python calls, a bare
Python list) are read with their `--tool-call-parser` only, each without the Qwen blocks: `tool_formats` lists which
parser reads which blocks, `call_formats` reads their bodies; the block rules below hold for them all. A `<tool_call>`
whose body is a JSON list (Falcon-H1's template) is each item's call.

`parse_tool_calls` reads a whole text; `ToolCallStream` feeds a streaming text, emitting content up to where a
block may start and each call once its block is closed (a closing tag that does not make the block whole is
decided by the next character that is not white space, or by the end of the text).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from hybridcache.server import call_formats
from hybridcache.server.tool_call import ParsedText, ToolCall, call_of, dumps, new_id, strict_json
from hybridcache.server.tool_formats import (
    FUNCTION_END,
    FUNCTION_START,
    JAMBA_BLOCK,
    KIMI_BLOCK,
    KIMI_SINGULAR_BLOCK,
    LFM2_BLOCK,
    NEMOTRON_BLOCK,
    OLMO3_BLOCK,
    tool_format,
)

__all__ = ["ParsedText", "ToolCall", "ToolCallStream", "parse_tool_calls"]

PARAMETER_START = "<parameter="
PARAMETER_END = "</parameter>"
_SPACE = re.compile(r"\s*")
_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.S)


def _parameter_types(tools: list[dict] | None, name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The tool's parameter schemas by name, and its `$defs` (what a `$ref` names, as pydantic writes models); each
    empty where the tool's schema has no object there (a client may send `properties` as a list)."""
    for tool in tools or []:
        function = tool.get("function", tool)
        if function.get("name") == name:
            parameters = function.get("parameters")
            if not isinstance(parameters, dict):
                return {}, {}
            properties = parameters.get("properties")
            defs = parameters.get("$defs") or parameters.get("definitions")
            return (properties if isinstance(properties, dict) else {}), (defs if isinstance(defs, dict) else {})
    return {}, {}


_JSON_KINDS = ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"), (type(None), "null"))


def _schema_kinds(schema: Any, defs: dict[str, Any] | None = None, depth: int = 0) -> set[str]:
    """The JSON types a parameter's schema allows: its `type`, else what its `$ref` names in `defs` (pydantic's
    `Optional[Model]` is `anyOf: [{$ref: "#/$defs/Model"}, {type: null}]`; an unknown name, or `properties`
    without a type: an object), else its `anyOf` / `oneOf` branches' (pydantic's `Optional[int]` is `anyOf: [{type:
    integer}, {type: null}]`), else the types of its `enum` / `const` values; {"string"} when it says nothing (as
    vLLM's qwen3_coder parser)."""
    if not isinstance(schema, dict) or depth > 16:
        return {"string"}
    kinds = schema.get("type")
    if kinds is not None:
        return {str(kind) for kind in (kinds if isinstance(kinds, list) else [kinds])}
    if isinstance(schema.get("$ref"), str):
        target = (defs or {}).get(schema["$ref"].rsplit("/", 1)[-1])
        return _schema_kinds(target, defs, depth + 1) if isinstance(target, dict) else {"object"}
    if "properties" in schema:
        return {"object"}
    branches = [b for key in ("anyOf", "oneOf") for b in schema.get(key) or [] if isinstance(b, dict)]
    if branches:
        return set().union(*(_schema_kinds(branch, defs, depth + 1) for branch in branches))
    values = schema["enum"] if isinstance(schema.get("enum"), list) else [schema["const"]] if "const" in schema else []
    found = {next((kind for cls, kind in _JSON_KINDS if isinstance(v, cls)), "object") for v in values}
    return found or {"string"}


def _convert(value: str, schema: dict[str, Any], defs: dict[str, Any] | None = None) -> Any:
    """An XML parameter's text as the type its schema allows (`_schema_kinds`), as vLLM's qwen3_coder parser:
    "null" or "None" (any case) is null where the schema allows null or no string; a schema that allows strings
    keeps the text (a string "null" too); otherwise the text as JSON (or a boolean written True / False), the text
    itself when it does not parse."""
    kinds = _schema_kinds(schema, defs)
    if value.strip().lower() in ("null", "none") and ("null" in kinds or "string" not in kinds):
        return None
    if "string" in kinds:
        return value
    try:
        parsed = strict_json(value)
    except ValueError:  # (JSONDecodeError too; NaN, Infinity, 1e400: kept as text, as JSON has no such number)
        lowered = value.strip().lower()
        if "boolean" in kinds and lowered in ("true", "false"):
            return lowered == "true"
        return value
    return parsed


def _xml_value(text: str) -> str:
    """A parameter's text without the one newline the chat template writes on each side of a value, as vLLM's
    qwen3_coder parser: a value's own leading or trailing newlines (a file's content) are kept."""
    text = text[1:] if text.startswith("\n") else text
    return text[:-1] if text.endswith("\n") else text


def _xml_call(name: str, values: list[tuple[str, str]], tools: list[dict] | None) -> ToolCall:
    """One `<function=NAME>` block as a call: its (key, text) values converted by the tool's schema (`_convert`);
    a key the schema does not name keeps its text, as vLLM's qwen3_coder parser."""
    types, defs = _parameter_types(tools, name)
    arguments = {key: _convert(_xml_value(text), types[key], defs) if key in types else _xml_value(text)
                 for key, text in values}
    return ToolCall(new_id(), name, dumps(arguments))


def _tag_name(text: str, at: int, prefix: str) -> tuple[str, int] | None:
    """The NAME of a `<prefix NAME>` tag at `at` and where the tag ends; None when there is none (no `>` on the
    line, or an empty name)."""
    if not text.startswith(prefix, at):
        return None
    close = text.find(">", at)
    name = text[at + len(prefix):close].strip()
    return (name, close + 1) if close >= 0 and name and "\n" not in name else None


def _value_end(text: str, start: int, names: set[str] | None) -> int:
    """Where the XML value that starts at `start` ends: its closing `</parameter>`, or -1. A `</parameter>` closes
    the value when it is followed, past white space, by `<parameter=NAME>` with NAME in `names` (any NAME when None)
    or by a `</function>` that the next function block or the end of `text` follows, and does not close a
    `<parameter=` that begins a line inside the value (a literal call in a file), as vLLM's qwen3_coder parser
    (`_find_true_param_end`, `_find_true_function_end`)."""
    depth, at = 0, start
    while (close := text.find(PARAMETER_END, at)) >= 0:
        nested = text.find("\n" + PARAMETER_START, at, close)
        if nested >= 0:
            depth, at = depth + 1, nested + 1 + len(PARAMETER_START)
            continue
        at = close + len(PARAMETER_END)
        if depth:
            depth -= 1
            continue
        after = _SPACE.match(text, at).end()
        parameter = _tag_name(text, after, PARAMETER_START)
        if parameter and (names is None or parameter[0] in names):
            return close
        if text.startswith(FUNCTION_END, after):
            following = _SPACE.match(text, after + len(FUNCTION_END)).end()
            if following == len(text) or text.startswith(FUNCTION_START, following):
                return close
    return -1


def _whole_xml(text: str, tools: list[dict] | None) -> tuple[ToolCall, ...] | None:
    """The calls of `text` when it is nothing but closed `<function=...>` blocks (white space between them), each
    holding nothing but closed parameters (`_value_end`); None otherwise."""
    calls = []
    at = _SPACE.match(text).end()
    while at < len(text):
        function = _tag_name(text, at, FUNCTION_START)
        if function is None:
            return None
        name, at = function
        names = set(_parameter_types(tools, name)[0]) or None
        values = []
        while not text.startswith(FUNCTION_END, at := _SPACE.match(text, at).end()):
            parameter = _tag_name(text, at, PARAMETER_START)
            end = -1 if parameter is None else _value_end(text, parameter[1], names)
            if end < 0:
                return None
            values.append((parameter[0], text[parameter[1]:end]))
            at = end + len(PARAMETER_END)
        calls.append(_xml_call(name, values, tools))
        at = _SPACE.match(text, at + len(FUNCTION_END)).end()
    return tuple(calls) or None


def _json_call(body: str) -> ToolCall | None:
    """A JSON body's call (`{"name": ..., "arguments": {...}}`), or None."""
    try:
        data = strict_json(body, strict=False)  # grammars may let control characters through unescaped
    except ValueError:
        return None
    return call_of(data)


# the reader of each block that is not Qwen's (`call_formats`): its body's calls when whole, else None
_BODY_READERS: dict[str, Callable[[str], tuple[ToolCall, ...] | None]] = {
    NEMOTRON_BLOCK[0]: call_formats.json_call_list,
    JAMBA_BLOCK[0]: call_formats.json_call_list,
    LFM2_BLOCK[0]: call_formats.python_call_list,
    OLMO3_BLOCK[0]: call_formats.python_call_lines,
    KIMI_BLOCK[0]: call_formats.kimi_section,
    KIMI_SINGULAR_BLOCK[0]: call_formats.kimi_section,
}


def _whole(opening: str, body: str, tools: list[dict] | None) -> tuple[ToolCall, ...] | None:
    """`whole_block` for a block that opens with `opening` (other formats' bodies: `_BODY_READERS`)."""
    reader = _BODY_READERS.get(opening)
    return whole_block(body, tools) if reader is None else reader(body)


def _parse(opening: str, body: str, tools: list[dict] | None) -> tuple[ToolCall, ...]:
    """`parse_block` for a block that opens with `opening` (other formats' bodies are whole or text)."""
    reader = _BODY_READERS.get(opening)
    return parse_block(body, tools) if reader is None else reader(body) or ()


def whole_block(body: str, tools: list[dict] | None = None) -> tuple[ToolCall, ...] | None:
    """A block's body (between the tags) as its calls when it is a whole call: nothing but closed function blocks
    (`_whole_xml`), or one JSON call; None otherwise."""
    if body.lstrip().startswith(FUNCTION_START):
        return _whole_xml(body, tools)
    if body.lstrip().startswith("["):  # Falcon-H1's template: a JSON list of calls in one block
        return call_formats.json_call_list(body)
    call = _json_call(body)
    return None if call is None else (call,)


def parse_block(body: str, tools: list[dict] | None = None) -> tuple[ToolCall, ...]:
    """One block's body (between the tags) as its calls: every `<function=...>` block in it (a model may write
    several in one `<tool_call>`, as vLLM's qwen3_coder parser reads them), or its one JSON call; none when it is
    neither format. A body that is not whole (`whole_block`: unclosed, cut short) is read as far as it goes, each
    value ending at its first `</parameter>`."""
    calls = whole_block(body, tools)
    if calls is not None:
        return calls
    body = body.strip()
    if body.startswith(FUNCTION_START):
        return tuple(_xml_call(function.group(1).strip(), [(p.group(1).strip(), p.group(2)) for p in
                                                            _PARAMETER.finditer(function.group(2))], tools)
                     for function in _FUNCTION.finditer(body))
    return ()


def parse_tool_calls(text: str, tools: list[dict] | None = None, parser: str | None = None) -> ParsedText:
    """Every well-formed block of `text` as a call; the text before the first one (whitespace-trimmed; all of it
    when there is none) as content. An unclosed block at the end is parsed as if closed (a completion cut by its
    stop token). `parser`: the server's `--tool-call-parser` (`tool_formats.tool_format`)."""
    stream = ToolCallStream(tools, parser)
    content = stream.feed(text, finished=True)
    return ParsedText(content.strip() if stream.calls else content, tuple(stream.calls))


class ToolCallStream:
    """Incremental parsing of a growing text: `feed(text_so_far, finished)` returns the content to send now;
    new calls appear in `calls` (`new_calls()` returns those not yet taken). Content is held back from the
    first character that may start a block (a partial `<tool_call>` or `<function=` at the end, or the openings of
    the `parser`'s format: `tool_formats.tool_format`) until the block closes. With `pythonic` (no tags: the whole
    reply is one Python list of calls) a reply that starts, past white space, with `[` is held back to its end."""

    def __init__(self, tools: list[dict] | None = None, parser: str | None = None) -> None:
        self.tools = tools
        found = tool_format(parser)
        self._blocks = found.blocks
        self._bare_list = found.bare_list
        self.calls: list[ToolCall] = []
        self._taken = 0
        self._scanned = 0  # text[:_scanned] is decided (content sent or blocks parsed)
        self._held_space = ""  # trailing whitespace of the content, sent once more content follows it

    def new_calls(self) -> list[tuple[int, ToolCall]]:
        fresh = list(enumerate(self.calls))[self._taken:]
        self._taken = len(self.calls)
        return fresh

    def feed(self, text: str, finished: bool) -> str:
        """The content to send now: text before the first call, except a possible block start and trailing
        whitespace (which only goes out before more content, so the whitespace before a call is dropped)."""
        content = self._held_space + self._scan(text, finished)
        if finished:
            self._held_space = ""
            return content.rstrip() if self.calls else content
        kept = content.rstrip()
        self._held_space = content[len(kept):]
        return kept

    def _scan_bare_list(self, text: str, finished: bool) -> str:
        """`_scan` for `pythonic`: the reply's calls when, finished, it is one Python list of calls; else its text
        (held back while it may still become one: empty, or starting with `[`, and unfinished)."""
        if self._scanned == 0 and text.lstrip()[:1] in ("", "["):
            if not finished:
                return ""
            calls = call_formats.python_call_list(text) if text.strip().startswith("[") else None
            if calls:
                self.calls.extend(calls)
                self._scanned = len(text)
                return ""
        rest, self._scanned = text[self._scanned:], len(text)
        return rest

    def _scan(self, text: str, finished: bool) -> str:
        """The content in `text` from `_scanned` on (none after the first call), parsing the blocks there."""
        if self._bare_list:
            return self._scan_bare_list(text, finished)
        content = []

        def add(piece: str) -> None:
            if not self.calls:
                content.append(piece)

        while True:
            rest = text[self._scanned:]
            starts = [(rest.find(opening), opening, closing) for opening, closing in self._blocks if opening in rest]
            if not starts:
                keep = 0 if finished else max(_partial_suffix(rest, opening) for opening, _ in self._blocks)
                add(rest[: len(rest) - keep])
                self._scanned += len(rest) - keep
                return "".join(content)
            start, opening, closing = min(starts)
            add(rest[:start])
            block = _read_block(rest, start, (opening, closing), self._blocks, self.tools, finished)
            if block is None:
                self._scanned += start
                return "".join(content)
            block_end, calls = block
            if not calls:
                add(rest[start:block_end])
            self.calls.extend(calls)
            self._scanned += block_end


def _read_block(rest: str, start: int, tags: tuple[str, str], blocks: tuple[tuple[str, str], ...],
                tools: list[dict] | None, finished: bool) -> tuple[int, tuple[ToolCall, ...]] | None:
    """The block that opens at `start`: where it ends and its calls (none: it is text), or None while the text so
    far cannot tell. It ends at the first closing tag that makes it a whole call (`whole_block`), else at the first
    one followed, past white space, by another block or by the end of the text, else (finished) the whole rest if
    that is a whole call, else its first closing tag; one never closed is read to the end of the text. `tags`: its
    opening and closing tags; `blocks`: every block the parser reads (`tool_formats.ToolFormat.blocks`)."""
    opening, closing = tags
    openings = tuple(tag for tag, _ in blocks)

    def body(end: int) -> str:  # a bare function block is read with its tags
        return rest[start:end + len(closing)] if opening == FUNCTION_START else rest[start + len(opening):end]

    first, at = -1, start + len(opening)
    while (end := rest.find(closing, at)) >= 0:
        first = end if first < 0 else first
        at = end + len(closing)
        calls = _whole(opening, body(end), tools)
        if calls is not None:
            return at, calls
        after = rest[_SPACE.match(rest, at).end():]
        if after.startswith(openings) or (finished and not after):
            return at, _parse(opening, body(end), tools)
        if not finished and any(tag.startswith(after) for tag in openings):  # ("" too)
            return None
    if not finished:
        return None
    unclosed = rest[start:] if opening == FUNCTION_START else rest[start + len(opening):]
    calls = _whole(opening, unclosed, tools)
    if calls is not None or first < 0:
        return len(rest), calls or _parse(opening, unclosed, tools)
    return first + len(closing), _parse(opening, body(first), tools)


def _partial_suffix(text: str, tag: str) -> int:
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0
