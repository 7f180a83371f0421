"""Structured output: a constraint on what a completion may be (JSON, a JSON schema, a regex, a grammar, a
choice or a Qwen-format tool call), enforced token by token with xgrammar.

`GuidedSpec` is what a request asks for (hashable, it rides in `SamplingParams.guided`). `GrammarCache` turns
specs into xgrammar matchers for one tokenizer; each completion of a request (n > 1) gets its own matcher, so
the grammar state forks: every completion advances only by its own tokens. The sampler applies
`fill_bitmask`'s allowed-token bitmask; the engine calls `accept` with each sampled token.

xgrammar is imported only when a constrained request arrives (it is the `guided` extra).
"""

from __future__ import annotations

import enum
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch


class GuidedKind(enum.Enum):
    JSON_OBJECT = "json_object"  # any JSON object
    JSON_SCHEMA = "json_schema"  # `spec`: the schema as JSON text
    REGEX = "regex"
    GRAMMAR = "grammar"  # EBNF (GBNF) text, or Lark text (no `::=` rule: `is_lark`)
    CHOICE = "choice"  # `spec`: a JSON list of strings, the completion is one of them
    TOOL_CALLS = "tool_calls"  # `spec`: a JSON list of tool schemas; Qwen <tool_call> blocks (one unless `parallel`)


@dataclass(frozen=True)
class GuidedSpec:
    """A constraint: `kind` and its `spec` text. `starts_after`: the constraint applies from the token after the
    one with which the completion's text first contains this marker, and the completion is free until then (a
    reasoning model's `</think>`: the answer is constrained, its reasoning is not, as vLLM does with a reasoning
    parser); "" = from the first token. `parallel` (TOOL_CALLS only): one or more calls, a newline between two (as
    Qwen's chat templates write them), rather than exactly one."""

    kind: GuidedKind
    spec: str = ""
    starts_after: str = ""
    parallel: bool = False

    @classmethod
    def json_schema(cls, schema: dict[str, Any]) -> GuidedSpec:
        """The schema's keys keep their order: a schema's `properties` order is the order the output writes them
        in (xgrammar's, OpenAI's and vLLM's rule), so two schemas that differ only in key order differ."""
        return cls(GuidedKind.JSON_SCHEMA, json.dumps(schema))

    @classmethod
    def tool_calls(cls, tools: Sequence[dict[str, Any]], parallel: bool = False) -> GuidedSpec:
        """Qwen3's tool-call format, one block: `<tool_call>\\n{"name": N, "arguments": A}\\n</tool_call>`
        with N one of `tools`' names and A valid for that tool's `parameters` schema (arguments in its order);
        `parallel`: one or more such blocks, a newline between two."""
        return cls(GuidedKind.TOOL_CALLS, json.dumps(list(tools)), parallel=parallel)


class GuidedUnavailable(ValueError):
    """Structured output needs the xgrammar package (a ValueError: the request asks for what is missing)."""


def _xgrammar():
    try:
        import xgrammar
    except ImportError as error:
        if error.name == "xgrammar":
            raise GuidedUnavailable("structured output needs the xgrammar package (pip install "
                                    "'hybridcache-llm[guided]')") from error
        raise GuidedUnavailable(f"structured output needs xgrammar, which is installed but fails to import: "
                                f"{error}") from error
    return xgrammar


_TOJSON_SEPARATORS = (", ", ": ")  # how Jinja's tojson (and json.dumps) writes JSON: what chat templates render


class GrammarCache:
    """Compiles specs for one tokenizer and makes matchers. Compiled grammars are kept by spec, the least recently
    used dropped once they pass `limit_bytes` together (vLLM keeps xgrammar's compiler cache at 512 MiB: a JSON
    schema over a 150k vocabulary compiles to ~190 KB, and a server sees a new schema with every request of some
    clients); the one just compiled is kept whatever its size.

    Thread-safe: the server compiles a request's spec (`check`, seconds for a large schema) on a worker thread
    while the engine thread steps on, and the engine thread's `matcher` then finds it compiled. A lock guards the
    kept grammars and their byte count; compiling runs outside it (two threads that compile the same spec at once
    both compile it, and the first kept is used)."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int],
                 limit_bytes: int = 512 << 20) -> None:
        self._hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size
        self._stop_token_ids = list(stop_token_ids)
        self._compiler = None
        self._compiled: OrderedDict[GuidedSpec, Any] = OrderedDict()  # least recently used first
        self._limit_bytes = limit_bytes
        self.num_bytes = 0  # the compiled grammars kept
        self._lock = threading.Lock()  # guards `_compiled`, `num_bytes` and the making of `_compiler`

    def check(self, spec: GuidedSpec) -> None:
        """Compile `spec` now (and keep it); raises ValueError (bad schema, regex or grammar, or a schema keyword
        xgrammar would not enforce) or GuidedUnavailable."""
        self._compile(spec)

    def matcher(self, spec: GuidedSpec) -> Any:
        """A fresh matcher at the start of `spec`'s grammar; behind a `MarkerGate` when `spec.starts_after` is set.
        The gate decodes tokens with this cache's tokenizer (special tokens kept), several together where a
        character spans them."""
        matcher = _xgrammar().GrammarMatcher(self._compile(spec))
        if not spec.starts_after:
            return matcher
        return MarkerGate(matcher, spec.starts_after, self._decode_ids)

    def _decode_ids(self, token_ids: list[int]) -> str:
        return self._hf_tokenizer.decode(token_ids, skip_special_tokens=False)

    def _compile(self, spec: GuidedSpec) -> Any:
        spec = replace(spec, starts_after="")  # the grammar is the same whatever starts it
        with self._lock:
            compiled = self._compiled.get(spec)
            if compiled is not None:
                self._compiled.move_to_end(spec)
                return compiled
        compiled = self._compile_new(spec)
        with self._lock:
            if spec in self._compiled:  # another thread compiled it meanwhile
                self._compiled.move_to_end(spec)
                return self._compiled[spec]
            self._compiled[spec] = compiled
            self.num_bytes += compiled.memory_size_bytes
            while self.num_bytes > self._limit_bytes and len(self._compiled) > 1:
                _, dropped = self._compiled.popitem(last=False)
                self.num_bytes -= dropped.memory_size_bytes
        return compiled

    def _compile_new(self, spec: GuidedSpec) -> Any:
        """`spec` compiled (no lock held: this is the slow part)."""
        xgr = _xgrammar()
        compiler = self._tokenizer_compiler(xgr)
        try:
            compiled = compiler.compile_grammar(_grammar(xgr, spec))
        except Exception as error:  # noqa: BLE001 - xgrammar raises assorted types for a bad spec
            raise ValueError(f"invalid {spec.kind.value} constraint: {_clean_message(error)}") from None
        if not _can_start(xgr, compiled, self.vocab_size):
            raise ValueError(f"invalid {spec.kind.value} constraint: it allows no first token, so no output can "
                             "match it (a rule that only refers to itself, such as `x ::= x`, matches nothing)")
        return compiled

    def _tokenizer_compiler(self, xgr: Any) -> Any:
        with self._lock:
            if self._compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(self._hf_tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=self._stop_token_ids)
                self._compiler = xgr.GrammarCompiler(info, cache_enabled=False)  # (this class keeps what is compiled)
            return self._compiler

    def __len__(self) -> int:
        return len(self._compiled)


class MarkerGate:
    """A grammar matcher that stays closed (allows every token, accepts none) until the completion's text holds
    `marker`, then passes everything to `matcher`, from the next token on. The marker is looked for in the last
    tokens' texts, as many tokens as the marker has UTF-8 bytes (a token holds at least one), so a marker split over
    tokens is found wherever it starts; where a token alone decodes to a broken character (U+FFFD: part of a
    character past ASCII) those tokens are decoded together (`decode_ids`). The token that completes the marker is
    not fed to the grammar. The interface `fill_bitmask` and `OutputProcessor` use: `is_terminated`,
    `accept_token`, `fill_next_token_bitmask` (a closed gate leaves its row's bits all set), and `rollback` (as
    xgrammar's matcher: speculative decoding accepts drafts to fill their masks, then takes them back).

        marker "</think>" (8 bytes), tokens "ok", ".</", "th", "ink", ">"
        texts kept after ">": ["ok", ".</", "th", "ink", ">"] -> "ok.</think>" holds it: open

    The gate keeps the last tokens it took while closed (its id and text: what a rollback into them restores), as
    many as its window plus `MAX_ROLLBACK` (a rollback takes back at most a verify row's drafts), and the count of
    tokens it has fed the grammar since it opened."""

    MAX_ROLLBACK = 64  # more than any speculative decoding's drafts per row (num_speculative_tokens <= 8)

    def __init__(self, matcher: Any, marker: str, decode_ids: Callable[[list[int]], str]) -> None:
        self.matcher, self.marker, self._decode_ids = matcher, marker, decode_ids
        self._window_len = max(1, len(marker.encode()))
        self._seen: list[tuple[int, str]] = []  # (token, its text alone) of each token taken while closed
        self._num_fed = 0  # tokens the grammar has accepted since the gate opened
        self.open = False

    def is_terminated(self) -> bool:
        return self.open and self.matcher.is_terminated()

    def accept_token(self, token: int) -> bool:
        if self.open:
            accepted = self.matcher.accept_token(token)
            self._num_fed += bool(accepted)
            return accepted
        self._seen.append((token, self._decode_ids([token])))
        if len(self._seen) > 2 * (self._window_len + self.MAX_ROLLBACK):  # (trimmed in batches: amortised O(1))
            del self._seen[: len(self._seen) - self._window_len - self.MAX_ROLLBACK]
        recent = self._seen[-self._window_len:]
        text = "".join(piece for _, piece in recent)
        if "\ufffd" in text:  # (a character split over tokens: decode them together)
            text = self._decode_ids([token for token, _ in recent])
        self.open = self.marker in text
        return True

    def rollback(self, num_tokens: int) -> None:
        """Take back the last `num_tokens` accepted tokens: those the grammar accepted, then (closing the gate)
        those it took while closed, the one that opened it first."""
        fed = min(num_tokens, self._num_fed)
        closed = num_tokens - fed
        if closed > len(self._seen):
            raise ValueError(f"cannot roll back {num_tokens} tokens: the gate has taken {fed + len(self._seen)}")
        if fed:
            self.matcher.rollback(fed)
            self._num_fed -= fed
        if closed:
            del self._seen[len(self._seen) - closed:]
            self.open = False

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        if self.open:
            self.matcher.fill_next_token_bitmask(bitmask, index)


def _can_start(xgr: Any, compiled: Any, vocab_size: int) -> bool:
    """Whether a fresh matcher of `compiled` allows some token (or accepts the empty output): a grammar whose
    start allows nothing would leave every logit masked, and the sampler would emit token 0 forever."""
    matcher = xgr.GrammarMatcher(compiled)
    if matcher.is_terminated():
        return True
    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    matcher.fill_next_token_bitmask(bitmask, 0)
    return bool(bitmask.any())


_SOURCE_PREFIX = re.compile(r"^\s*(?:\[[\d:.]+\]\s*)?\S+\.(?:cc|cpp|h|hpp|py):\d+:\s*")


def _clean_message(error: Exception) -> str:
    """An xgrammar error without its log prefix (a time and a C++ source path): what is wrong with the spec."""
    lines = [_SOURCE_PREFIX.sub("", line).strip() for line in str(error).splitlines()]
    return " ".join(line for line in lines if line) or type(error).__name__


def _grammar(xgr: Any, spec: GuidedSpec) -> Any:
    kind = spec.kind
    if kind is GuidedKind.JSON_OBJECT:
        return xgr.Grammar.from_json_schema({"type": "object"}, any_whitespace=False)
    if kind is GuidedKind.JSON_SCHEMA:
        return _json_schema(xgr, spec.spec)
    if kind is GuidedKind.REGEX:
        return xgr.Grammar.from_regex(spec.spec)
    if kind is GuidedKind.GRAMMAR:
        return xgr.Grammar.from_lark(spec.spec) if is_lark(spec.spec) else xgr.Grammar.from_ebnf(spec.spec)
    if kind is GuidedKind.CHOICE:
        choices = json.loads(spec.spec)
        return xgr.Grammar.union(*(_literal(xgr, choice) for choice in choices))
    calls = [_tool_call_grammar(xgr, tool) for tool in json.loads(spec.spec)]
    call = calls[0] if len(calls) == 1 else xgr.Grammar.union(*calls)
    return _one_or_more(xgr, call, "\n") if spec.parallel else call


def _one_or_more(xgr: Any, grammar: Any, separator: str) -> Any:
    """`grammar` one or more times, `separator` between two: `calls ::= root (separator root)*` over its rules."""
    text = str(grammar)
    names = {line.split("::=", 1)[0].strip() for line in text.splitlines() if "::=" in line}
    name = next(f"repeated{i}" for i in range(len(names) + 1) if f"repeated{i}" not in names)
    separator = json.dumps(separator, ensure_ascii=False)
    return xgr.Grammar.from_ebnf(f"{text}\n{name} ::= root ({separator} root)*\n", root_rule_name=name)


def _tool_call_grammar(xgr: Any, tool: dict[str, Any]) -> Any:
    """`<tool_call>\\n{"name": "<name>", "arguments": <args>}\\n</tool_call>` for one tool."""
    function = tool.get("function", tool)
    body = _json_schema(xgr, tool_call_schema(function["name"], function.get("parameters")))
    return xgr.Grammar.concat(_literal(xgr, "<tool_call>\n"), body, _literal(xgr, "\n</tool_call>"))


_DEFINITIONS = ("$defs", "definitions")
_ARGUMENTS_POINTER = "#/properties/arguments"


def tool_call_schema(name: str, parameters: dict[str, Any] | None) -> dict[str, Any]:
    """The JSON schema of one call, `{"name": <name>, "arguments": <parameters>}`. The parameters' definitions
    (`$defs`, `definitions`: what pydantic writes for nested, recursive and enum models) move to the root, where
    their `#/$defs/...` references point; any other local reference is rewritten to point into `arguments`."""
    parameters = dict(parameters or {"type": "object"})
    root: dict[str, Any] = {}
    for key in _DEFINITIONS:
        if key in parameters:
            root[key] = _rebase_refs(parameters.pop(key))
    root.update({
        "type": "object",
        "properties": {"name": {"const": name}, "arguments": _rebase_refs(parameters)},
        "required": ["name", "arguments"],
    })
    return root


def _rebase_refs(node: Any) -> Any:
    """`node` with each local `$ref` that is not into the hoisted definitions rebased under `arguments`."""
    if isinstance(node, list):
        return [_rebase_refs(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {key: _rebase_refs(value) for key, value in node.items()}
    ref = out.get("$ref")
    if isinstance(ref, str) and ref.startswith("#") and not any(ref.startswith(f"#/{d}/") for d in _DEFINITIONS):
        out["$ref"] = _ARGUMENTS_POINTER + ref[1:]
    return out


# xgrammar writes the characters of a length-bounded string as this class, which lets raw control characters
# through (invalid JSON); they must be escaped, as in its unbounded strings.
_LOOSE_CHARACTERS = r'[^\"\\\r\n]'
_STRICT_CHARACTERS = r'[^\0-\x1f\"\\]'


def _json_schema(xgr: Any, schema: str | dict[str, Any]) -> Any:
    """The schema's grammar, written the way `tojson` writes JSON, with no raw control characters in strings.
    Raises ValueError for a keyword xgrammar would read and not enforce (`unenforced_keyword`)."""
    unenforced = unenforced_keyword(json.loads(schema) if isinstance(schema, str) else schema)
    if unenforced is not None:
        raise ValueError(f"{unenforced} is not supported: xgrammar would not enforce it (remove it, or check the "
                         "output yourself)")
    grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=False, separators=_TOJSON_SEPARATORS)
    text = str(grammar)
    return xgr.Grammar.from_ebnf(text.replace(_LOOSE_CHARACTERS, _STRICT_CHARACTERS)) if _LOOSE_CHARACTERS in text \
        else grammar


def _literal(xgr: Any, text: str) -> Any:
    """A grammar matching exactly `text` (an EBNF string literal: JSON string escapes are EBNF's). Characters past
    ASCII are written as they are: EBNF reads each `\\uXXXX` escape as one code point, so a character outside the
    BMP escaped as a UTF-16 surrogate pair would become two lone surrogates (invalid UTF-8)."""
    return xgr.Grammar.from_ebnf(f"root ::= {json.dumps(text, ensure_ascii=False)}")


def is_lark(grammar: str) -> bool:
    """Whether a grammar's text is Lark rather than EBNF: it has no `::=` (vLLM's `grammar_is_likely_lark` rule).
    `start: "yes" | "no"` is Lark (its root rule is `start`); `root ::= "yes" | "no"` is EBNF."""
    return "::=" not in grammar


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
    through that breaks it), named with its place (`uniqueItems (at /properties/tags)`), or None. As vLLM's
    `has_xgrammar_unsupported_json_features`: `uniqueItems` (true), `contains`, `minContains`, `maxContains`;
    `multipleOf` but on integers (by an integer); a string's `minLength` / `maxLength` next to its `pattern` or
    `format`; a string format xgrammar does not know; `propertyNames` next to `properties` or
    `additionalProperties`; `patternProperties` next to `properties`. Beyond vLLM (xgrammar 0.2.9 drops these):
    a keyword that constrains (`_CONSTRAINING`) beside `$ref`, `allOf`, `anyOf`, `oneOf`, `const` or `enum` (any
    other keyword is an annotation and may stand there: `title`, `example`, `x-*`; so may a `type` that every
    branch or value keeps to); `allOf` of more than one branch; `not`, `if` / `then` / `else`, `dependentRequired`,
    `dependentSchemas`; a `required` name without a `properties` entry; a type's keyword (`pattern`, `minimum`,
    `minItems`...) where the schema names no type; a `pattern` that names `"`, `\\` or a control character outside
    a class, or a class of nothing else (xgrammar then matches it against the JSON text, unescaped:
    `_json_escaped_in`)."""
    if isinstance(schema, list):
        return next((found for i, item in enumerate(schema) if (found := unenforced_keyword(item, f"{at}/{i}"))),
                    None)
    if not isinstance(schema, dict):
        return None
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
    step = schema.get("multipleOf")
    if "multipleOf" in schema and not ("integer" in types and types <= {"integer", "null"} and
                                       isinstance(step, int) and not isinstance(step, bool)):
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


def fill_bitmask(matchers: Sequence[Any | None], vocab_size: int,
                 dead_end_tokens: Sequence[int] = ()) -> torch.Tensor | None:
    """The allowed-token bitmask [len(matchers), ceil(vocab/32)] int32 of these rows (every bit set where a
    row has no matcher), or None when no row is constrained. A row whose grammar allows no next token (a dead
    end, as after "a" in `root ::= "a" x`, `x ::= x`: no output can complete it) allows `dead_end_tokens`
    instead (the engine passes its EOS ids, so the choice ends rather than emit token 0 again and again)."""
    if all(m is None for m in matchers):
        return None
    xgr = _xgrammar()
    bitmask = xgr.allocate_token_bitmask(len(matchers), vocab_size)
    for i, matcher in enumerate(matchers):
        if matcher is not None and not matcher.is_terminated():
            matcher.fill_next_token_bitmask(bitmask, i)
            if dead_end_tokens and not bitmask[i].any():
                for token in dead_end_tokens:
                    bit = 1 << (token % 32)
                    bitmask[i, token // 32] |= bit - (1 << 32) if bit >= 1 << 31 else bit  # int32 words
    return bitmask
