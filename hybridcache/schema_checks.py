"""Which JSON schemas xgrammar 0.2.9 would read without enforcing: `unenforced_keyword` names the first keyword
of a schema that xgrammar drops, loosens or ignores (so `guided` compiles such a schema with llguidance instead, as
vLLM's `auto` backend falls back to guidance, or refuses it, naming the keyword and its place, where llguidance
refuses it too; never a grammar that lets outputs break the schema). Pure Python; `guided` calls it before
compiling a JSON-schema grammar."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

# The string formats xgrammar writes a grammar for (0.2.x); it reads any other format as any string.
_STRING_FORMATS = frozenset({"email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid",
                             "uri", "uri-reference", "uri-template", "json-pointer", "relative-json-pointer"})
_ARRAY_KEYWORDS = ("contains", "minContains", "maxContains")  # (and `uniqueItems: true`)
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMAS = ("items", "additionalItems", "additionalProperties", "contains", "propertyNames", "not", "if", "then",
               "else", "unevaluatedItems", "unevaluatedProperties")
_SUBSCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
# The JSON Schema validation and applicator keywords (draft 7's `dependencies` too): every other keyword (`title`,
# `example`, `x-*`, `enumNames`, `discriminator`...) is an annotation (2020-12: an unknown keyword is one), which
# xgrammar may drop with no harm.
_CONSTRAINING = frozenset({
    "type", "enum", "const", "properties", "patternProperties", "additionalProperties", "propertyNames", "required",
    "minProperties", "maxProperties", "items", "prefixItems", "additionalItems", "contains", "minContains",
    "maxContains", "minItems", "maxItems", "uniqueItems", "minLength", "maxLength", "pattern", "format", "minimum",
    "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "allOf", "anyOf", "oneOf", "not", "if", "then",
    "else", "dependentRequired", "dependentSchemas", "dependencies", "unevaluatedProperties", "unevaluatedItems",
    "$ref", "$dynamicRef"})
# xgrammar builds a schema holding one of these from it alone, dropping every other keyword beside it.
_ALONE_KEYWORDS = ("$ref", "allOf", "anyOf", "oneOf", "const", "enum")
_IGNORED_KEYWORDS = ("not", "if", "then", "else", "dependentRequired", "dependentSchemas")
# Keywords of one type that xgrammar reads only where the schema says its type ("type", or for objects and arrays a
# keyword that implies it); with neither it takes any JSON value.
_TYPED_KEYWORDS = {
    "string": ("pattern", "format", "minLength", "maxLength"),
    "number": ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"),
    "object": ("required", "minProperties", "maxProperties", "patternProperties", "propertyNames"),
    "array": ("minItems", "maxItems"),
}
_TYPE_IMPLIED_BY = {"object": ("properties", "additionalProperties", "unevaluatedProperties"),
                    "array": ("items", "prefixItems")}
_JSON_TYPES: dict[str, Callable[[Any], bool]] = {
    "string": lambda v: isinstance(v, str), "boolean": lambda v: isinstance(v, bool), "null": lambda v: v is None,
    "object": lambda v: isinstance(v, dict), "array": lambda v: isinstance(v, list),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "integer": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and float(v).is_integer(),
}


def unenforced_keyword(schema: Any, at: str = "") -> str | None:
    """The first keyword of a JSON schema that xgrammar reads without enforcing it (its grammar would let output
    through that breaks it; `guided` then takes llguidance), named with its place (`uniqueItems (at
    /properties/tags)`), or None. As vLLM's
    `has_xgrammar_unsupported_json_features`: `uniqueItems` (true), `contains`, `minContains`, `maxContains`;
    `multipleOf` (an integer one too: xgrammar drops it beside a range); a string's `minLength` / `maxLength` next
    to its `pattern` or `format`; a string format xgrammar does not know; `propertyNames` next to `properties` or
    `additionalProperties`; `patternProperties` next to `properties`. Beyond vLLM (xgrammar 0.2.9 drops these):
    a keyword that constrains (`_CONSTRAINING`) beside `$ref`, `allOf`, `anyOf`, `oneOf`, `const` or `enum` (any
    other keyword is an annotation and may stand there: `title`, `example`, `x-*`; so may a `type` that every
    branch or value keeps to); `allOf` of more than one branch; `not`, `if` / `then` / `else`, `dependentRequired`,
    `dependentSchemas`; a `required` name without a `properties` entry; a type's keyword (`pattern`, `minimum`,
    `minItems`...) where the schema names no type; a `pattern` that names `"`, `\\` or a control character outside
    a class, or a class of nothing else (xgrammar then matches it against the JSON text, unescaped:
    `_json_escaped_in`). A `required` that is not a list of names is a ValueError (the schema is malformed)."""
    if isinstance(schema, list):
        return next((found for i, item in enumerate(schema) if (found := unenforced_keyword(item, f"{at}/{i}"))),
                    None)
    if not isinstance(schema, dict):
        return None
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(name, str) for name in required):
        raise ValueError(f"invalid JSON schema: 'required' must be a list of property names (at {at or 'the root'})")
    found = _unenforced_here(schema)
    if found is not None:
        return f"{found} (at {at or 'the root'})"
    for key in _SUBSCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            for name, subschema in schema[key].items():
                if found := unenforced_keyword(subschema, f"{at}/{key}/{name}"):
                    return found
    for key in dict.fromkeys(_SUBSCHEMAS + _SUBSCHEMA_LISTS):
        subschema = schema.get(key)
        if key == "propertyNames" and isinstance(subschema, dict) and "type" not in subschema:
            subschema = {**subschema, "type": "string"}  # (a property name is a string: xgrammar reads it so)
        if key in schema and (found := unenforced_keyword(subschema, f"{at}/{key}")):
            return found
    return None


def _unenforced_here(schema: dict[str, Any]) -> str | None:
    """The first keyword of this schema object alone (not its subschemas) that xgrammar would not enforce."""
    types = schema.get("type")
    types = {types} if isinstance(types, str) else set(types) if isinstance(types, list) else set()
    found = _dropped_beside(schema, types) or next((key for key in _IGNORED_KEYWORDS if key in schema), None)
    if found is not None:
        return found
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        return f"allOf of {len(schema['allOf'])} branches"
    if not types and not any(key in schema for key in _ALONE_KEYWORDS):
        found = next((f"{key} with no type" for kind, keys in _TYPED_KEYWORDS.items() for key in keys
                      if key in schema and not any(k in schema for k in _TYPE_IMPLIED_BY.get(kind, ()))), None)
        if found is not None:
            return found
    properties = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    missing = [name for name in schema.get("required") or () if name not in properties]
    if missing:
        return f"required {missing[0]!r} with no properties entry"
    for place, pattern in [("pattern", schema.get("pattern")), *(
            ("patternProperties", key) for key in schema.get("patternProperties") or ())]:
        if isinstance(pattern, str) and (character := _json_escaped_in(pattern)):
            return f"{place} {pattern!r} (it can match {character}, which JSON escapes)"
    if schema.get("uniqueItems"):
        return "uniqueItems"
    found = next((key for key in _ARRAY_KEYWORDS if key in schema), None)
    if found is not None:
        return found
    if "multipleOf" in schema:  # (as vLLM: xgrammar 0.2.9 drops even an integer one beside a range)
        return "multipleOf"
    string_format = schema.get("format") if "string" in types else None
    if string_format is not None and string_format not in _STRING_FORMATS:
        return f"format {string_format!r}"
    bounds = [key for key in ("minLength", "maxLength") if key in schema]
    if bounds and ("pattern" in schema or string_format is not None):
        return f"{bounds[0]} next to {'pattern' if 'pattern' in schema else 'format'}"
    beside = [key for key in ("properties", "additionalProperties") if key in schema]
    if "propertyNames" in schema and beside:
        return f"propertyNames next to {beside[0]}"
    if "patternProperties" in schema and "properties" in schema:
        return "patternProperties next to properties"
    return None


def _dropped_beside(schema: dict[str, Any], types: set[str]) -> str | None:
    """`<keyword> next to <alone keyword>` for a constraining keyword xgrammar drops beside `$ref`, `allOf`,
    `anyOf`, `oneOf`, `const` or `enum` (it builds the schema from that one alone), or None."""
    alone = next((key for key in _ALONE_KEYWORDS if key in schema), None)
    if alone is None:
        return None
    beside = [key for key in schema if key != alone and key in _CONSTRAINING]
    if beside == ["type"] and types and _keeps_to(schema[alone], alone, types):
        return None
    beside = [key for key in beside if key != "type"] or beside  # (the keyword that says the most)
    return f"{beside[0]} next to {alone}" if beside else None


def _keeps_to(value: Any, alone: str, types: set[str]) -> bool:
    """Whether what `alone` (`allOf`, `anyOf`, `oneOf`, `const`, `enum`) allows is all of `types`, so the `type`
    xgrammar drops beside it says nothing more: every value is of one of them, every branch keeps to them
    (`_branch_keeps_to`)."""
    if alone in ("allOf", "anyOf", "oneOf"):
        return isinstance(value, list) and all(_branch_keeps_to(branch, types) for branch in value)
    values = [value] if alone == "const" else value if isinstance(value, list) else []
    return alone in ("const", "enum") and all(any(_JSON_TYPES.get(t, lambda v: False)(v) for t in types)
                                              for v in values)


def _branch_keeps_to(branch: Any, types: set[str]) -> bool:
    """Whether every value a branch of `anyOf` / `oneOf` / `allOf` allows is of one of `types`: its `type` is among
    them (an integer is a number), or it has none and its `const` / `enum` values, its own branches or a keyword that
    implies a type (`properties`: an object; `_TYPE_IMPLIED_BY`) keep to them. `{"const": "#FF0000", "title":
    "Red"}` keeps to `string`; `{"properties": {...}}` to `object`; `{"$ref": ...}` to none that is known here."""
    if not isinstance(branch, dict):
        return False
    named = branch.get("type")
    if named is not None:
        named = {named} if isinstance(named, str) else set(named) if isinstance(named, list) else {None}
        return named <= types | ({"integer"} if "number" in types else set())
    alone = next((key for key in ("const", "enum", "anyOf", "oneOf", "allOf") if key in branch), None)
    if alone is not None:
        return _keeps_to(branch[alone], alone, types)
    implied = {kind for kind, keys in _TYPE_IMPLIED_BY.items() if any(key in branch for key in keys)}
    return bool(implied) and implied <= types


# Escapes in a regular expression of a character JSON writes escaped: `"`, `\`, and the control characters.
_ESCAPED_BY_JSON = {"\\\\": "a backslash", '\\"': 'a "', "\\n": "a newline", "\\r": "a carriage return",
                    "\\t": "a tab", "\\f": "a form feed", "\\v": "a vertical tab", "\\0": "a NUL",
                    "\\a": "a bell", "\\e": "an escape", "\\b": "a backspace"}


def _json_escaped_in(pattern: str) -> str | None:
    """What a `pattern` names that JSON writes escaped (`"`, `\\`, a control character), or None: a literal or an
    escape outside a class, or a `[...]` class with nothing else in it (`[\\n]`, `[\\t-\\r]`). xgrammar 0.2.9 matches
    a pattern against a string's JSON text with those characters left out (`.`, `[^\\n]`, `[\\x00-\\x7F]`, `\\s`:
    enforced, a little tighter); but where no string without them matches, it matches the pattern as is: such a
    character comes out raw (invalid JSON) or escaped (then the decoded value breaks the pattern), and `.` beside it
    takes a `"`. A class that holds another character (`[^"]`, `[a\\n]`, `[!-"]`) is taken."""
    i = 0
    while i < len(pattern):
        character = pattern[i]
        if character == "[":
            i, found = _class_escaped(pattern, i)
            if found is not None:
                return found
            continue
        if character == '"':
            return 'a "'
        if ord(character) < 0x20:
            return f"the control character U+{ord(character):04X}"
        if character == "\\" and i + 1 < len(pattern):
            escape = pattern[i:i + 2]
            if escape in _ESCAPED_BY_JSON and escape != "\\b":  # (`\\b` outside a class: a word boundary)
                return _ESCAPED_BY_JSON[escape]
            code = _escaped_code(pattern, i)
            if code is not None and _escaped_by_json(code):
                return f"U+{code:04X}"
            i += 2
            continue
        i += 1
    return None


# Code point ranges (inclusive) of the shorthand classes, and of the characters JSON writes as they are.
_SHORTHANDS = {"d": [(0x30, 0x39)], "w": [(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)],
               "s": [(0x09, 0x0D), (0x20, 0x20), (0xA0, 0xA0), (0x2028, 0x2029), (0xFEFF, 0xFEFF)]}
_UNESCAPED_BY_JSON = [(0x20, 0x21), (0x23, 0x5B), (0x5D, 0x10FFFF)]


def _escaped_by_json(code: int) -> bool:
    return code < 0x20 or code in (0x22, 0x5C)


def _class_escaped(pattern: str, start: int) -> tuple[int, str | None]:
    """The index past the `[...]` class at `pattern[start]`, and what it names that JSON escapes (as
    `_json_escaped_in`) where it holds no other character, else None."""
    i = start + 1
    negated = pattern[i:i + 1] == "^"
    i += negated
    ranges: list[tuple[int, int]] = []
    first_escaped = None
    while i < len(pattern) and pattern[i] != "]":
        i, low, name = _class_atom(pattern, i)
        high = low
        if pattern[i:i + 1] == "-" and pattern[i + 1:i + 2] not in ("", "]") and isinstance(low, int):
            j, end, _ = _class_atom(pattern, i + 1)
            if isinstance(end, int):
                i, high = j, end
        ranges += low if isinstance(low, list) else [(low, high)]
        if first_escaped is None and not isinstance(low, list) and _escaped_by_json(low):
            first_escaped = name
    if negated:
        ranges = _complement(ranges)
    plain = any(max(low, plain_low) <= min(high, plain_high)
                for low, high in ranges for plain_low, plain_high in _UNESCAPED_BY_JSON)
    return i + 1, None if plain or not ranges else first_escaped or "only characters JSON escapes"


def _class_atom(pattern: str, i: int) -> tuple[int, int | list[tuple[int, int]], str]:
    """One member of a class at `pattern[i]`: the index past it, its code point (or ranges, for `\\d`, `\\W`, `\\p{..}`
    ...) and its name."""
    if pattern[i] != "\\" or i + 1 >= len(pattern):
        code = ord(pattern[i])
        name = 'a "' if code == 0x22 else f"the control character U+{code:04X}"
        return i + 1, code, name
    escape, kind = pattern[i:i + 2], pattern[i + 1]
    if kind.lower() in _SHORTHANDS:
        ranges = _SHORTHANDS[kind.lower()]
        return i + 2, _complement(ranges) if kind.isupper() else ranges, escape
    if kind in "pP" and pattern[i + 2:i + 3] == "{":
        return pattern.find("}", i) + 1 or len(pattern), [(0x20, 0x10FFFF)], escape  # (assumed to hold others)
    named = {"n": 0x0A, "r": 0x0D, "t": 0x09, "f": 0x0C, "v": 0x0B, "0": 0x00, "a": 0x07, "e": 0x1B, "b": 0x08}
    if kind in named:
        return i + 2, named[kind], _ESCAPED_BY_JSON.get(escape, escape)
    code = _escaped_code(pattern, i)
    if code is not None:
        length = {"x": 4, "c": 3}.get(kind) or (6 if pattern[i + 2:i + 3] != "{" else pattern.find("}", i) + 1 - i)
        return i + length, code, f"U+{code:04X}"
    return i + 2, ord(kind), _ESCAPED_BY_JSON.get(escape, escape)


def _complement(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The code points (0 to U+10FFFF) outside `ranges`."""
    result, low = [], 0
    for start, end in sorted(ranges):
        if start > low:
            result.append((low, start - 1))
        low = max(low, end + 1)
    return result + [(low, 0x10FFFF)] if low <= 0x10FFFF else result


def _escaped_code(pattern: str, i: int) -> int | None:
    """The code point of a `\\xHH`, `\\uHHHH`, `\\u{H...}` or `\\cX` escape at `pattern[i]`, or None."""
    kind, rest = pattern[i + 1], pattern[i + 2:]
    match = (re.match(r"[0-9a-fA-F]{2}", rest) if kind == "x" else
             re.match(r"\{([0-9a-fA-F]+)\}|[0-9a-fA-F]{4}", rest) if kind == "u" else None)
    if match is not None:
        return int(match.group(0).strip("{}"), 16)
    return ord(rest[0]) % 32 if kind == "c" and rest[:1].isalpha() else None
