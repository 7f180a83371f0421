"""The compiled grammars a server keeps are bounded: a client that sends a new JSON schema with every request
(1,000 requests: 1,000 grammars kept, ~190 MB over a 150k vocabulary, in a bug hunt) no longer grows the process
without limit. vLLM keeps xgrammar's compiler cache at 512 MiB."""

from __future__ import annotations

import json

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
