"""The bodies of the tool-call blocks that are not Qwen's: each reader takes a block's body (the text between its
tags) and returns its calls when the body is whole, or None (the block is then text). `tool_formats` says which
parser reads which block; `tool_parsers` finds the blocks.

    json_call_list     <TOOLCALL>, <tool_calls>   [{"name": "f", "arguments": {"a": 1}}, ...]
    python_call_list   <|tool_call_start|>        [f(a=1), g(b="x")]     (LFM2; the bare reply with `pythonic`)
    python_call_lines  <function_calls>           f(a=1)\\ng(b="x")      (OLMo 3: one call a line; a list too)
    kimi_section       <|tool_calls_section_begin|>
                         <|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{"a": 1}<|tool_call_end|> ...

Python calls are read with `ast` (a call of a plain name with keyword arguments only, each a literal: strings,
numbers, True / False / None, lists, tuples, dicts of them); OLMo 3's `true`, `false` and `null` too, as vLLM's olmo3
parser takes them. Arguments are written as JSON text; a value JSON cannot hold (a set, bytes, NaN) makes the body
text. Kimi's call id (`functions.NAME:INDEX`) is kept as the call's id, as vLLM's kimi_k2 parser keeps it (Kimi's
chat template writes it back on the next turn); NAME is what follows the last `.` before the `:`.
"""

from __future__ import annotations

import ast
from typing import Any

from hybridcache.server.tool_call import ToolCall, call_of, named_call, strict_json
from hybridcache.server.tool_formats import KIMI_ARGUMENTS_BEGIN, KIMI_CALL_BEGIN, KIMI_CALL_END

_JSON_NAMES = {"true": True, "false": False, "null": None}


def json_call_list(body: str) -> tuple[ToolCall, ...] | None:
    """A JSON list of calls (`call_of`), read with a missing `[` or `]` added (NVIDIA's parser adds them); None
    unless it parses to a list of at least one item and every item is a call."""
    text = body.strip()
    text = ("" if text.startswith("[") else "[") + text + ("" if text.endswith("]") else "]")
    try:
        items = strict_json(text, strict=False)
    except ValueError:
        return None
    calls = tuple(call_of(item) for item in items) if isinstance(items, list) else ()
    return calls if calls and None not in calls else None


def _literal(node: ast.expr, json_names: bool) -> Any:
    """A literal argument's value; `json_names`: the bare names true / false / null are JSON's constants."""
    if json_names:
        node = _JsonNames().visit(node)
    return ast.literal_eval(node)


class _JsonNames(ast.NodeTransformer):
    def visit_Name(self, node: ast.Name) -> ast.AST:
        return ast.Constant(_JSON_NAMES[node.id]) if node.id in _JSON_NAMES else node


def _python_call(node: ast.expr, json_names: bool) -> ToolCall | None:
    """`name(key=literal, ...)` as a call, or None (positional arguments, `**kwargs`, a non-literal value)."""
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
        return None
    arguments = {}
    for keyword in node.keywords:
        if keyword.arg is None or keyword.arg in arguments:
            return None
        try:
            arguments[keyword.arg] = _literal(keyword.value, json_names)
        except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
            return None
    return named_call(node.func.id, arguments)


def _python_expression(text: str) -> ast.expr | None:
    try:
        return ast.parse(text.strip(), mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):  # (ValueError: a NUL in the text)
        return None


def python_call_list(body: str, json_names: bool = False) -> tuple[ToolCall, ...] | None:
    """A Python list of calls (`[f(a=1), g()]`), or one call alone; None unless every item is a call and there is
    at least one."""
    node = _python_expression(body)
    items = node.elts if isinstance(node, ast.List) else [node] if isinstance(node, ast.Call) else []
    calls = tuple(_python_call(item, json_names) for item in items)
    return calls if calls and None not in calls else None


def python_call_lines(body: str) -> tuple[ToolCall, ...] | None:
    """OLMo 3's calls: one Python call a line (JSON's true / false / null allowed), or the body as one list or
    call (a call written over several lines)."""
    lines = [line for line in body.splitlines() if line.strip()]
    if len(lines) > 1:
        calls = python_call_list("[" + ",\n".join(lines) + "]", json_names=True)
        if calls is not None:
            return calls
    return python_call_list(body, json_names=True)


def _kimi_name(call_id: str) -> str:
    """`functions.get_weather:0` -> `get_weather`."""
    return call_id.rsplit(":", 1)[0].rsplit(".", 1)[-1].strip() if ":" in call_id else call_id.rsplit(".", 1)[-1]


def kimi_section(body: str) -> tuple[ToolCall, ...] | None:
    """A Kimi section's calls: nothing but `<|tool_call_begin|>ID<|tool_call_argument_begin|>JSON<|tool_call_end|>`
    (white space between), at least one; a call's JSON ends at the first `<|tool_call_end|>` before which it parses
    (an argument may hold the tag). None otherwise."""
    calls, at = [], 0
    while body[at:].strip():
        at += len(body[at:]) - len(body[at:].lstrip())
        if not body.startswith(KIMI_CALL_BEGIN, at):
            return None
        arguments_at = body.find(KIMI_ARGUMENTS_BEGIN, at)
        if arguments_at < 0:
            return None
        call_id = body[at + len(KIMI_CALL_BEGIN):arguments_at].strip()
        name = _kimi_name(call_id)
        start = arguments_at + len(KIMI_ARGUMENTS_BEGIN)
        call, end = None, start
        while call is None and (end := body.find(KIMI_CALL_END, end)) >= 0:
            call = _kimi_call(call_id, name, body[start:end])
            end += len(KIMI_CALL_END)
        if call is None:
            return None
        calls.append(call)
        at = end
    return tuple(calls) or None


def _kimi_call(call_id: str, name: str, arguments: str) -> ToolCall | None:
    if not name or KIMI_CALL_BEGIN in call_id:
        return None
    try:
        value = strict_json(arguments, strict=False)
    except ValueError:
        return None
    return named_call(name, value, call_id) if isinstance(value, dict) else None
