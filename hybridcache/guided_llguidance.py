"""llguidance: the fallback compiler of `guided` for JSON schemas xgrammar cannot enforce (as vLLM's `auto` backend
falls back from xgrammar to guidance). llguidance enforces every keyword it accepts and refuses the rest
(`Unimplemented keys: ["uniqueItems"]`, `Unknown format: uuid4`). A JSON schema is written the way `tojson` writes
JSON, as the xgrammar grammars write it; a forced tool call is a Lark grammar around the call's schema
(`%json {...}`), Kimi's section written by `guided_kimi` as `guided` writes it for xgrammar. `LLGuidanceCompiler`
compiles, `LLGuidanceGrammar` hands out matchers with xgrammar's `GrammarMatcher` interface. llguidance is imported
on first use (the `guided` extra).
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from hybridcache.guided_kimi import TAGS as KIMI_TAGS
from hybridcache.guided_kimi import quoted, section_rules

# The tool-call formats that write their calls as one JSON list, and the text around the list (`guided.TOOL_FORMATS`)
LIST_TAGS = {"nemotron": ("<TOOLCALL>[", "]</TOOLCALL>"), "jamba": ("<tool_calls>[", "]</tool_calls>")}

# How the xgrammar grammars write JSON (`tojson`'s separators, no free whitespace); `lenient: False` overrides a
# schema's own `x-guidance` that would have llguidance skip what it does not know (unenforced, silently).
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ", "lenient": False,
                 "coerce_one_of": False}


# Where subschemas sit (`strict`'s walk): maps of name to schema, single schemas, lists of schemas.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMAS = ("items", "additionalItems", "additionalProperties", "unevaluatedItems", "unevaluatedProperties",
            "contains", "propertyNames", "not", "if", "then", "else")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")


def strict(schema: Any, closed: bool = True, open_defs: frozenset[str] | None = None) -> Any:
    """`schema` read as xgrammar reads it (its `strict_mode`, which the xgrammar grammars use): an object schema
    with `properties` but no `additionalProperties` / `unevaluatedProperties` allows no other property, an array
    schema with `prefixItems` but no `items` / `additionalItems` / `unevaluatedItems` no other item. llguidance
    reads the JSON Schema default (anything more), so that a pydantic model's schema would take `{"word": "an",
    "": "", "": ""}`; vLLM's `disable_additional_properties` closes objects likewise.

    What combines with other schemas stays open (`closed`: False), since their properties add up and closing one
    would refuse the others': an `allOf` branch; an `anyOf` / `oneOf` branch beside `properties`; an object beside
    `allOf`, `anyOf`, `oneOf` or `$ref`; a `$defs` / `definitions` entry that an `allOf` branch or a `$ref` beside
    `properties` names (`open_defs`, found at the root: `_combined_defs`); and an object whose `required` names a
    property that `properties` does not (it says there are others).

        {"properties": {"a": {}}}  ->  {"properties": {"a": {}}, "additionalProperties": false}
        {"allOf": [{"$ref": "#/$defs/Pet"}, {"properties": {"bark": {}}}], "$defs": {"Pet": {"properties": ...}}}
            ->  nothing closed: {"name": "rex", "bark": true} is valid"""
    if open_defs is None:
        open_defs = _combined_defs(schema)
    if isinstance(schema, list):
        return [strict(item, closed, open_defs) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            defs = key in ("$defs", "definitions")
            out[key] = {name: strict(sub, not (defs and name in open_defs), open_defs)
                        for name, sub in out[key].items()}
    beside_properties = isinstance(out.get("properties"), dict)
    for key in dict.fromkeys(_SCHEMAS + _SCHEMA_LISTS):
        if isinstance(out.get(key), (dict, list)):
            combined = key == "allOf" or (key in ("anyOf", "oneOf") and beside_properties)
            out[key] = strict(out[key], not combined, open_defs)
    properties = out.get("properties")
    if closed and isinstance(properties, dict) and not any(key in out for key in _COMBINERS) and not (
            "additionalProperties" in out or "unevaluatedProperties" in out) and all(
            name in properties for name in out.get("required") or ()):
        out["additionalProperties"] = False
    if "prefixItems" in out and not any(key in out for key in ("items", "additionalItems", "unevaluatedItems")):
        out["items"] = False
    return out


_COMBINERS = ("allOf", "anyOf", "oneOf", "$ref")


def _combined_defs(schema: Any) -> frozenset[str]:
    """The `$defs` / `definitions` names that something combines with: named by an `allOf` branch's `$ref`, or by a
    `$ref` beside `properties` (`strict` leaves them open)."""
    found: set[str] = set()

    def walk(node: Any, in_all_of: bool = False) -> None:
        if isinstance(node, list):
            for item in node:
                walk(item, in_all_of)
        elif isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and (in_all_of or "properties" in node):
                found.add(ref.rsplit("/", 1)[-1])
            for key, value in node.items():
                walk(value, key == "allOf")

    walk(schema)
    return frozenset(found)


def negative_only_multiple(schema: Any, at: str = "") -> str | None:
    """Where a `multipleOf` number can only be negative (`maximum` < 0 or `exclusiveMaximum` <= 0), or None.
    llguidance writes multiples without a sign (guidance-ai/llguidance#222), so such a grammar dead-ends in the
    middle of the JSON: it is refused instead."""
    if isinstance(schema, list):
        return next((found for i, item in enumerate(schema) if (found := negative_only_multiple(item, f"{at}/{i}"))),
                    None)
    if not isinstance(schema, dict):
        return None
    number = (int, float)
    if isinstance(schema.get("multipleOf"), number) and (
            (isinstance(schema.get("maximum"), number) and schema["maximum"] < 0)
            or (isinstance(schema.get("exclusiveMaximum"), number) and schema["exclusiveMaximum"] <= 0)):
        return at or "the root"
    return next((found for key, value in schema.items() if isinstance(value, (dict, list))
                 and (found := negative_only_multiple(value, f"{at}/{key}"))), None)


_LARK_PLACE = re.compile(r"^at \d+\(\d+\): (?:failed to compile JSON schema: )?")


def _llguidance_reason(error: str) -> str:
    """llguidance's error without the Lark grammar it quotes (a tool call's): `at 4(8): failed to compile JSON
    schema: Unimplemented keys: ["uniqueItems"]` and the grammar's lines -> `Unimplemented keys: ["uniqueItems"]`; a
    first line that only opens the reason (`regex parse error:`, then the regex, a caret, `error: unclosed group`)
    gets the last line's."""
    lines = [line.strip() for line in error.strip().splitlines() if line.strip()]
    if not lines:
        return "an llguidance error"
    first = _LARK_PLACE.sub("", lines[0])
    return f"{first} {lines[-1]}" if first.endswith(":") and len(lines) > 1 else first


class LLGuidanceMissing(ValueError):
    """A schema needs llguidance (xgrammar would not enforce it) and llguidance does not import."""


def _llguidance() -> Any:
    try:
        import llguidance
        import llguidance.hf
        import llguidance.numpy  # (not llguidance.torch: its import compiles a function with torch.compile, which
        # imports torch._dynamo: 2 s of a core holding the GIL in a server that is already serving)
    except ImportError as error:
        raise LLGuidanceMissing(f"llguidance, which would, does not import ({error}): pip install llguidance (it is "
                                "in 'hybridcache-llm[guided]')") from error
    return llguidance


class LLGuidanceMatcher:
    """One completion's state in an llguidance grammar, with xgrammar's `GrammarMatcher` interface (what
    `fill_bitmask`, `MarkerGate` and `OutputProcessor` call): `accept_token` (False, the state unchanged, for a
    token the grammar refuses), `fill_next_token_bitmask` (the same int32 row layout), `rollback` (speculative
    decoding takes drafts back), `is_terminated` (a stop token was accepted where the grammar is complete).

    Stop tokens are not fed to llguidance (once its grammar can take nothing more it takes EOS without counting
    it, so a rollback would go one token too far): the matcher keeps `_terminated` itself, and a rollback takes
    that token back first."""

    def __init__(self, matcher: Any, stop_token_ids: frozenset[int], fill: Callable[..., None]) -> None:
        self._matcher = matcher
        self._stop_token_ids = stop_token_ids
        self._fill = fill  # llguidance.numpy.fill_next_token_bitmask
        self._terminated = False

    def is_terminated(self) -> bool:
        return self._terminated

    def accept_token(self, token: int) -> bool:
        if self._terminated:
            return False
        if token in self._stop_token_ids:
            self._terminated = self._matcher.is_accepting()
            return self._terminated
        return self._matcher.try_consume_tokens([token]) == 1  # (consume_token would leave it in an error state)

    def rollback(self, num_tokens: int) -> None:
        if num_tokens and self._terminated:
            self._terminated = False
            num_tokens -= 1
        if num_tokens and not self._matcher.rollback(num_tokens):
            raise ValueError(f"cannot roll back {num_tokens} tokens: {self._matcher.get_error()}")

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        """Row `index` of `bitmask` (int32 [rows, cdiv(vocab, 32)] on the CPU, rows contiguous), written in place."""
        self._fill(self._matcher, bitmask.numpy(), index)


class LLGuidanceGrammar:
    """A compiled grammar: a matcher at its start, copied for each completion (llguidance builds a grammar in the
    matcher's constructor: 100 ms and more for a large schema). `memory_size_bytes`: an estimate for
    `GrammarCache`'s limit, `MATCHER_BYTES` plus the grammar's text (a kept grammar measured ~108 kB of RSS over a
    100k vocabulary once a matcher had run: its lexer states grow as matchers use it)."""

    MATCHER_BYTES = 128 << 10

    def __init__(self, start: Any, grammar: str, stop_token_ids: frozenset[int]) -> None:
        self._start = start
        self._stop_token_ids = stop_token_ids
        self.memory_size_bytes = self.MATCHER_BYTES + len(grammar.encode())

    def matcher(self) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(self._start.deep_copy(), self._stop_token_ids,
                                 _llguidance().numpy.fill_next_token_bitmask)


class LLGuidanceCompiler:
    """Compiles JSON schemas and tool calls with llguidance for one tokenizer (built on first use, or by `prepare`:
    about a second over a 150k vocabulary, after an import of seconds). Thread-safe: compiling holds no lock; the
    tokenizer is made under one, so a compile that needs it while another thread builds it waits for that build."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        self._hf_tokenizer = hf_tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = frozenset(stop_token_ids)
        self._tokenizer = None
        self._lock = threading.Lock()

    def prepare(self) -> None:
        """Import llguidance and build its tokenizer now, what the first compile would otherwise wait for;
        LLGuidanceMissing where llguidance does not import."""
        self._llg_tokenizer(_llguidance())

    def json_schema(self, schema: dict[str, Any], lead_space: int = 0) -> LLGuidanceGrammar:
        """The grammar of `schema` (read as `strict` says), after up to `lead_space` spaces or newlines; ValueError
        (llguidance's message) where llguidance refuses it."""
        _refuse_negative_only_multiples(schema)
        llg = _llguidance()
        if not lead_space:
            return self._compile(llg, llg.LLMatcher.grammar_from_json_schema(strict(schema), overrides=_JSON_OPTIONS))
        body = json.dumps({**strict(schema), "x-guidance": _JSON_OPTIONS})
        return self._compile(llg, f"start: {_lead(lead_space)}answer\nanswer: %json {body}\n")

    def tool_calls(self, call_schemas: Sequence[dict[str, Any]], parallel: bool,
                   tool_format: str = "qwen", lead_space: int = 0) -> LLGuidanceGrammar:
        """Calls valid for one of `call_schemas` (`tool_call_schema`: name and arguments; read as `strict` says),
        written as `guided.TOOL_FORMATS` describes `tool_format`: Qwen3's `<tool_call>\\n<call>\\n</tool_call>`
        blocks, a newline between two, or one list in the tags `LIST_TAGS` gives the format (NVIDIA's
        `<TOOLCALL>[<call>, <call>]</TOOLCALL>`, AI21's `<tool_calls>[...]</tool_calls>`); `parallel`: one or more
        calls; `lead_space`: up to this many spaces or newlines before them."""
        for schema in call_schemas:
            _refuse_negative_only_multiples(schema)
        bodies = [f"call{i}: %json {json.dumps({**strict(schema), 'x-guidance': _JSON_OPTIONS})}"
                  for i, schema in enumerate(call_schemas)]
        if tool_format in LIST_TAGS:
            opening, closing = (json.dumps(tag) for tag in LIST_TAGS[tool_format])
            start = [f'start: {_lead(lead_space)}{opening} call (", " call)* {closing}' if parallel
                     else f"start: {_lead(lead_space)}{opening} call {closing}"]
        else:
            start = [f'start: {_lead(lead_space)}block ("\\n" block)*' if parallel
                     else f"start: {_lead(lead_space)}block",
                     'block: "<tool_call>\\n" call "\\n</tool_call>"']
        lark = "\n".join([
            *start,
            "call: " + " | ".join(f"call{i}" for i in range(len(bodies))),
            *bodies, ""])
        return self._compile(_llguidance(), lark)

    def kimi_section(self, functions: Sequence[tuple[str, dict[str, Any]]], parallel: bool,
                     lead_space: int = 0) -> LLGuidanceGrammar:
        """Calls written in Kimi's section (`guided_kimi`), each of one of `functions` (name, parameters schema; read
        as `strict` says), after up to `lead_space` spaces or newlines. A tag that is a special token of the tokenizer
        is that token or its text (llguidance matches a quoted tag's text only, never the special token the model was
        taught to write)."""
        for _, parameters in functions:
            _refuse_negative_only_multiples(parameters)
        llg = _llguidance()
        specials = self._special_tags(llg)
        section, rules = section_rules(
            [name for name, _ in functions], [f"args{k}" for k in range(len(functions))], parallel, prefix="kimi",
            defines=":", tag=lambda text: f"({text} | {quoted(text)})" if text in specials
            else quoted(text))
        arguments = [f"args{k}: %json {json.dumps({**strict(parameters), 'x-guidance': _JSON_OPTIONS})}"
                     for k, (_, parameters) in enumerate(functions)]
        return self._compile(llg, "\n".join([f"start: {_lead(lead_space)}{section}", *rules, *arguments, ""]))

    def _special_tags(self, llg: Any) -> frozenset[str]:
        """Kimi's tags that are one special token of the tokenizer each (llguidance's grammars name them bare)."""
        tokenizer = self._llg_tokenizer(llg)
        found = set()
        for tag in KIMI_TAGS:
            ids = self._hf_tokenizer.encode(tag, add_special_tokens=False)
            if len(ids) == 1 and ids[0] < self._vocab_size and tokenizer.is_special_token(ids[0]) and \
                    self._hf_tokenizer.convert_ids_to_tokens(ids[0]) == tag:  # (not an unknown-token id)
                found.add(tag)
        return frozenset(found)

    def _compile(self, llg: Any, grammar: str) -> LLGuidanceGrammar:
        tokenizer = self._llg_tokenizer(llg)
        error = llg.LLMatcher.validate_grammar(grammar, tokenizer)
        start = None if error else llg.LLMatcher(tokenizer, grammar, log_level=0)
        if error or start.is_error():
            raise ValueError(_llguidance_reason(error or start.get_error()))
        return LLGuidanceGrammar(start, grammar, self._stop_token_ids)

    def _llg_tokenizer(self, llg: Any) -> Any:
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = llg.hf.from_tokenizer(self._hf_tokenizer, n_vocab=self._vocab_size,
                                                        eos_token=sorted(self._stop_token_ids))
            return self._tokenizer


def _lead(lead_space: int) -> str:
    """A start rule's optional run of 1 to `lead_space` spaces or newlines (Lark), "" for none."""
    return f"/[ \\n]{{1,{lead_space}}}/? " if lead_space else ""


def _refuse_negative_only_multiples(schema: Any) -> None:
    if (at := negative_only_multiple(schema)) is not None:
        raise ValueError(f"a multipleOf over negative numbers only (at {at}) cannot be written: llguidance writes "
                         "multiples without a sign")
