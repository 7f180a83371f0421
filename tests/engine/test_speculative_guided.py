"""Structured output and penalties with MTP speculative decoding (CPU, fp32, the built-in model and its random MTP
head): MTP on gives exactly MTP off's completions (token ids, text, finish reason, logprobs) for greedy requests
with a JSON schema, a regex, a choice or a grammar behind a reasoning marker, and for penalized requests (greedy
and seeded), alone and in a batch with plain requests, through a prefix-cache hit and preemptions. Verify rows
accept 0..k drafts (an oracle drafter, `spec_helpers.oracle`) or none (the random head). Before, every such
request was refused ("not supported with speculative decoding yet")."""

from __future__ import annotations

import json
import math
import random

import pytest

from hybridcache.config import EngineConfig
from hybridcache.engine.engine import LLMEngine
from hybridcache.guided import GrammarCache, GuidedKind, GuidedSpec
from hybridcache.models.builtin import ensure_builtin_model
from hybridcache.sampling import SamplingParams
from hybridcache.tokenizer import Tokenizer
from tests.engine import needs_xgrammar

from .spec_helpers import oracle, spec

pytestmark = needs_xgrammar

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "yz"]}},
          "required": ["a", "b"], "additionalProperties": False}
PENALTIES = {"repetition_penalty": 1.4, "frequency_penalty": 0.5, "presence_penalty": 0.3}


def make(k: int | None, **options) -> LLMEngine:
    config = {"block_size": 16, "kernel_block_size": 8, "max_model_len": 256, "max_num_batched_tokens": 64,
              "max_num_seqs": 8, **options}
    return LLMEngine(None, EngineConfig(**config, speculative_config=spec(k) if k else None))


def marker_of_greedy_output() -> str:
    """The text of a token early in the built-in model's greedy completion of "hello there" (one that decodes
    alone to printable text), for a gate that opens inside the completion."""
    engine = make(None, enable_prefix_caching=False)
    output = run(engine, {"plain": SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)})["plain"]
    texts = [engine.tokenizer.decode([t]) for t in output.outputs[0].token_ids[2:]]
    return next(t for t in texts if t.strip() and t.isprintable())


def requests(marker: str) -> dict[str, SamplingParams]:
    json_spec = GuidedSpec.json_schema(SCHEMA)
    return {
        "json": SamplingParams(temperature=0, max_tokens=40, guided=json_spec, logprobs=2),
        "regex": SamplingParams(temperature=0, max_tokens=30,
                                guided=GuidedSpec(GuidedKind.REGEX, "[a-z]{2,8}-[0-9]{2,5}")),
        "choice": SamplingParams(temperature=0, max_tokens=10, logprobs=1,
                                 guided=GuidedSpec(GuidedKind.CHOICE, json.dumps(["alpha", "beta", "gamma"]))),
        "gated": SamplingParams(temperature=0, max_tokens=30,
                                guided=GuidedSpec(GuidedKind.REGEX, "[0-9]{3,6}", starts_after=marker)),
        "penalized": SamplingParams(temperature=0, max_tokens=24, logprobs=1, **PENALTIES),
        "seeded-penalized": SamplingParams(temperature=1.0, seed=11, max_tokens=24, ignore_eos=True, **PENALTIES),
        "seeded-json": SamplingParams(temperature=0.8, seed=5, max_tokens=40, guided=json_spec),
        "plain": SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
        "plain-seeded": SamplingParams(temperature=1.0, seed=3, max_tokens=20, ignore_eos=True),
    }


def run(engine: LLMEngine, batch: dict[str, SamplingParams], prompt="hello there") -> dict:
    """The finished outputs of `batch` sent together (each request its own prompt when `prompt` is a dict),
    `check_integrity` after every step."""
    for rid, params in batch.items():
        engine.add_request(rid, prompt[rid] if isinstance(prompt, dict) else prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        done |= {o.request_id: o for o in engine.step() if o.finished}
        engine.check_integrity()
    return done


def summary(outputs: dict) -> dict:
    """Per request and completion: token ids, text, finish reason, and the logprob entries (token: rank, value)."""
    return {rid: [(c.token_ids, c.text, c.finish_reason,
                   None if c.logprobs is None else
                   [{t: (lp.rank, lp.logprob) for t, lp in entry.items()} for entry in c.logprobs])
                  for c in out.outputs] for rid, out in outputs.items()}


def assert_same(got: dict, wanted: dict) -> None:
    """`summary`s equal, the logprob values up to float noise (the verify rows' logits come from another batch
    shape)."""
    def exact(summary: dict) -> dict:
        return {rid: [(*c[:3], None if c[3] is None else [{t: r for t, (r, _) in e.items()} for e in c[3]])
                      for c in completions] for rid, completions in summary.items()}

    assert exact(got) == exact(wanted)
    for rid, completions in got.items():
        for c, w in zip(completions, wanted[rid], strict=True):
            for entry, want in zip(c[3] or (), w[3] or (), strict=True):
                for token, (_, value) in entry.items():
                    assert math.isclose(value, want[token][1], abs_tol=1e-4), (rid, token, value, want[token])


def references(outputs: dict) -> dict:
    return {rid: [c.token_ids for c in out.outputs] for rid, out in outputs.items()}


@pytest.fixture(scope="module")
def marker() -> str:
    return marker_of_greedy_output()


@pytest.fixture(scope="module")
def mtp_off(marker) -> dict:
    return summary(run(make(None, enable_prefix_caching=False), requests(marker)))


@pytest.mark.parametrize("drafter", ["oracle", "head"])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_guided_and_penalized_requests_in_a_batch_equal_mtp_off(marker, mtp_off, k, drafter):
    engine = make(k)
    if drafter == "oracle":
        oracle(engine, {rid: [c[0] for c in completions] for rid, completions in mtp_off.items()}, seed=k)
    got = summary(run(engine, requests(marker)))
    assert_same(got, mtp_off)
    stats = engine.drafter.stats
    assert stats.num_draft_tokens > 0
    if drafter == "oracle":  # verify rows accepted every count of drafts, and rejected some
        assert all(n > 0 for n in stats.accepted_per_position) and stats.num_accepted_tokens < stats.num_draft_tokens
    gated = got["gated"][0][1]
    assert marker in gated and gated.split(marker, 1)[1].isdigit()  # the grammar took over after the marker
    assert json.loads(got["json"][0][1]).keys() == {"a", "b"} or got["json"][0][2] == "length"


@pytest.mark.parametrize("name", ["json", "regex", "choice", "gated", "penalized", "seeded-penalized",
                                  "seeded-json"])
def test_each_request_alone_equals_mtp_off(marker, mtp_off, name):
    engine = make(2)
    oracle(engine, {name: [c[0] for c in mtp_off[name]]}, seed=3)
    assert_same(summary(run(engine, {name: requests(marker)[name]})), {name: mtp_off[name]})
    assert engine.drafter.stats.num_accepted_tokens > 0


def test_a_guided_resend_that_hits_the_cache_equals_mtp_off(marker):
    """A JSON-schema request and a penalized one sent twice: the resend hits the first's whole prompt (it samples
    without a forward: a zero-prefill hit, masked in `judge` too) and still equals MTP off."""
    prompt = [random.Random(0).randrange(256) for _ in range(70)]
    batch = {rid: requests(marker)[rid] for rid in ("json", "penalized", "seeded-json")}
    off = make(None, enable_prefix_caching=False)
    wanted = [summary(run(off, batch, prompt)), summary(run(off, batch, prompt))]
    assert_same(wanted[1], wanted[0])
    engine = make(2)
    oracle(engine, {rid: [c[0] for c in completions] for rid, completions in wanted[0].items()}, seed=1)
    first = run(engine, batch, prompt)
    again = run(engine, batch, prompt)
    assert all(out.num_cached_tokens == len(prompt) for out in again.values())
    assert_same(summary(first), wanted[0])
    assert_same(summary(again), wanted[0])
    assert engine.drafter.stats.num_accepted_tokens > 0


def test_guided_and_penalized_requests_under_preemption_equal_mtp_off(marker):
    """Six requests of 60-token prompts in a pool of 16 blocks (preempted and recomputed, their grammars and
    penalties carried over) against MTP off in a pool that holds them all."""
    rng = random.Random(2)
    batch = {f"{rid}-{i}": params for i in range(2)
             for rid, params in requests(marker).items() if rid in ("json", "seeded-penalized", "regex")}
    prompts = {rid: [rng.randrange(256) for _ in range(60)] for rid in batch}
    wanted = summary(run(make(None, enable_prefix_caching=False), batch, prompts))
    engine = make(2, num_blocks=16, max_num_seqs=6, max_model_len=200)
    oracle(engine, {rid: [c[0] for c in completions] for rid, completions in wanted.items()}, seed=4)
    assert_same(summary(run(engine, batch, prompts)), wanted)
    assert engine.stats()["num_preemptions"] > 0 and engine.drafter.stats.num_accepted_tokens > 0


# ---------------------------------------------------------------------------------------------- the pieces
@pytest.fixture(scope="module")
def grammars() -> GrammarCache:
    tokenizer = Tokenizer(ensure_builtin_model())
    return GrammarCache(tokenizer.hf, tokenizer.vocab_size, [tokenizer.eos_token_id])


def _allowed(matcher, vocab_size: int) -> list[int]:
    from hybridcache.guided import fill_bitmask
    bits = fill_bitmask([matcher], vocab_size)[0].tolist()
    return [v for v in range(vocab_size) if bits[v // 32] >> v % 32 & 1]


def test_a_marker_gate_rolls_back_through_its_opening(grammars):
    """Accept the tokens of "ab!12", roll back 1..5 tokens: each time the gate (open or closed) and the grammar
    allow what they allowed at that point the first time."""
    tokenizer = grammars._hf_tokenizer
    tokens = [t for ch in "ab!12" for t in tokenizer.encode(ch, add_special_tokens=False)]
    gate = grammars.matcher(GuidedSpec(GuidedKind.REGEX, "[0-9]{2,4}", starts_after="!"))
    vocab = grammars.vocab_size
    states = [(gate.open, _allowed(gate, vocab))]
    for token in tokens:
        assert gate.accept_token(token)
        states.append((gate.open, _allowed(gate, vocab)))
    assert [open_ for open_, _ in states] == [False, False, False, True, True, True]
    for back in range(1, len(tokens) + 1):
        gate.rollback(back)
        assert (gate.open, _allowed(gate, vocab)) == states[-1 - back]
        for token in tokens[len(tokens) - back:]:
            gate.accept_token(token)
        assert (gate.open, _allowed(gate, vocab)) == states[-1]
    with pytest.raises(ValueError, match="cannot roll back"):
        gate.rollback(len(tokens) + 1)


def test_a_closed_gate_keeps_a_bounded_history_and_still_rolls_back(grammars):
    """A reasoning that never writes the marker: the gate keeps its window and MAX_ROLLBACK tokens (amortised),
    not every token of the reasoning, and a rollback of a row's drafts after that still restores the marker's
    detection."""
    tokenizer = grammars._hf_tokenizer
    gate = grammars.matcher(GuidedSpec(GuidedKind.REGEX, "[0-9]{2,4}", starts_after="!"))
    filler = tokenizer.encode("a", add_special_tokens=False)[0]
    for _ in range(5000):
        gate.accept_token(filler)
    assert len(gate._seen) <= 2 * (gate._window_len + gate.MAX_ROLLBACK)
    (bang,) = tokenizer.encode("!", add_special_tokens=False)
    gate.accept_token(bang)
    assert gate.open
    gate.rollback(8)  # the bang and seven fillers
    assert not gate.open
    for token in [filler] * 7 + [bang]:
        gate.accept_token(token)
    assert gate.open


def test_draft_masks_follow_the_drafts_and_leave_the_matcher_as_it_was(grammars):
    """`OutputProcessor.draft_bitmask`: row j is the mask after drafts 1..j; a refused draft repeats its
    position's mask after it; the matcher ends where it began."""
    engine = make(None)
    params = SamplingParams(temperature=0, guided=GuidedSpec(GuidedKind.CHOICE, json.dumps(["yes", "yet"])))
    engine.add_request("r", "x", params)
    state = engine._requests["r"]
    seq, vocab = state.seqs[0], engine.model_config.vocab_size
    encode = engine.tokenizer.encode
    y, e, s, z = (encode(ch)[0] for ch in "yesz")
    masks = engine.output_processor.draft_bitmask(state, seq, [y, e, z, s], vocab)
    assert masks.shape == (5, math.ceil(vocab / 32))

    def allowed(row):
        bits = masks[row].tolist()
        return {v for v in range(vocab) if bits[v // 32] >> v % 32 & 1}

    assert y in allowed(0) and e in allowed(1) and s in allowed(2) and z not in allowed(2)
    assert allowed(3) == allowed(2) and allowed(4) == allowed(2)  # after the refused z: unreachable
    assert allowed(0) == set(_allowed(state.matchers[0], vocab))  # rolled back to the start
    assert engine.output_processor.draft_bitmask(engine._requests["r"], seq, [], vocab).shape[0] == 1
    engine.abort("r")
