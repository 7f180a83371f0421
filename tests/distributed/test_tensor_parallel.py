"""Tensor parallelism on the CPU (gloo, 2 ranks) computes what one rank computes and what transformers
computes: greedy tokens equal, logits within 1e-4 (relative), on tiny Qwen3-Next, Qwen3.5 and Qwen3.5-MoE
models; logprobs within 1e-5 of one rank's (an odd vocabulary's padding columns take no part); with the prefix
cache on, the cache-equivalence workload gives the tokens and logits of an uncached single-rank run; and async
scheduling (the fed tokens broadcast from rank 0) gives the synchronous tokens, also on the cache workload.

Each model family starts one 2-rank engine (a spawned worker: seconds), shared by the module's tests of that
family. Qwen3-Next (packed projections, MoE and a dense layer) runs in the default suite, also with a vocabulary
of 321 (odd: the lm_head shards are padded) tied to the embedding; the other families and the replicated-head
variants (one kv head and one DeltaNet key head, held by both ranks) are marked slow.
The last test kills the worker mid-run: the engine raises an error naming its rank within seconds.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time

import pytest
import torch

from hybridcache.config import EngineConfig
from hybridcache.distributed.executor import WorkerError
from hybridcache.engine.engine import EngineDeadError, LLMEngine
from hybridcache.sampling import SamplingParams
from tests.engine.test_cache_equivalence import assert_same, make_engine, run_workload

from .folders import transformers_logits, write_folder
from .test_shutdown import alive

REL_TOL = 1e-4
# Logprobs are fp32 log-softmaxes of logits near 25 here (an ulp of 25 is 1.9e-6): two ranks sum the row-parallel
# products in another order than one, and an AMD EPYC put them 1.45e-5 apart (1e-5 held on the machines before). A
# padding column left in the sum shifts every logprob by log1p(exp(z_pad) / sum(exp(z))): far above this for a
# garbage logit, 7.6e-12 for a zero one (which no fp32 comparison sees).
LOGPROB_TOL = 5e-5
SLOW = pytest.mark.slow


VARIANTS = {
    "": {},
    # one kv head and one DeltaNet key head for 2 ranks: both ranks hold (replicate) them
    "replicated": {"num_key_value_heads": 1, "linear_num_key_heads": 1},
    # a vocabulary 2 does not divide: rank 1's lm_head rows end in a zero padding row; tied to the embedding
    "oddvocab": {"vocab_size": 321, "tie_word_embeddings": True},
}


@pytest.fixture(scope="module", params=["qwen3_next", pytest.param("qwen3_5_text", marks=SLOW),
                                        pytest.param("qwen3_5_moe_text", marks=SLOW),
                                        "qwen3_next-oddvocab",
                                        pytest.param("qwen3_next-replicated", marks=SLOW),
                                        pytest.param("qwen3_5_text-replicated", marks=SLOW)])
def model_dir(request, tmp_path_factory):
    model_type, _, variant = request.param.partition("-")
    return write_folder(tmp_path_factory.mktemp(request.param), model_type, **VARIANTS[variant])


@pytest.fixture(scope="module")
def tp_engine(model_dir):
    """A 2-rank engine with the prefix cache on (recording every sampled row's logits in `engine.logits`)."""
    engine = make_engine(model_dir, tensor_parallel_size=2)
    yield engine
    engine.runner.shutdown()


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).abs().max() / ref.abs().max()).item()


def generate(engine: LLMEngine, request_id: str, prompt: list[int], max_tokens: int) -> list[int]:
    engine.add_request(request_id, prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                return output.outputs[0].token_ids
    raise AssertionError("the request did not finish")


def assert_two_ranks_match_one(folder, label: str, prompt: list[int], max_tokens: int = 8,
                               **engine_args) -> LLMEngine:
    """One rank, then two ranks, on `folder` with `engine_args`: the same `max_tokens` greedy tokens, and every
    sampled position's logits within REL_TOL of one rank's. Returns the one-rank engine."""
    single = make_engine(folder, **engine_args)
    want = generate(single, label, prompt, max_tokens)
    engine = make_engine(folder, tensor_parallel_size=2, **engine_args)
    try:
        got = generate(engine, label, prompt, max_tokens)
    finally:
        engine.runner.shutdown()
    assert got == want and len(want) == max_tokens
    for i in range(len(want)):
        key = (label, 0, len(prompt) + i)
        assert rel_err(engine.logits[key], single.logits[key]) <= REL_TOL, i
    return single


def test_two_ranks_match_one_rank_and_transformers(model_dir, tp_engine):
    prompt = [random.Random(7).randrange(256) for _ in range(170)]
    single = make_engine(model_dir)
    want = generate(single, "long", prompt, 12)
    got = generate(tp_engine, "long", prompt, 12)
    assert got == want
    reference = transformers_logits(model_dir, prompt + want)
    for i in range(len(want)):
        key = ("long", 0, len(prompt) + i)  # the logits sampled when the sequence held that many tokens
        assert rel_err(tp_engine.logits[key], single.logits[key]) <= REL_TOL, i
        assert rel_err(tp_engine.logits[key], reference[len(prompt) + i - 1]) <= REL_TOL, i
        assert int(reference[len(prompt) + i - 1].argmax()) == want[i]


def test_cache_workload_on_two_ranks_matches_an_uncached_single_rank(model_dir, tp_engine):
    tp_engine.clear_cache()
    tp_engine.logits.clear()
    uncached = make_engine(model_dir, caching=False)
    out_uncached = run_workload(uncached)
    out_cached = run_workload(tp_engine, check_every_step=True)
    assert_same(tp_engine, uncached, out_cached, out_uncached)
    assert sum(o.num_cached_tokens for o in out_cached.values()) > 0


def logprob_run(engine: LLMEngine, request_id: str, prompt: list[int]) -> list:
    """The greedy completion's per-token logprobs (the chosen token's and the top 5)."""
    engine.add_request(request_id, prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5))
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                return output.outputs[0].logprobs
    raise AssertionError("the request did not finish")


def test_two_ranks_give_one_ranks_logprobs(model_dir, tp_engine):
    """Logprobs come from the whole vocabulary's logits: with an odd vocabulary the padding columns of the last
    rank's lm_head shard must be gone before the log-softmax (a padding column would add to its sum)."""
    prompt = [random.Random(11).randrange(256) for _ in range(160)]
    want = logprob_run(make_engine(model_dir), "lp", prompt)
    got = logprob_run(tp_engine, "lp", prompt)
    assert len(got) == len(want) == 8
    vocab = tp_engine.model_config.vocab_size
    for ours, ref in zip(got, want, strict=True):  # vLLM's entries: the sampled token first, then the top 5
        assert list(ours) == list(ref) and all(t < vocab for t in ours)
        assert max(abs(ours[t].logprob - ref[t].logprob) for t in ours) <= LOGPROB_TOL


def recording_feeds(engine: LLMEngine) -> list:
    """Record every `TokenFeed` the engine hands its executor (undone by `del engine.runner.execute`)."""
    feeds = []
    execute = engine.runner.execute

    def recording(batch, feed=None):
        feeds.append(feed)
        return execute(batch, feed)

    engine.runner.execute = recording
    return feeds


def run_batch(engine: LLMEngine, overlap: bool) -> dict[str, list[int]]:
    """Three greedy requests of different lengths, decoding together, with async scheduling `overlap`."""
    engine.clear_cache()
    engine.async_scheduling = overlap
    rng = random.Random(5)
    for i, (length, new) in enumerate(((150, 10), (40, 14), (90, 6))):
        engine.add_request(f"batch{i}", [rng.randrange(256) for _ in range(length)],
                           SamplingParams(temperature=0, max_tokens=new, ignore_eos=True))
    done = {}
    try:
        while engine.has_unfinished_requests():
            done.update((o.request_id, o.outputs[0].token_ids) for o in engine.step() if o.finished)
    finally:
        engine.async_scheduling = False
    return done


def test_async_scheduling_on_two_ranks_gives_the_synchronous_tokens(tp_engine):
    """Async scheduling under tensor parallelism: each decode row's input token is the one the step before sampled,
    which only rank 0 holds; it reaches the worker as a broadcast inside the step (a worker that read the
    placeholder `PENDING_TOKEN` would fail its embedding lookup, and one that read another token would diverge)."""
    assert EngineConfig(async_scheduling=True, tensor_parallel_size=2).async_scheduling
    want = run_batch(tp_engine, overlap=False)
    feeds = recording_feeds(tp_engine)
    try:
        got = run_batch(tp_engine, overlap=True)
    finally:
        del tp_engine.runner.execute
    assert got == want and [len(want[f"batch{i}"]) for i in range(3)] == [10, 14, 6]
    assert sum(f is not None for f in feeds) >= 10  # the decode rows were fed on the device


def test_async_cache_workload_on_two_ranks_matches_an_uncached_single_rank(model_dir, tp_engine):
    """The cache workload, async on two ranks, gives the tokens and logits of synchronous steps on one rank without
    the cache (as synchronous steps on two ranks do: `test_cache_workload_on_two_ranks_matches_an_uncached_single_
    rank`), the cache consistent after every step."""
    engine = tp_engine
    feeds = recording_feeds(engine)
    engine.clear_cache()
    engine.logits.clear()
    engine.async_scheduling = True
    try:
        out = run_workload(engine, check_every_step=True)
    finally:
        engine.async_scheduling = False
        del engine.runner.execute
    uncached = make_engine(model_dir, caching=False)
    assert_same(engine, uncached, out, run_workload(uncached))
    assert sum(f is not None for f in feeds) > 10


def test_a_model_that_does_not_split_fails_before_any_worker_starts(model_dir):
    with pytest.raises(ValueError, match="tensor_parallel_size 3 does not divide"):
        LLMEngine(model_dir, EngineConfig(tensor_parallel_size=3))


@pytest.mark.skipif(torch.cuda.device_count() >= 3, reason="needs fewer than 3 GPUs")
def test_more_ranks_than_gpus_fails_before_any_worker_starts(model_dir):
    with pytest.raises(ValueError, match=r"tensor_parallel_size 2 from cuda:1 needs devices up to cuda:2"):
        LLMEngine(model_dir, EngineConfig(tensor_parallel_size=2, device="cuda:1"))


def test_decode_modes_switch_every_rank_and_change_nothing_without_graphs(tp_engine):
    """The CPU captures no graphs: `eager()` and `without_replay()` reach every rank (a worker that failed to
    switch would raise) and the tokens stay those of the default mode."""
    prompt = list(range(40, 80))
    want = generate(tp_engine, "mode-default", prompt, 6)
    with tp_engine.runner.eager():
        assert generate(tp_engine, "mode-eager", prompt, 6) == want
    with tp_engine.runner.without_replay():
        assert generate(tp_engine, "mode-without-replay", prompt, 6) == want
    assert generate(tp_engine, "mode-back", prompt, 6) == want


def test_a_killed_worker_makes_the_engine_raise_naming_its_rank(tp_engine):
    """(The module's last test of each model: it breaks the engine.)"""
    engine = tp_engine
    (pid,) = engine.runner.worker_pids
    try:
        for i in range(4):
            engine.add_request(f"kill{i}", list(range(1, 30 + i)), SamplingParams(max_tokens=2000, ignore_eos=True))
        for _ in range(3):
            engine.step()
        killed_at = []

        def kill() -> None:
            killed_at.append(time.monotonic())
            os.kill(pid, signal.SIGKILL)

        threading.Timer(0.2, kill).start()  # while the engine is stepping
        deadline = time.monotonic() + 60
        with pytest.raises(WorkerError, match=r"worker rank 1 \(pid \d+\) died \(killed by signal 9\)"):
            while time.monotonic() < deadline:
                engine.step()
        assert time.monotonic() - killed_at[0] < 10
        with pytest.raises(EngineDeadError, match="failed earlier"):  # broken for good, not hanging
            engine.step()
    finally:
        engine.runner.shutdown()
    assert not alive(pid)
