"""llguidance as the fallback compiler of JSON schemas xgrammar cannot enforce (hunt 202: pydantic's `HttpUrl`,
`constr(min_length=..., pattern=...)`, `confloat(multiple_of=0.5)` were a 400 from every structured-output mode of
every client library). vLLM's `auto` backend serves these through guidance (llguidance 1.7); it refuses what
llguidance refuses (`set[...]`'s `uniqueItems`, `UUID4`'s `format: uuid4`, `bytes`' `binary`, `SecretStr`'s
`password`, `IPvAnyAddress`' `ipvanyaddress`, `Path`'s `path`), and so does this engine, naming the keyword.

Measured with vLLM's decision (its xgrammar check, then `LLMatcher.grammar_from_json_schema` and
`validate_grammar` over the built-in tokenizer), llguidance 1.7.6 and 1.9.1 alike:

    HttpUrl, AnyUrl                  format uri + minLength (+ maxLength 2083)   guidance
    constr(min_length=2, pattern)    minLength + pattern                          guidance
    confloat(multiple_of=0.5)        multipleOf 0.5 on a number                   guidance
    UUID4 / bytes / SecretStr        format uuid4 / binary / password             400 (Unknown format)
    IPvAnyAddress / Path             format ipvanyaddress / path                  400 (Unknown format)
    set[str], frozenset[int]         uniqueItems                                  400 (Unimplemented keys)
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import re
from typing import Annotated, Any

import jsonschema
import pytest
from pydantic import UUID4, AnyUrl, BaseModel, Field, HttpUrl, IPvAnyAddress, SecretStr, StringConstraints

from hybridcache.config import EngineConfig
from hybridcache.engine.engine import LLMEngine
from hybridcache.guided import GrammarCache, GuidedSpec
from hybridcache.models.builtin import ensure_builtin_model
from hybridcache.sampling import SamplingParams
from hybridcache.tokenizer import Tokenizer
from tests.engine import needs_xgrammar

needs_llguidance = pytest.mark.skipif(importlib.util.find_spec("llguidance") is None,
                                      reason="needs llguidance (guided)")
pytestmark = [needs_xgrammar, needs_llguidance]

Word = Annotated[str, StringConstraints(min_length=2, max_length=4, pattern=r"^[a-z]+$")]
Half = Annotated[float, Field(multiple_of=0.5, ge=0, le=10)]


def _schema_of(annotation: Any) -> dict[str, Any]:
    """The JSON schema of a pydantic model with one required field `x` of this type."""
    return type("S", (BaseModel,), {"__annotations__": {"x": annotation}}).model_json_schema()


SERVED = {"HttpUrl": HttpUrl, "AnyUrl": AnyUrl, "constr(min_length, pattern)": Word,
          "confloat(multiple_of=0.5)": Half,
          "EmailStr-like": Annotated[str, Field(json_schema_extra={"format": "email"}, min_length=8)]}
REFUSED = {"UUID4": (UUID4, "Unknown format: uuid4"), "bytes": (bytes, "Unknown format: binary"),
           "SecretStr": (SecretStr, "Unknown format: password"),
           "IPvAnyAddress": (IPvAnyAddress, "Unknown format: ipvanyaddress"),
           "set[str]": (set[str], 'Unimplemented keys: ["uniqueItems"]'),
           "frozenset[int]": (frozenset[int], 'Unimplemented keys: ["uniqueItems"]')}


def _tool(parameters: dict[str, Any], name: str = "f") -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


@pytest.fixture(scope="module")
def cache() -> GrammarCache:
    tokenizer = Tokenizer(ensure_builtin_model())
    return GrammarCache(tokenizer.hf, tokenizer.vocab_size, [tokenizer.eos_token_id])


@pytest.mark.parametrize("name", SERVED)
def test_pydantic_types_vllm_serves_compile_as_a_schema_and_as_a_forced_tool_call(cache, name):
    schema = _schema_of(SERVED[name])
    cache.check(GuidedSpec.json_schema(schema))
    cache.check(GuidedSpec.tool_calls([_tool(schema)]))
    cache.check(GuidedSpec.tool_calls([_tool(schema), _tool({"type": "object"}, "g")], parallel=True))


@pytest.mark.parametrize("name", REFUSED)
def test_pydantic_types_vllm_refuses_are_refused_naming_the_keyword(cache, name):
    annotation, reason = REFUSED[name]
    schema = _schema_of(annotation)
    for spec, kind in ((GuidedSpec.json_schema(schema), "json_schema"),
                       (GuidedSpec.tool_calls([_tool(schema)]), "tool_calls")):
        with pytest.raises(ValueError, match=rf"invalid {kind} constraint: llguidance refuses the schema "
                                             rf"\({re.escape(reason)}.*\), and .* \(at .*\) is not supported by "
                                             rf"xgrammar") as refused:
            cache.check(spec)
        assert "\n" not in str(refused.value) and "%json" not in str(refused.value)  # (not the tool call's grammar)


def test_a_missing_llguidance_keeps_the_400_and_says_how_to_install_it(monkeypatch):
    """Without llguidance such a schema is refused as before, the message naming the package."""
    monkeypatch.setitem(__import__("sys").modules, "llguidance", None)
    tokenizer = Tokenizer(ensure_builtin_model())
    fresh = GrammarCache(tokenizer.hf, tokenizer.vocab_size, [tokenizer.eos_token_id])
    with pytest.raises(ValueError, match=r"minLength next to format \(at /properties/x\) is not supported by "
                                         r"xgrammar .*pip install llguidance"):
        fresh.check(GuidedSpec.json_schema(_schema_of(HttpUrl)))
    fresh.check(GuidedSpec.json_schema(_schema_of(str)))  # (xgrammar's schemas need no llguidance)


# ------------------------------------------------------------------------------- the engine, pushed to break them
class Bounded(BaseModel):
    word: Word
    half: Half


class Record(Bounded):
    url: HttpUrl

# An RFC 3986 URI (what `format: uri` means; jsonschema asserts it only with the rfc3987 package installed).
# HttpUrl's http(s) scheme is not in its JSON schema (pydantic checks it itself): no grammar sees it, in vLLM either.
_URI = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*:[^\s]*")


def _engine(k: int | None = None) -> LLMEngine:
    speculative = {"method": "mtp", "num_speculative_tokens": k} if k else None
    return LLMEngine(None, EngineConfig(block_size=16, kernel_block_size=8, max_model_len=512,
                                        max_num_batched_tokens=64, max_num_seqs=8, speculative_config=speculative))


def _run(engine: LLMEngine, batch: dict[str, SamplingParams]) -> dict[str, Any]:
    for rid, params in batch.items():
        engine.add_request(rid, "Write the record:", params)
    done = {}
    while engine.has_unfinished_requests():
        done |= {o.request_id: o for o in engine.step() if o.finished}
    return done


def _biases(engine: LLMEngine) -> dict[str, dict[int, float]]:
    """Logit biases that push a random model to break each bound: `"` first (an empty URL, a word of no letters),
    `a` (a word past 4 letters), `3` (a half of 3.3 or 33)."""
    def token(text: str) -> int:
        (only,) = engine.tokenizer.encode(text)
        return only
    return {"quote": {token('"'): 60.0}, "letters": {token("a"): 60.0}, "threes": {token("3"): 60.0}}


def _check(text: str, schema: dict[str, Any]) -> None:
    """`text` is JSON valid for the whole schema (the formats jsonschema knows asserted)."""
    jsonschema.validate(json.loads(text), schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)


def _call_arguments(text: str, name: str) -> str:
    match = re.fullmatch(r"<tool_call>\n(.*)\n</tool_call>", text, re.DOTALL)
    assert match, text
    call = json.loads(match.group(1))
    assert call["name"] == name
    return json.dumps(call["arguments"])


@pytest.fixture(scope="module")
def pushed() -> dict[str, Any]:
    """A JSON-schema request and a forced tool call for `Record`, under each bias, greedy; MTP off."""
    engine = _engine()
    batch = {}
    for bias, values in _biases(engine).items():
        schema = (Record if bias == "quote" else Bounded).model_json_schema()  # (else a URL of "aaa..." to 2083)
        specs = {"schema": GuidedSpec.json_schema(schema), "tool": GuidedSpec.tool_calls([_tool(schema, "save")])}
        batch |= {f"{kind}-{bias}": SamplingParams(temperature=0, max_tokens=120, logit_bias=values, guided=spec)
                  for kind, spec in specs.items()}
    return {"batch": batch, "outputs": _run(engine, batch)}


def test_outputs_pushed_to_break_the_bounds_keep_to_the_whole_schema(pushed):
    """The biases make the model want `""`, `"aaaa..."`, `33333`; the grammar stops each where the schema says,
    and every output is JSON valid for the schema (jsonschema), its word and half for the pydantic model, its url
    a URI."""
    for rid, output in pushed["outputs"].items():
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", (rid, completion.text)
        text = _call_arguments(completion.text, "save") if rid.startswith("tool") else completion.text
        fields = json.loads(text)
        _check(text, (Record if rid.endswith("quote") else Bounded).model_json_schema())
        if rid.endswith("quote"):
            url = fields.pop("url")
            assert _URI.fullmatch(url) and 1 <= len(url) <= 2083, url
        record = Bounded.model_validate(fields)
        assert 2 <= len(record.word) <= 4 and record.half % 0.5 == 0
    word = json.loads(pushed["outputs"]["schema-letters"].outputs[0].text)["word"]
    assert word == "aaaa"  # (pushed past its maxLength: cut at 4)


@pytest.mark.parametrize("drafter", ["oracle", "head"])
def test_a_fallback_grammar_under_mtp_equals_mtp_off(pushed, drafter):
    """MTP speculative decoding with an llguidance grammar: the verify rows' masks accept drafts one by one and
    roll them back (`OutputProcessor.draft_bitmask`), the accepted ones stay; the completions equal MTP off's."""
    from .spec_helpers import oracle

    engine = _engine(k=3)
    wanted = {rid: [c.token_ids for c in out.outputs] for rid, out in pushed["outputs"].items()}
    if drafter == "oracle":
        oracle(engine, wanted, seed=2)
    got = _run(engine, pushed["batch"])
    assert {rid: [c.token_ids for c in out.outputs] for rid, out in got.items()} == wanted
    if drafter == "oracle":
        assert 0 < engine.drafter.stats.num_accepted_tokens < engine.drafter.stats.num_draft_tokens


def test_the_matcher_rolls_back_through_its_stop_token(cache):
    """llguidance takes EOS without counting it once its grammar is complete: the matcher keeps that token itself,
    so a rollback over it (a verify row's drafts ending in EOS) comes back to the same state."""
    tokenizer = cache._hf_tokenizer
    eos = cache._stop_token_ids[0]
    matcher = cache.matcher(GuidedSpec.json_schema(_schema_of(Word)))
    tokens = tokenizer.encode('{"x": "ab"}', add_special_tokens=False)
    assert all(matcher.accept_token(t) for t in tokens)
    assert not matcher.is_terminated() and matcher.accept_token(eos) and matcher.is_terminated()
    assert not matcher.accept_token(tokens[0])  # nothing after the stop token
    matcher.rollback(3)  # EOS, "}" and '"'
    assert not matcher.is_terminated()
    assert not matcher.accept_token(eos)  # inside the string again: no stop
    assert all(matcher.accept_token(t) for t in tokens[-2:]) and matcher.accept_token(eos)
    refused = tokenizer.encode("x", add_special_tokens=False)[0]
    fresh = cache.matcher(GuidedSpec.json_schema(_schema_of(Word)))
    assert not fresh.accept_token(refused) and fresh.accept_token(tokens[0])  # a refusal leaves the state as it was


def test_a_fallback_grammar_behind_a_reasoning_marker(cache):
    """A reasoning model's answer (`starts_after`: vLLM's reasoning parser) with a schema llguidance compiles: free
    until the marker, then the grammar holds, and a rollback through the marker closes the gate again."""
    tokenizer = cache._hf_tokenizer
    spec = dataclasses.replace(GuidedSpec.json_schema(_schema_of(Word)), starts_after="!")
    gate = cache.matcher(spec)
    thinking = tokenizer.encode("no json here!", add_special_tokens=False)
    assert all(gate.accept_token(t) for t in thinking) and gate.open
    answer = tokenizer.encode('{"x": "a', add_special_tokens=False)
    assert all(gate.accept_token(t) for t in answer)
    (quote,) = tokenizer.encode('"', add_special_tokens=False)
    assert not gate.accept_token(quote)  # one letter: minLength 2 holds
    gate.rollback(len(answer) + 1)  # the answer and the "!"
    assert not gate.open and gate.accept_token(quote)  # closed: anything goes
