"""Async scheduling (`EngineConfig.async_scheduling`): step t+1 is planned and launched before step t is
postprocessed. It runs on the CPU too (nothing overlaps there, but every piece of bookkeeping is the same), so
these tests check it against the synchronous engine: the same tokens, the cache consistent after every step."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridcache.engine.engine import LLMEngine
from hybridcache.guided import GuidedKind, GuidedSpec
from hybridcache.sampling import SamplingParams

from . import needs_xgrammar
from .markers import needs_cuda_engine
from .test_cache_equivalence import assert_same, make_engine, run_workload, tokens


@pytest.fixture(scope="module", params=["qwen3_5_text", "qwen3_next"])
def model_dir(request, tmp_path_factory):
    from .model_folders import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp(request.param), request.param)


def run_all(engine: LLMEngine, *, check: bool = True) -> dict:
    """Step until no request is left; {request_id: final RequestOutput}, integrity checked after every step."""
    results = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                results[output.request_id] = output
        if check:
            engine.check_integrity()
    return results


def test_first_step_only_launches(model_dir):
    engine = make_engine(model_dir, async_scheduling=True)
    engine.add_request("r", tokens(random.Random(0), 40), SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert engine.step() == []  # the prefill is launched; its token comes with the next call
    out = run_all(engine)["r"]
    assert len(out.outputs[0].token_ids) == 3 and out.outputs[0].finish_reason == "length"


def test_async_cached_run_equals_sync_uncached_run(model_dir):
    """The multi-turn workload (shared system prompts, turn-end hits, an identical resend, n = 2): async with the
    cache gives the tokens and logits of the synchronous engine without it."""
    reference = make_engine(model_dir, caching=False)
    engine = make_engine(model_dir, async_scheduling=True)
    out_reference = run_workload(reference)
    out = run_workload(engine, check_every_step=True)
    assert_same(engine, reference, out, out_reference)
    assert sum(o.num_cached_tokens for o in out.values()) > 0
    assert engine.num_prefill_tokens < reference.num_prefill_tokens


def test_async_under_pressure_preempts_evicts_and_matches(model_dir):
    reference = make_engine(model_dir, caching=False)
    tight = make_engine(model_dir, async_scheduling=True, num_blocks=26, max_model_len=300,
                        max_num_seqs=6, max_num_batched_tokens=256)
    integrity = tight.check_integrity

    def check() -> None:  # also: a sequence the next step's plan preempted restarts from 0 (not its old chunk end)
        integrity()
        assert all(seq.num_computed == 0 for seq in tight.scheduler.waiting)

    tight.check_integrity = check
    out_reference = run_workload(reference, seed=1, reply_lens=(20, 40))
    out = run_workload(tight, seed=1, check_every_step=True, reply_lens=(20, 40))
    assert_same(tight, reference, out, out_reference)
    assert tight.stats()["num_preemptions"] > 0


def _stopping_requests(engine: LLMEngine, rng: random.Random) -> None:
    """Requests that stop early at data-dependent steps: stop tokens drawn from the byte range (a random model
    samples them every few dozen tokens), a stop string, min_tokens, seeded random sampling and n = 3; request
    0 is short enough to end by length."""
    stops = tuple(rng.sample(range(256), 12))
    for i in range(6):
        max_tokens = 3 if i == 0 else rng.randrange(20, 60)
        params = SamplingParams(temperature=0 if i % 2 else 0.9, seed=i, max_tokens=max_tokens, stop_token_ids=stops,
                                min_tokens=2 if i == 3 else 0, n=3 if i == 4 else 1,
                                stop=["e"] if i == 5 else ())
        engine.add_request(f"r{i}", tokens(rng, rng.randrange(20, 90)), params)


def test_early_stops_abort_and_follow_up_hits_match_sync(model_dir):
    """Sequences that stop on a sampled token already have a row in the next step: it is ignored, outputs equal
    the synchronous engine's, and the finish checkpoint (one token longer) is still a true prefix."""
    results = []
    for async_scheduling in (False, True):
        engine = make_engine(model_dir, async_scheduling=async_scheduling, max_num_batched_tokens=128)
        _stopping_requests(engine, random.Random(7))
        engine.add_request("aborted", tokens(random.Random(8), 50),
                           SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
        early = {}
        for _ in range(4):
            early.update((o.request_id, o) for o in engine.step() if o.finished)
            engine.check_integrity()
        engine.abort("aborted")
        engine.check_integrity()
        results.append((engine, {**early, **run_all(engine)}))
    (sync_engine, sync_out), (async_engine, async_out) = results
    assert sync_out.keys() == async_out.keys()
    reasons = set()
    for request_id, want in sync_out.items():
        got = async_out[request_id]
        for a, b in zip(got.outputs, want.outputs, strict=True):
            assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason), request_id
            reasons.add(b.finish_reason)
    assert reasons == {"stop", "length"}
    # A follow-up turn over a stopped completion hits at least what the synchronous engine's does.
    stopped = next(o for o in sync_out.values() if o.outputs[0].finish_reason == "stop")
    follow_up = list(stopped.prompt_token_ids) + stopped.outputs[0].token_ids + [1, 2, 3]
    hits = []
    for engine in (sync_engine, async_engine):
        engine.add_request("follow-up", follow_up, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
        hits.append(run_all(engine)["follow-up"].num_cached_tokens)
        engine.check_integrity()
    assert hits[1] >= hits[0] >= len(follow_up) - 4


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "yz"]}},
          "required": ["a", "b"], "additionalProperties": False}


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, repetition_penalty=1.3, frequency_penalty=0.5),
    pytest.param(SamplingParams(temperature=0, max_tokens=12, guided=GuidedSpec(GuidedKind.REGEX, "[a-z]+")),
                 marks=needs_xgrammar),
    pytest.param(SamplingParams(temperature=1.0, seed=1, max_tokens=60, n=2, guided=GuidedSpec.json_schema(SCHEMA)),
                 marks=needs_xgrammar),
], ids=["penalties", "regex", "json-schema"])
def test_steps_that_need_the_tokens_stay_async(model_dir, params, monkeypatch):
    """A request whose next sample depends on its tokens on the host (penalties read the output, a grammar its
    state) beside a plain one keeps the engine async: every step is planned and launched before the one before
    is postprocessed, and a step that samples it queues its sampling only after that (`_sample_deferred`, when
    the grammar has accepted the token before). Token for token the synchronous engine's outputs; the guided
    texts follow their grammar."""
    outs, overlapped, deferred = [], [], []
    for async_scheduling in (False, True):
        engine = make_engine(model_dir, async_scheduling=async_scheduling)
        can_overlap, sample_deferred = engine._can_overlap, engine._sample_deferred

        def recording_overlap(launched, original=can_overlap):
            overlapped.append(original(launched))
            return overlapped[-1]

        def recording_deferred(launched, original=sample_deferred):
            deferred.append({seq.request_id for seq in launched.sampled})
            original(launched)

        monkeypatch.setattr(engine, "_can_overlap", recording_overlap)
        monkeypatch.setattr(engine, "_sample_deferred", recording_deferred)
        rng = random.Random(9)
        engine.add_request("special", tokens(rng, 30), params)
        engine.add_request("plain", tokens(rng, 30), SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
        outs.append(run_all(engine))
        if not async_scheduling:
            assert not overlapped and not deferred  # the synchronous engine never has a step in flight
    for request_id in ("special", "plain"):
        sync_out, async_out = (o[request_id].outputs for o in outs)
        assert [(c.token_ids, c.finish_reason) for c in sync_out] == [(c.token_ids, c.finish_reason)
                                                                     for c in async_out], request_id
    assert len(overlapped) >= 19 and all(overlapped)  # every step of the plain request's 20 but the last
    # every sample of the special request's after its prefill's
    assert len(deferred) >= max(len(c.token_ids) for c in outs[1]["special"].outputs) - 1 >= 2
    assert all("special" in ids for ids in deferred)
    if params.guided is not None and params.guided.kind is GuidedKind.REGEX:
        assert re.fullmatch("[a-z]+", outs[1]["special"].outputs[0].text)
    elif params.guided is not None:
        for completion in outs[1]["special"].outputs:
            assert completion.finish_reason == "stop"
            jsonschema.validate(json.loads(completion.text), SCHEMA)


@needs_cuda_engine
def test_async_equals_sync_on_cuda_with_graphs(tmp_path):
    """On the GPU (bf16, CUDA graphs, the CUDA kernels): async scheduling runs the same batches as synchronous
    steps when every sequence ends by length, so the greedy tokens are identical; and with stop tokens (rows
    of stopped sequences run one step longer) the run completes with the cache intact."""
    from hybridcache import LLM

    from .model_folders import write_tiny_model

    folder = write_tiny_model(tmp_path, "qwen3_next")
    llm = LLM(folder, device="cuda", dtype="bfloat16", max_num_seqs=16, gpu_memory_utilization=0.2)
    engine = llm.engine
    assert engine.async_scheduling and engine.runner.graph_batch_sizes
    rng = random.Random(11)
    prompts = [tokens(rng, rng.randrange(30, 300)) for _ in range(24)]
    params = [SamplingParams(temperature=0, max_tokens=rng.randrange(20, 120), ignore_eos=True) for _ in prompts]
    runs = []
    for async_scheduling in (True, False):
        engine.clear_cache()
        engine.async_scheduling = async_scheduling
        runs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        engine.check_integrity()
    assert runs[0] == runs[1]
    engine.async_scheduling = True
    stopping = SamplingParams(temperature=0, max_tokens=80, stop_token_ids=tuple(range(0, 256, 9)))
    outputs = llm.generate(prompts, stopping, use_tqdm=False)
    assert {o.outputs[0].finish_reason for o in outputs} >= {"stop"}
    engine.check_integrity()


@pytest.fixture(scope="module")
def engine_pair(model_dir):
    """A synchronous and an async engine over the same model (reused across hypothesis examples)."""
    return [make_engine(model_dir, async_scheduling=flag, max_num_seqs=4, max_num_batched_tokens=64, num_blocks=14,
                        max_model_len=200)
            for flag in (False, True)]


_REQUESTS = st.lists(
    st.tuples(st.integers(0, 2), st.integers(1, 60), st.integers(1, 24), st.integers(1, 2), st.booleans()),
    min_size=1, max_size=7,
)


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(requests=_REQUESTS, abort_at=st.integers(0, 12), seed=st.integers(0, 1000))
def test_async_matches_sync_on_random_traffic(engine_pair, requests, abort_at, seed):
    """Random mixes of shared-prefix prompts, lengths, n, stop tokens and one abort under a small KV pool
    (preemptions): every request that was not aborted gets the same tokens and finish reasons from the async
    engine as from the synchronous one, and both caches stay intact after every call."""
    rng = random.Random(seed)
    stems = [tokens(rng, 40) for _ in range(3)]
    stops = tuple(rng.sample(range(256), 24))
    results = []
    for engine in engine_pair:
        engine.clear_cache()
        for i, (stem, extra, max_tokens, n, stopping) in enumerate(requests):
            params = SamplingParams(temperature=0, max_tokens=max_tokens, n=n, ignore_eos=not stopping,
                                    stop_token_ids=stops if stopping else ())
            engine.add_request(f"{seed}-{i}", stems[stem] + tokens(random.Random(seed + i), extra), params)
        finished, calls = {}, 0
        while engine.has_unfinished_requests():
            if calls == abort_at:
                engine.abort(f"{seed}-0")
            finished.update((o.request_id, o) for o in engine.step() if o.finished)
            engine.check_integrity()
            calls += 1
        results.append(finished)
    sync, async_ = results
    kept = [rid for rid in sync if rid != f"{seed}-0"]
    assert sorted(kept) == sorted(rid for rid in async_ if rid != f"{seed}-0")
    for rid in kept:
        got = [(c.token_ids, c.finish_reason) for c in async_[rid].outputs]
        want = [(c.token_ids, c.finish_reason) for c in sync[rid].outputs]
        assert got == want, rid


def test_a_plan_that_raises_still_finishes_the_launched_step(model_dir, monkeypatch):
    """With a step on the device, a `schedule()` that raises (nothing fits: it changes nothing) does not lose
    that step: the call postprocesses it, the error comes back at the next call, and the engine stays usable."""
    engine = make_engine(model_dir, async_scheduling=True)
    reference = make_engine(model_dir)
    prompt = tokens(random.Random(12), 40)
    for e in (engine, reference):
        e.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    assert engine.step() == []  # the prefill is on the device
    schedule = engine.scheduler.schedule

    def no_room():
        raise RuntimeError("no room")

    monkeypatch.setattr(engine.scheduler, "schedule", no_room)
    outputs = engine.step()
    assert [len(o.outputs[0].token_ids) for o in outputs] == [1]  # the prefill's token
    with pytest.raises(RuntimeError, match="no room"):
        engine.step()  # nothing launched now: the error itself
    monkeypatch.setattr(engine.scheduler, "schedule", schedule)
    engine.check_integrity()
    assert run_all(engine)["r"].outputs[0].token_ids == run_all(reference)["r"].outputs[0].token_ids
