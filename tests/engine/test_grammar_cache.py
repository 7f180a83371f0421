"""The compiled grammars a server keeps are bounded: a client that sends a new JSON schema with every request
(1,000 requests: 1,000 grammars kept, ~190 MB over a 150k vocabulary, in a bug hunt) no longer grows the process
without limit. vLLM keeps xgrammar's compiler cache at 512 MiB."""

from __future__ import annotations

import concurrent.futures
import json
import re
import threading

import pytest

from hybridcache import guided
from hybridcache.guided import GrammarCache, GuidedKind, GuidedSpec
from hybridcache.models.builtin import ensure_builtin_model
from hybridcache.tokenizer import Tokenizer
from tests.engine import needs_xgrammar


def _schema(i: int) -> GuidedSpec:
    return GuidedSpec(GuidedKind.JSON_SCHEMA, json.dumps({"type": "object", "properties": {f"field_{i}": {
        "type": "integer"}}, "required": [f"field_{i}"]}))


@needs_xgrammar
def test_compiled_grammars_past_the_byte_limit_drop_the_least_recently_used():
    tokenizer = Tokenizer(ensure_builtin_model())
    one = GrammarCache(tokenizer.hf, tokenizer.vocab_size, [0])
    one.check(_schema(0))
    size = one.num_bytes
    assert size > 0
    cache = GrammarCache(tokenizer.hf, tokenizer.vocab_size, [0], limit_bytes=int(size * 3.5))
    for i in range(3):
        cache.check(_schema(i))
    cache.matcher(_schema(0))  # used again: now the most recent
    cache.check(_schema(3))
    assert {spec.spec for spec in cache._compiled} == {_schema(i).spec for i in (2, 0, 3)}  # 1 went first
    for i in range(4, 40):
        cache.check(_schema(i))
        assert len(cache) <= 3 and cache.num_bytes <= size * 3.5
    kept = {spec.spec for spec in cache._compiled}
    assert kept == {_schema(i).spec for i in (37, 38, 39)}
    small = GrammarCache(tokenizer.hf, tokenizer.vocab_size, [0], limit_bytes=1)
    small.check(_schema(0))
    assert len(small) == 1  # the one just compiled is kept whatever its size
    assert small.matcher(_schema(0)) is not None


def _cache() -> tuple[GrammarCache, Tokenizer]:
    tokenizer = Tokenizer(ensure_builtin_model())
    return GrammarCache(tokenizer.hf, tokenizer.vocab_size, [tokenizer.eos_token_id]), tokenizer


def _accepts(cache: GrammarCache, tokenizer: Tokenizer, spec: GuidedSpec, text: str) -> bool:
    """Whether `spec`'s grammar takes exactly `text` (its tokens, then EOS)."""
    matcher = cache.matcher(spec)
    return all(matcher.accept_token(t) for t in tokenizer.encode(text)) and matcher.accept_token(
        tokenizer.eos_token_id) and matcher.is_terminated()


@needs_xgrammar
def test_a_schema_keeps_its_property_order():
    """A "reasoning, then answer" schema is written in that order (OpenAI's and vLLM's rule; the keys were sorted,
    which forced the answer first); so are a forced tool call's arguments. Key order makes another spec."""
    cache, tokenizer = _cache()
    schema = {"type": "object", "properties": {"reasoning": {"type": "string"}, "answer": {"type": "integer"}},
              "required": ["reasoning", "answer"], "additionalProperties": False}
    spec = GuidedSpec.json_schema(schema)
    assert _accepts(cache, tokenizer, spec, '{"reasoning": "ab", "answer": 1}')
    assert not _accepts(cache, tokenizer, spec, '{"answer": 1, "reasoning": "ab"}')
    reordered = {"type": "object", "properties": {"answer": {"type": "integer"}, "reasoning": {"type": "string"}},
                 "required": ["reasoning", "answer"], "additionalProperties": False}
    assert GuidedSpec.json_schema(reordered) != spec
    assert _accepts(cache, tokenizer, GuidedSpec.json_schema(reordered), '{"answer": 1, "reasoning": "ab"}')
    tool = {"type": "function", "function": {"name": "search", "parameters": {
        "type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
        "required": ["query", "limit"], "additionalProperties": False}}}
    call = GuidedSpec.tool_calls([tool])
    text = '<tool_call>\n{"name": "search", "arguments": {%s}}\n</tool_call>'
    assert _accepts(cache, tokenizer, call, text % '"query": "a", "limit": 1')
    assert not _accepts(cache, tokenizer, call, text % '"limit": 1, "query": "a"')


@needs_xgrammar
def test_a_choice_outside_the_bmp_is_its_own_utf8():
    """A choice with an emoji: its literal was written with `\\ud83d\\udc4d` escapes, which EBNF reads as two lone
    surrogates (CESU-8 bytes, invalid UTF-8), so the choice itself was not accepted. Quotes, backslashes and
    control characters are still escaped."""
    cache, tokenizer = _cache()
    choices = ["👍", "a😀b", 'say "hi"\\n\tthere é']
    spec = GuidedSpec(GuidedKind.CHOICE, json.dumps(choices))
    for choice in choices:
        assert _accepts(cache, tokenizer, spec, choice), choice
    assert not _accepts(cache, tokenizer, spec, "\ud83d\udc4d".encode("utf-8", "surrogatepass").decode("latin-1"))


_OBJECT = {"type": "object"}


@needs_xgrammar
@pytest.mark.parametrize("schema, keyword", [
    pytest.param({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems (at the root)",
                 id="uniqueItems"),
    pytest.param({"type": "array", "contains": {"const": 5}}, "contains", id="contains"),
    pytest.param({"type": "array", "minContains": 2}, "minContains", id="minContains"),
    pytest.param({"type": "array", "maxContains": 2}, "maxContains", id="maxContains"),
    pytest.param({"type": "string", "pattern": "^[a-z]+$", "maxLength": 3}, "maxLength next to pattern",
                 id="maxLength-next-to-pattern"),
    pytest.param({"type": "string", "format": "email", "minLength": 8}, "minLength next to format",
                 id="minLength-next-to-format"),
    pytest.param({"type": "string", "format": "credit-card"}, "format 'credit-card'", id="unknown-format"),
    pytest.param({**_OBJECT, "properties": {"A": {"type": "integer"}}, "propertyNames": {"pattern": "^[a-z]+$"}},
                 "propertyNames next to properties", id="propertyNames-next-to-properties"),
    pytest.param({**_OBJECT, "propertyNames": {"pattern": "^[a-z]+$"}, "additionalProperties": False},
                 "propertyNames next to additionalProperties", id="propertyNames-next-to-additionalProperties"),
    pytest.param({**_OBJECT, "properties": {"x1": {"type": "integer"}}, "patternProperties": {"^x": {"minimum": 5}}},
                 "patternProperties next to properties", id="patternProperties-next-to-properties"),
    pytest.param({"type": "number", "multipleOf": 0.5}, "multipleOf", id="multipleOf-of-a-number"),
    pytest.param({**_OBJECT, "properties": {"tags": {"type": "array", "uniqueItems": True}}},
                 "uniqueItems (at /properties/tags)", id="nested-in-properties"),
    pytest.param({"anyOf": [{"type": "integer"}, {"$ref": "#/$defs/S"}],
                  "$defs": {"S": {"type": "array", "contains": {"const": 1}}}}, "contains (at /$defs/S)",
                 id="nested-in-defs"),
])
def test_schema_keywords_xgrammar_would_not_enforce_are_refused(schema, keyword):
    """xgrammar reads these and lets output through that breaks them (`[1, 1]` for uniqueItems, `"abcdefgh"` for a
    pattern with maxLength 3): the schema is refused with the keyword and its place, as vLLM refuses them
    (`has_xgrammar_unsupported_json_features`), rather than silently loosened."""
    cache, _ = _cache()
    with pytest.raises(ValueError, match=re.escape(keyword) + ".* not supported"):
        cache.check(GuidedSpec.json_schema(schema))
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    with pytest.raises(ValueError, match="tool_calls constraint: " + re.escape(keyword.split(" (")[0])):
        cache.check(GuidedSpec.tool_calls([tool]))


@needs_xgrammar
@pytest.mark.parametrize("schema, good, bad", [
    pytest.param({"type": "array", "items": {"type": "integer"}, "uniqueItems": False}, "[1, 1]", '["a"]',
                 id="uniqueItems-false"),
    pytest.param({"type": "integer", "multipleOf": 7}, "14", "15", id="multipleOf-of-an-integer"),
    pytest.param({**_OBJECT, "properties": {"uniqueItems": {"type": "integer"}, "contains": {"type": "integer"}},
                  "required": ["uniqueItems", "contains"]}, '{"uniqueItems": 1, "contains": 2}', '{"uniqueItems": 1}',
                 id="keywords-as-property-names"),
    pytest.param({**_OBJECT, "propertyNames": {"pattern": "^[a-z]+$"}}, '{"ab": 1}', '{"A1": 1}',
                 id="propertyNames-alone"),
    pytest.param({"type": "string", "format": "email"}, '"a@b.co"', '"x"', id="known-format"),
    pytest.param({"type": "string", "maxLength": 3}, '"abc"', '"abcd"', id="maxLength-alone"),
    pytest.param({"enum": [{"uniqueItems": True}, 1]}, "1", "2", id="keyword-inside-enum"),  # (a value, not a keyword)
])
def test_schema_keywords_xgrammar_enforces_are_kept(schema, good, bad):
    cache, tokenizer = _cache()
    spec = GuidedSpec.json_schema(schema)
    assert _accepts(cache, tokenizer, spec, good)
    assert not _accepts(cache, tokenizer, spec, bad)


@needs_xgrammar
def test_a_lark_grammar_compiles():
    """A grammar with no `::=` rule is Lark (vLLM's `grammar_is_likely_lark`), compiled with xgrammar's Lark reader;
    it was refused as an EBNF syntax error. EBNF is read as before; a bad Lark grammar is a ValueError."""
    cache, tokenizer = _cache()
    lark = GuidedSpec(GuidedKind.GRAMMAR, '// a comment\nstart: answer\nanswer: "yes" | "no"\n')
    assert _accepts(cache, tokenizer, lark, "yes") and _accepts(cache, tokenizer, lark, "no")
    assert not _accepts(cache, tokenizer, lark, "maybe")
    ebnf = GuidedSpec(GuidedKind.GRAMMAR, 'root ::= "yes" | "no"')
    assert _accepts(cache, tokenizer, ebnf, "yes") and not _accepts(cache, tokenizer, ebnf, "maybe")
    with pytest.raises(ValueError, match="invalid grammar constraint"):
        cache.check(GuidedSpec(GuidedKind.GRAMMAR, "start: (answer"))


@needs_xgrammar
def test_one_spec_compiled_by_two_threads_at_once_is_kept_and_counted_once(monkeypatch):
    """The server compiles on worker threads while the engine thread makes matchers: two compiles of one spec at
    the same time keep one grammar and count its bytes once, and threads compiling many specs keep the byte
    count equal to what is kept."""
    cache, _ = _cache()
    cache.check(_schema(0))
    size = cache.num_bytes
    both_in = threading.Barrier(2, timeout=30)
    build = guided._grammar

    def meeting(xgr, spec):
        if spec == _schema(100):
            both_in.wait()  # each thread is past the lookup: both compile
        return build(xgr, spec)

    monkeypatch.setattr(guided, "_grammar", meeting)
    threads = [threading.Thread(target=cache.check, args=(_schema(100),)) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(cache) == 2 and cache.num_bytes == sum(g.memory_size_bytes for g in cache._compiled.values())
    small = GrammarCache(cache._hf_tokenizer, cache.vocab_size, [0], limit_bytes=int(size * 3.5))
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        list(pool.map(small.check, [_schema(i) for i in range(24)]))
    assert len(small) == 3 and small.num_bytes == sum(g.memory_size_bytes for g in small._compiled.values())


@needs_xgrammar
@pytest.mark.parametrize("completion,marker", [
    ("</think>", "</think>"), ("\n</think>", "</think>"), ("ok.</think>", "</think>"),
    ("thinking...</think>", "</think>"), ("答", "答"), ("想好了答", "答"), ("x</思考>", "</思考>"),
], ids=["marker-first", "after-1", "after-3", "after-11", "non-ascii-only", "non-ascii-after", "non-ascii-inside"])
def test_a_gate_opens_on_a_marker_split_over_tokens_wherever_it_starts(completion, marker):
    """Hunt 166, bug 3: the gate kept a negative slice of a short text (its tail stuck at 3 characters), so a
    `</think>` that began in the first 6 characters was missed and the answer never constrained; and it decoded
    each token alone, so a marker character past ASCII spanning tokens (U+FFFD halves) was never found. The
    built-in tokenizer writes one token per byte: each marker here spans several tokens."""
    cache, tokenizer = _cache()
    spec = GuidedSpec(GuidedKind.JSON_OBJECT, starts_after=marker)
    gate = cache.matcher(spec)
    ids = tokenizer.encode(completion)
    assert len(tokenizer.encode(marker)) > 1
    for token in ids[:-1]:
        gate.accept_token(token)
        assert not gate.open
    gate.accept_token(ids[-1])
    assert gate.open
    assert not gate.accept_token(tokenizer.encode("]")[0])  # the grammar now holds: a JSON object starts with {
    assert gate.accept_token(tokenizer.encode("{")[0])
