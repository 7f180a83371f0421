"""The sampler inside the engine: logprobs against the engine's own logits; structured output per completion.
Each test runs on the CPU and, where there is one, on a CUDA device (skipped cleanly without CUDA)."""

import dataclasses
import json
import re

import jsonschema
import pytest
import torch

from hybridcache.config import EngineConfig
from hybridcache.detokenizer import token_text
from hybridcache.engine.engine import LLMEngine
from hybridcache.guided import GuidedKind, GuidedSpec, fill_bitmask
from hybridcache.sampling import SamplingParams, top_logprobs
from tests.engine import needs_xgrammar

SMALL = EngineConfig(block_size=16, kernel_block_size=8, max_model_len=256, max_num_batched_tokens=64,
                     max_num_seqs=4)


@pytest.fixture(scope="module", params=[
    "cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"))])
def engine(request):
    if request.param == "cpu":
        return LLMEngine(None, SMALL)
    # fp32 on CUDA, with pools of a fixed size (not sized from the whole device)
    return LLMEngine(None, dataclasses.replace(SMALL, device="cuda", num_blocks=256))


def run(engine, request_id, prompt, params):
    engine.add_request(request_id, prompt, params)
    final = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.request_id == request_id:
                final = output
    return final


def test_logprobs_equal_log_softmax_of_the_engines_logits(engine):
    recorded = []
    execute = engine.runner.execute

    def recording(batch, feed=None):
        logits = execute(batch, feed)
        recorded.append(logits.detach().float().clone())
        return logits

    engine.runner.execute = recording
    try:
        params = SamplingParams(temperature=0.9, seed=4, max_tokens=6, ignore_eos=True, logprobs=4)
        output = run(engine, "lp", list(range(30, 70)), params).outputs[0]
    finally:
        engine.runner.execute = execute
    assert len(output.logprobs) == len(output.token_ids) == 6
    # one sampled row per step: the last row of each step's logits is this request's
    steps = [logits[-1] for logits in recorded][-6:]
    total = 0.0
    decode = lambda ids: engine.tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731
    for i, (token, entry, logits) in enumerate(zip(output.token_ids, output.logprobs, steps)):
        expected = torch.log_softmax(logits, dim=-1)
        assert next(iter(entry)) == token  # vLLM's shape: {token id: Logprob}, the sampled token first
        assert entry[token].logprob == pytest.approx(float(expected[token]), abs=1e-5)
        assert entry[token].rank == int((expected > expected[token]).sum()) + 1
        assert entry[token].decoded_token == token_text(decode, token, output.token_ids[max(0, i - 4):i])
        top = expected.topk(4)
        assert [t for t, _ in top_logprobs(entry, token, 4)] == top.indices.tolist()
        assert [lp.rank for _, lp in top_logprobs(entry, token, 4)] == [1, 2, 3, 4]
        assert len(entry) == 4 + (token not in top.indices.tolist())
        total += entry[token].logprob
    assert output.cumulative_logprob == pytest.approx(total)


@needs_xgrammar
def test_json_schema_constrains_every_completion_of_n(engine):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "yz"]}},
              "required": ["a", "b"], "additionalProperties": False}
    params = SamplingParams(temperature=1.0, seed=1, max_tokens=60, n=4, guided=GuidedSpec.json_schema(schema))
    output = run(engine, "js", "hello", params)
    texts = [c.text for c in output.outputs]
    for c in output.outputs:
        assert c.finish_reason == "stop", texts
        jsonschema.validate(json.loads(c.text), schema)
    assert len(set(texts)) > 1  # each completion follows its own grammar state


@needs_xgrammar
def test_regex_and_choice(engine):
    pattern = "<think>[a-z]{2,6}</think>[0-9]{3}"
    params = SamplingParams(temperature=1.0, seed=2, max_tokens=30, guided=GuidedSpec(GuidedKind.REGEX, pattern))
    text = run(engine, "re", "x", params).outputs[0].text
    assert re.fullmatch(pattern, text), text
    choice = GuidedSpec(GuidedKind.CHOICE, json.dumps(["yes", "no"]))
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=30, guided=choice)
    assert run(engine, "ch", "x", params).outputs[0].text in ("yes", "no")


@needs_xgrammar
@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("option", ["min_tokens", "ignore_eos"])
def test_a_complete_grammar_ends_the_completion(engine, option, temperature):
    """Once a choice is complete its grammar allows only EOS: min_tokens (which bans EOS) must not turn the row into
    all -inf logits (token 0 sampled over and over), and ignore_eos must not leave the row unconstrained after it.
    Either way the completion is the choice and finishes with "stop"."""
    choice = GuidedSpec(GuidedKind.CHOICE, json.dumps(["yes"]))
    extra = {"min_tokens": 8} if option == "min_tokens" else {"ignore_eos": True}
    params = SamplingParams(temperature=temperature, seed=4, max_tokens=12, guided=choice, **extra)
    output = run(engine, f"complete-{option}-{temperature}", "x", params).outputs[0]
    assert (output.text, output.finish_reason) == ("yes", "stop")
    assert 0 not in output.token_ids
    engine.check_integrity()


def test_integer_temperatures_and_penalties_beyond_int64_run_beside_float_ones(engine):
    """An int temperature of 10**19 (once an int64 overflow inside the step, which killed the engine), alone and
    beside an ordinary row: every request completes and the engine serves on."""
    huge = SamplingParams(temperature=10**19, repetition_penalty=10**19, seed=1, max_tokens=4)
    assert run(engine, "huge-alone", "hello", huge).finished
    for request_id, params in (("huge", SamplingParams(temperature=10**19, repetition_penalty=10**19, seed=1)),
                               ("plain", SamplingParams(temperature=0.7, seed=2))):
        engine.add_request(request_id, "hello", params)
    finished = set()
    while engine.has_unfinished_requests():
        finished |= {o.request_id for o in engine.step() if o.finished}
    assert finished == {"huge", "plain"}
    assert run(engine, "after", "hello", SamplingParams(max_tokens=3)).finished
    engine.check_integrity()


@needs_xgrammar
def test_a_constraint_that_starts_after_a_marker_leaves_the_text_before_it_free(engine):
    """A reasoning model's constraint starts after `</think>` (vLLM applies it once the reasoning parser says the
    reasoning ended): here the marker is "!", which a logit bias makes the likeliest token. The first token is the
    marker, free; then the choice; the gate never opening leaves the whole completion free."""
    bang = engine.tokenizer.encode("!")[0]
    choice = GuidedSpec(GuidedKind.CHOICE, json.dumps(["yes"]), starts_after="!")
    params = SamplingParams(temperature=0, max_tokens=10, logit_bias={bang: 100}, guided=choice)
    output = run(engine, "gated", "x", params).outputs[0]
    assert (output.text, output.finish_reason) == ("!yes", "stop")
    never = dataclasses.replace(choice, starts_after="</think>")
    free = run(engine, "never-opens", "x", dataclasses.replace(params, guided=never, ignore_eos=True)).outputs[0]
    assert free.token_ids == [bang] * 10  # unconstrained: the bias wins every step
    engine.check_integrity()


@needs_xgrammar
def test_bad_schema_is_a_value_error_and_changes_nothing(engine):
    params = SamplingParams(guided=GuidedSpec(GuidedKind.REGEX, "(unclosed"))
    with pytest.raises(ValueError, match="regex"):
        engine.add_request("bad", "x", params)
    assert not engine.has_unfinished_requests()


@needs_xgrammar
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_grammar_with_no_output_is_refused_and_a_dead_end_ends_the_choice(engine, temperature):
    """Issue 26: `root ::= x`, `x ::= x` allows nothing, and used to answer token 0 again and again; it is refused
    when the request is added. A grammar that dead-ends later (nothing may follow "a") ends the choice with EOS."""
    never = SamplingParams(guided=GuidedSpec(GuidedKind.GRAMMAR, "root ::= x\nx ::= x"))
    with pytest.raises(ValueError, match="allows no first token"):
        engine.add_request("never", "x", never)
    assert not engine.has_unfinished_requests()
    engine.check_integrity()
    dead_end = GuidedSpec(GuidedKind.GRAMMAR, 'root ::= "a" x\nx ::= x')
    params = SamplingParams(temperature=temperature, seed=1, max_tokens=6, guided=dead_end)
    choice = run(engine, f"dead-end-{temperature}", "x", params).outputs[0]
    assert (choice.text, choice.finish_reason) == ("a", "stop")
    assert choice.token_ids[-1] in engine.eos_token_ids and len(choice.token_ids) == 2


def test_a_dead_end_row_allows_exactly_the_given_tokens_top_bits_included():
    class DeadEnd:
        def is_terminated(self) -> bool:
            return False

        def fill_next_token_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
            bitmask[row] = 0

    bitmask = fill_bitmask([DeadEnd(), None], 96, dead_end_tokens=[31, 63, 64])
    allowed = [t for t in range(96) if (int(bitmask[0, t // 32]) >> (t % 32)) & 1]
    assert allowed == [31, 63, 64]
    assert all((int(bitmask[1, t // 32]) >> (t % 32)) & 1 for t in range(96))  # an unconstrained row: all
