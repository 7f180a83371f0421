"""Python-call tool formats as grammar rules: what a forced call is with `--tool-call-parser lfm2`, `olmo3` or
`pythonic` (`guided.TOOL_FORMATS` "lfm2", "olmo3", "pythonic"). Each call is written as those parsers read it
(`server.call_formats`): the function's name, then its arguments as keywords, each value a Python literal::

    lfm2       <|tool_call_start|>[get_weather(city="Paris", days=2), get_time()]<|tool_call_end|>
    olmo3      <function_calls>get_weather(city="Paris", days=2)\\nget_time()</function_calls>
    pythonic   [get_weather(city="Paris", days=2), get_time()]                      (the whole reply)

The keywords are the schema's `properties`, in their order (the order xgrammar writes a JSON object's keys), each
`required` one present, the others optional; no other keyword is written. A value is what the property's schema
allows as JSON (xgrammar's grammar of that schema, so every keyword xgrammar enforces holds) written as a Python
literal: `true`, `false`, `null` become `True`, `False`, `None`, inside lists, dicts and enum / const values too;
strings keep JSON's quotes and escapes less the two Python reads otherwise (`\\/`, and a `\\u` escape of a UTF-16
surrogate: Python does not join a pair into one character). `python_rules` writes the rules around the values'
grammars, `python_values` turns the text of a JSON grammar (xgrammar's EBNF) into the grammar of the same values
as Python literals.

A schema the call syntax cannot carry is a ValueError naming what: a tool or argument name that is no Python
identifier (or is a keyword), a `required` name not in `properties`, or a parameters keyword that constrains the
object as a whole (`minProperties`, `anyOf`, `patternProperties`...: a call holds only the named properties).
"""

from __future__ import annotations

import json
import keyword
import re
from collections.abc import Sequence
from typing import Any

# each format's (text before the calls, between two calls, after the calls)
PYTHON_FORMATS = {
    "lfm2": ("<|tool_call_start|>[", ", ", "]<|tool_call_end|>"),
    "olmo3": ("<function_calls>", "\n", "</function_calls>"),
    "pythonic": ("[", ", ", "]"),
}

# parameters keywords that say nothing the call syntax must enforce (additionalProperties: only the named properties
# are written, which any value of it allows)
_IGNORED_KEYS = frozenset({"type", "properties", "required", "additionalProperties", "unevaluatedProperties", "$defs",
                           "definitions", "title", "description", "$schema", "$id", "$comment", "examples",
                           "default", "strict"})
DEFINITIONS = ("$defs", "definitions")


def _identifier(name: Any, what: str) -> str:
    if not isinstance(name, str) or not name.isidentifier() or keyword.iskeyword(name):
        raise ValueError(f"{what} {name!r} cannot be forced in the Python-call format: it is not a Python "
                         "identifier (a call writes it bare)")
    return name


def arguments_of(name: str, parameters: dict[str, Any]) -> tuple[list[tuple[str, Any]], set[str]]:
    """A tool's (argument name, value schema) pairs in the schema's order, each schema carrying the parameters'
    `$defs` / `definitions` (what its `$ref`s name), and the names that are required; a ValueError for what a
    Python call cannot carry (module docstring)."""
    _identifier(name, "the tool name")
    if not isinstance(parameters, dict):
        raise ValueError(f"the parameters of {name!r} are not a JSON schema object")
    if parameters.get("type", "object") != "object":
        raise ValueError(f"the parameters of {name!r} are not an object schema: a call takes keyword arguments")
    other = sorted(key for key in parameters if key not in _IGNORED_KEYS)
    if other:
        raise ValueError(f"the parameters keyword {other[0]!r} of {name!r} cannot be forced in the Python-call "
                         "format: a call holds only the named properties")
    properties = parameters.get("properties") or {}
    required = parameters.get("required") or []
    if not isinstance(properties, dict) or not isinstance(required, list):
        raise ValueError(f"the parameters of {name!r} need `properties` as an object and `required` as a list")
    missing = next((key for key in required if key not in properties), None)
    if missing is not None:
        raise ValueError(f"{name!r} requires {missing!r}, which its `properties` do not describe: a forced call "
                         "in the Python-call format writes described arguments only")
    defs = {key: parameters[key] for key in DEFINITIONS if key in parameters}
    found = []
    for key, schema in properties.items():
        _identifier(key, f"the argument of {name!r}")
        if schema is False:
            raise ValueError(f"the argument {key!r} of {name!r} allows no value")
        schema = {} if schema is True else schema
        if not isinstance(schema, dict):
            raise ValueError(f"the schema of the argument {key!r} of {name!r} is not an object")
        found.append((key, {**schema, **defs}))
    return found, set(required)


def python_rules(tools: Sequence[tuple[str, Sequence[tuple[str, str]], set[str]]], parallel: bool, tool_format: str,
                 *, prefix: str) -> tuple[str, list[str]]:
    """The EBNF rules of the calls around their values' rules: `tools` holds each tool's name, its (argument,
    value rule name) pairs in order and its required names. Returns (the root rule's name, the rule lines); every
    rule name written here starts with `prefix` (one no other rule of the grammar starts with). `parallel`: one or
    more calls, else one."""
    opening, separator, closing = PYTHON_FORMATS[tool_format]
    rules = []
    for k, (name, arguments, required) in enumerate(tools):
        # first_i: the arguments from i on, none written before; rest_i: the same after one was written
        n = len(arguments)
        rules += [f'{prefix}_{k}_first_{n} ::= ""', f'{prefix}_{k}_rest_{n} ::= ""']
        for i in range(n - 1, -1, -1):
            key, value = arguments[i]
            first = f'"{key}=" {value} {prefix}_{k}_rest_{i + 1}'
            rest = f'", {key}=" {value} {prefix}_{k}_rest_{i + 1}'
            if key not in required:
                first += f" | {prefix}_{k}_first_{i + 1}"
                rest += f" | {prefix}_{k}_rest_{i + 1}"
            rules += [f"{prefix}_{k}_first_{i} ::= {first}", f"{prefix}_{k}_rest_{i} ::= {rest}"]
        rules.append(f'{prefix}_call_{k} ::= "{name}(" {prefix}_{k}_first_0 ")"')
    rules.append(f"{prefix}_call ::= " + " | ".join(f"{prefix}_call_{k}" for k in range(len(tools))))
    more = f" ({_quoted(separator)} {prefix}_call)*" if parallel else ""
    rules.append(f"{prefix}_calls ::= {_quoted(opening)} {prefix}_call{more} {_quoted(closing)}")
    return f"{prefix}_calls", rules


def _quoted(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


# xgrammar's EBNF: a string literal, a character class, or `Regex("...")` (whose literal is a regex, left alone)
_TOKEN = re.compile(r'Regex\("(?:[^"\\]|\\.)*"|"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]', re.S)
_JSON_NAMES = {"true": "True", "false": "False", "null": "None"}
# what may follow a JSON string (a lookahead of xgrammar's): in a call, `)` too
_STRING_LOOKAHEAD = "(=([ \\n\\r\\t]* [,}\\]:]))"
_CALL_STRING_LOOKAHEAD = "(=([ \\n\\r\\t]* [,}\\]:)]))"
# JSON's escapes after a backslash, and those Python reads alike (no `\/`, no `\u` of a UTF-16 surrogate)
_JSON_ESCAPE = '(([\\"\\\\/bfnrt]) | ("u" [A-Fa-f0-9] [A-Fa-f0-9] [A-Fa-f0-9] [A-Fa-f0-9]))'
_HEX = "[A-Fa-f0-9]"
_PYTHON_ESCAPE = (f'(([\\"\\\\bfnrt]) | ("u" [0-9A-Ca-cE-Fe-f] {_HEX} {_HEX} {_HEX}) | '
                  f'("u" [Dd] [0-7] {_HEX} {_HEX}))')
_LEFT_NAME = re.compile(r"(?<![\w\"\\])(?:true|false|null)(?![\w\"])")


def python_literal(value: Any) -> str:
    """A JSON value as Python literal text (JSON's own text but for True, False, None)."""
    if value is True or value is False or value is None:
        return _JSON_NAMES[json.dumps(value)]
    if isinstance(value, list):
        return "[" + ", ".join(python_literal(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k, ensure_ascii=False)}: {python_literal(v)}" for k, v in value.items()) \
            + "}"
    return json.dumps(value, ensure_ascii=False)


def _python_term(term: str) -> str:
    """One string literal of a JSON grammar, its text rewritten as Python: a whole JSON value (`true`, an enum's
    `[1,true]`) as `python_literal` writes it; a piece of one (`"{"`, `": "`, a key) as it is."""
    try:
        value = json.loads(json.loads(term))
    except ValueError:  # (a piece, or an escape JSON does not have)
        return term
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        return _quoted(python_literal(value))
    return term


def python_values(grammar: str) -> str:
    """The text of an xgrammar JSON grammar made the grammar of the same values written as Python literals (module
    docstring). A RuntimeError where the text holds a JSON constant this does not know how to rewrite (an xgrammar
    that writes its grammars otherwise)."""

    def term(match: re.Match[str]) -> str:
        token = match.group(0)
        if not token.startswith('"'):  # (a character class, a regex)
            return token
        token = _python_term(token)
        try:
            text = json.loads(token)
        except ValueError:
            return token
        if not text.startswith('"') and _LEFT_NAME.search(text):
            raise RuntimeError(f"cannot write the JSON grammar term {token} as Python")
        return token

    text = _TOKEN.sub(term, grammar)
    escapes = len(re.findall(r"^basic_escape\w* ::= ", text, re.M))
    if text.count(_JSON_ESCAPE) != escapes:
        raise RuntimeError("xgrammar's JSON string escapes are not written as this module expects")
    text = text.replace(_JSON_ESCAPE, _PYTHON_ESCAPE).replace(_STRING_LOOKAHEAD, _CALL_STRING_LOOKAHEAD)
    if _TOKEN.sub('""', text).count("(=") != text.count(_CALL_STRING_LOOKAHEAD):
        raise RuntimeError("xgrammar's JSON grammar holds a lookahead this module does not know")
    return text
