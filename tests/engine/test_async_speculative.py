"""Async (overlapped) speculative steps (`engine/spec_chain.py`): a uniform greedy verify step queued on the device
from the step before's device verdicts, before the host judges that step. On the CPU nothing overlaps, but every
piece of bookkeeping is the one CUDA runs (the drafting graphs' work on their static buffers, `cpu_drafting_graphs`),
so these tests check it against synchronous speculative steps and against MTP off: the same tokens, the cache's
integrity after every step, cached == uncached, and the finish checkpoints of sequences that stop inside a step."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridcache.config import EngineConfig
from hybridcache.engine.engine import LLMEngine
from hybridcache.sampling import SamplingParams

from .model_folders import write_tiny_model
from .spec_helpers import (
    alone_references,
    cpu_drafting_graphs,
    device_oracle,
    drive_traffic,
    random_requests,
    spec,
    tokens_of,
)
from .test_cache_equivalence import run_workload

CONFIG = {"block_size": 16, "kernel_block_size": 8, "max_num_batched_tokens": 96, "max_num_seqs": 6}


@pytest.fixture(scope="module", params=["qwen3_next", pytest.param("qwen3_5_text", marks=pytest.mark.slow)])
def model_dir(request, tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="module")
def small_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("small"), "qwen3_next")


def _engine(model_dir, k: int | None, *, chained: bool = False, **options) -> LLMEngine:
    config = {**CONFIG, **options}
    engine = LLMEngine(model_dir, EngineConfig(**config, speculative_config=spec(k) if k else None,
                                               async_scheduling=chained or None))
    if chained:
        cpu_drafting_graphs(engine)
    return engine


def _requests(count: int, *, stop_at: dict[int, int] | None = None) -> list[tuple[str, list[int], SamplingParams]]:
    """Greedy requests of prompts >= 150 tokens and different lengths (rows reach block ends and their ends at
    different steps). `stop_at[i]`: request i also stops at that token id."""
    out = []
    for i in range(count):
        prompt = [(13 * i + 7 * j + j * j) % 256 for j in range(150 + 11 * i)]
        stops = [stop_at[i]] if stop_at and i in stop_at else []
        out.append((f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=20 + 9 * i, ignore_eos=True,
                                                           stop_token_ids=stops)))
    return out


def _run(engine: LLMEngine, requests, *, check: bool = True) -> dict:
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    results = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                results[out.request_id] = [c.token_ids for c in out.outputs]
        if check:
            engine.check_integrity()
    return results


def test_async_speculative_steps_equal_sync_ones_and_mtp_off(model_dir):
    """Greedy tokens with async speculative steps equal synchronous speculative steps' and MTP off's; oracle
    drafts on the device accept 0..k per row, so every rollback position is taken by the device's selection; most
    steps chain; the cache intact after every step."""
    requests = _requests(4)
    off = _run(_engine(model_dir, None), requests)
    reference = {rid: tokens[0] for rid, tokens in off.items()}
    sync = _engine(model_dir, 2)
    cpu_drafting_graphs(sync)
    device_oracle(sync, reference, seed=1)
    assert _run(sync, requests) == off
    assert sync.num_chained_steps == 0
    engine = _engine(model_dir, 2, chained=True)
    device_oracle(engine, reference, seed=1)
    assert _run(engine, requests) == off
    stats = engine.drafter.stats
    print(f"chained {engine.num_chained_steps} of {stats.num_drafts} verify rows; accepted {stats}")
    assert engine.num_chained_steps > 10
    assert stats.accepted_per_position[-1] > 0 and stats.num_accepted_tokens < stats.num_draft_tokens
    assert stats == sync.drafter.stats  # the same verdicts, row by row
    engine.clear_cache()
    assert engine.stats()["cache"].num_blocks_used == 0


def test_sequences_that_stop_inside_a_chained_step_leave_exact_finish_checkpoints(model_dir):
    """Requests that stop at a stop token inside a verify step (a padding row in the chained step after it): their
    tokens equal MTP off's; then each prompt + output is resent with the cache on and continues as without any
    cache (its finish checkpoint is the exact state after its last token)."""
    plain = _run(_engine(model_dir, None), _requests(4))
    stop_at = {i: tokens[0][5 + 4 * i] for i, tokens in enumerate(plain[f"r{i}"] for i in range(4))}
    requests = _requests(4, stop_at=stop_at)
    off = _run(_engine(model_dir, None), requests)
    assert all(len(off[f"r{i}"][0]) < len(plain[f"r{i}"][0]) for i in range(4))
    engine = _engine(model_dir, 2, chained=True)
    device_oracle(engine, {rid: tokens[0] for rid, tokens in plain.items()}, seed=2, right=0.9)
    assert _run(engine, requests) == off
    assert engine.num_chained_steps > 0
    resent = [(f"again{rid}", [*prompt, *off[rid][0]], SamplingParams(temperature=0, max_tokens=12,
                                                                      ignore_eos=True))
              for rid, prompt, _ in requests]
    hits = engine.stats()["cache"].num_hits
    cached = _run(engine, resent)
    assert engine.stats()["cache"].num_hits > hits
    assert cached == _run(_engine(model_dir, None, enable_prefix_caching=False), resent)


def test_async_speculation_on_the_cache_equivalence_workload(model_dir):
    """The cache-equivalence workload (shared prompts, resends, turns; sampling and stop strings there step
    synchronously) with async speculative steps: greedy tokens equal MTP off without caching, integrity after
    every step."""
    off = tokens_of(run_workload(_engine(model_dir, None, enable_prefix_caching=False)))
    engine = _engine(model_dir, 2, chained=True)
    assert tokens_of(run_workload(engine, check_every_step=True)) == off
    assert engine.stats()["cache"].num_hits > 0
    print(f"chained steps: {engine.num_chained_steps}")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_async_speculative_steps_equal_sync_ones(tmp_path_factory):
    """bf16 with CUDA graphs (verify and drafting graphs): async speculative steps (chained, on by default on one
    GPU) give the greedy tokens and verdicts of synchronous ones, token for token (the same graphs on the same
    inputs), with oracle drafts on the device so rows accept 0..k; one request stops at a stop token inside a step
    (a padding row in the chained step after it). The synchronous engine's first run (its own drafts) gives the
    oracle's reference."""
    folder = write_tiny_model(tmp_path_factory.mktemp("next"), "qwen3_next")
    # a pool of CPU size: check_integrity after every step walks every block in Python (a pool sized from the
    # GPU's memory, 3.5 million blocks of this tiny model, took seconds a step: the test never ended on the H200)
    options = {"device": "cuda", "dtype": "bfloat16", "num_blocks": 4096}
    reference, runs, stats, chained_steps = {}, [], [], []
    for chained in (False, True):  # one engine at a time
        engine = LLMEngine(folder, EngineConfig(**CONFIG, **options, speculative_config=spec(2),
                                                async_scheduling=chained))
        if not chained:
            reference.update((rid, tokens[0]) for rid, tokens in _run(engine, _requests(4)).items())
            engine.clear_cache()
            engine.drafter.stats = type(engine.drafter.stats)(accepted_per_position=[0, 0])
        device_oracle(engine, reference, seed=4)
        runs.append(_run(engine, _requests(4, stop_at={1: reference["r1"][9]})))
        stats.append(engine.drafter.stats)
        chained_steps.append(engine.num_chained_steps)
        engine.close()
    print(f"bf16 CUDA: chained {chained_steps[1]} steps; sync {stats[0]}; async {stats[1]}")
    assert runs[0] == runs[1] and stats[0] == stats[1]
    assert len(runs[1]["r1"][0]) < len(reference["r1"])  # (it stopped)
    assert chained_steps[0] == 0 and chained_steps[1] > 10
    assert stats[1].accepted_per_position[-1] > 0


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_traffic_with_async_speculation_keeps_integrity_and_greedy_tokens(small_dir, data):
    """`test_speculative`'s random traffic (shared prefixes, resends, n > 1, stop strings and stop tokens, aborts,
    a pool small enough to preempt) with async speculative steps (device oracle drafts): check_integrity after
    every step; the greedy tokens of every request not aborted equal those of the request alone without MTP."""
    rng = random.Random(data.draw(st.integers(0, 10**6)))
    requests = random_requests(rng, data.draw(st.integers(3, 7)), stop_p=0.1, stop_token_p=0.3, max_tokens=40)
    reference = alone_references(lambda: _engine(small_dir, None, max_model_len=160), requests)  # without MTP
    engine = _engine(small_dir, 2, chained=True, max_model_len=160, max_num_seqs=4,
                     num_blocks=data.draw(st.sampled_from([16, 24, 64])))
    device_oracle(engine, reference, seed=rng.randrange(100), right=0.8)
    got, aborted = drive_traffic(engine, requests)
    for rid, *_ in requests:
        if rid not in aborted:
            assert got[rid] == reference[rid], rid
    print(f"chained steps: {engine.num_chained_steps}")
    engine.clear_cache()
    assert engine.stats()["cache"].num_blocks_used == 0
