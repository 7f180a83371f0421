"""One parsed tool call (`ToolCall`, OpenAI's `tool_calls` entry) and the JSON helpers every tool-call format's
reader shares: strict JSON in (`strict_json`: no NaN, no Infinity), JSON text out (`dumps`), and a parsed
`{"name": ..., "arguments": ...}` object as a call (`call_of`)."""

from __future__ import annotations

import json
import math
import uuid
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ToolCall:
    """One call: its id, the function name and its arguments as JSON text (what OpenAI's `arguments` holds)."""

    id: str
    name: str
    arguments: str

    def as_openai(self, index: int | None = None) -> dict[str, Any]:
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


@dataclass(frozen=True)
class ParsedText:
    content: str
    tool_calls: tuple[ToolCall, ...]


def new_id() -> str:
    """A fresh call id, as OpenAI writes them (`call_` and 24 hex digits)."""
    return f"call_{uuid.uuid4().hex[:24]}"


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite(text: str) -> float:
    number = float(text)
    if not math.isfinite(number):
        raise ValueError(f"{text} is too large for a float")
    return number


def strict_json(text: str, **options: Any) -> Any:
    """`json.loads` without NaN / Infinity, written or reached by a number too large for a float (`1e400`): Python's
    json takes and writes them, no strict JSON parser does. Nesting too deep to parse is a ValueError too."""
    try:
        return json.loads(text, parse_constant=_refuse_constant, parse_float=_finite, **options)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def dumps(value: Any) -> str:
    """`value` as JSON text: characters as they are, but escaped when the text holds a lone surrogate (JSON's
    `"\\ud800"` parses to one), which UTF-8 cannot encode. A ValueError for what JSON cannot write (NaN, a set)."""
    try:
        text = json.dumps(value, ensure_ascii=False, allow_nan=False)
    except TypeError as error:  # (a set, bytes: not JSON)
        raise ValueError(str(error)) from None
    try:
        text.encode()
    except UnicodeEncodeError:
        return json.dumps(value, allow_nan=False)
    return text


def call_of(data: Any, call_id: str | None = None) -> ToolCall | None:
    """A parsed JSON call (an object with a string `name`, its `arguments` or `parameters`) as a call, or None.
    Arguments the model wrote as a JSON string are kept as that text (Granite 4 writes them so at times)."""
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return None
    return named_call(data["name"], data.get("arguments", data.get("parameters", {})), call_id)


def named_call(name: str, arguments: Any, call_id: str | None = None) -> ToolCall | None:
    """A call of `name` with `arguments` (a value, written as JSON, or JSON text kept as it is); None when the
    name or the text holds a lone surrogate (UTF-8 cannot encode it) or the value is not JSON."""
    try:
        text = arguments if isinstance(arguments, str) else dumps(arguments)
        (name + text).encode()
    except (UnicodeEncodeError, ValueError):
        return None
    return ToolCall(call_id or new_id(), name, text)
