"""Prefix caching end to end: cached and uncached runs compute the same thing, and the cache hits where
checkpoints at block boundaries or at prompt ends alone would miss."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from hybridcache.config import EngineConfig
from hybridcache.engine.engine import LLMEngine
from hybridcache.models import ModelConfig
from hybridcache.sampling import SamplingParams
from hybridcache.server.engine_state import read_engine_state

from .markers import needs_cuda_engine
from .model_folders import write_tiny_model

REL_TOL = 1e-4
CUDA_FP32 = {"device": "cuda", "dtype": "float32", "num_blocks": 512, "gpu_memory_utilization": 0.5}


@pytest.fixture(scope="module", params=["qwen3_5_text", "qwen3_next"])
def model_dir(request, tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp(request.param), request.param)


def make_engine(model_dir, *, caching=True, block_size=16, kernel_block_size=8, **options) -> LLMEngine:
    """An engine on `model_dir` that records every sampled row's logits (`engine.logits`). With `num_blocks` and no
    `max_model_len` (the CUDA options), max_model_len is the model's length cut to what the pool holds (Kimi
    Linear's 1,048,576 would be refused by a pool of 512 blocks)."""
    if "num_blocks" in options and "max_model_len" not in options:
        limit = ModelConfig.from_model_dir(model_dir).max_model_len
        options["max_model_len"] = min(limit, options["num_blocks"] * block_size)
    config = EngineConfig(
        block_size=block_size, kernel_block_size=kernel_block_size, enable_prefix_caching=caching,
        **{"max_num_batched_tokens": 96, "max_num_seqs": 6, **options},
    )
    engine = LLMEngine(model_dir, config)
    engine.logits = {}
    original = engine._sample

    def recording_sample(logits, sampled):
        for row, seq in enumerate(sampled):
            engine.logits[(seq.request_id, seq.index, seq.num_tokens)] = logits[row].clone()
        return original(logits, sampled)

    engine._sample = recording_sample
    return engine


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(256) for _ in range(n)]


def run_workload(
    engine: LLMEngine, seed: int = 0, *, check_every_step: bool = False, reply_lens: tuple[int, int] = (3, 10),
    draw: Callable[[random.Random, int], list[int]] = tokens,
) -> dict:
    """A randomized multi-turn workload; returns {request_id: RequestOutput}.

    Four conversations over two shared system prompts (37 and 70 tokens) take 3 turns each with user
    messages and replies of random, non-aligned lengths, arriving at random steps; an identical resend of
    an earlier prompt; and an n=2 request. `draw(rng, n)`: n prompt token ids (default: uniform random bytes).
    """
    rng = random.Random(seed)  # everything random is drawn up front, so both runs see the same workload
    systems = [draw(rng, 37), draw(rng, 70)]
    conversations = []
    for i in range(4):
        conversations.append({
            "history": systems[i % 2] + draw(rng, rng.randrange(5, 40)),
            "turn": 0, "busy": None, "wait": rng.randrange(0, 6),
            "max_tokens": [rng.randrange(*reply_lens) for _ in range(3)],
            "users": [draw(rng, rng.randrange(3, 20)) for _ in range(3)],
            "gaps": [rng.randrange(0, 4) for _ in range(3)],
        })
    fanout_prompt = systems[1] + draw(rng, 11)
    extras = {"resend": (8, 1), "fanout": (12, 2)}  # name: (arrival step, n)
    results = {}
    first_prompt = list(conversations[0]["history"])
    step = 0
    while True:
        for i, conv in enumerate(conversations):
            if conv["busy"] is None and conv["turn"] < 3 and step >= conv["wait"]:
                request_id = f"conv{i}-turn{conv['turn']}"
                params = SamplingParams(temperature=0, max_tokens=conv["max_tokens"][conv["turn"]], ignore_eos=True)
                engine.add_request(request_id, list(conv["history"]), params)
                conv["busy"] = request_id
        for name, (at, n) in list(extras.items()):
            if step >= at:
                prompt = first_prompt if name == "resend" else fanout_prompt
                engine.add_request(name, prompt, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, n=n))
                del extras[name]
        if not engine.has_unfinished_requests() and all(c["turn"] == 3 for c in conversations) and not extras:
            break
        for output in engine.step():
            if output.finished:
                results[output.request_id] = output
                for conv in conversations:
                    if conv["busy"] == output.request_id:
                        turn = conv["turn"]
                        conv["history"] = conv["history"] + output.outputs[0].token_ids + conv["users"][turn]
                        conv["turn"] += 1
                        conv["busy"] = None
                        conv["wait"] = step + conv["gaps"][turn]
        if check_every_step:
            engine.check_integrity()
        step += 1
    engine.check_integrity()
    return results


def assert_same(cached: LLMEngine, uncached: LLMEngine, out_cached: dict, out_uncached: dict) -> None:
    assert out_cached.keys() == out_uncached.keys()
    for request_id in out_uncached:
        got = [c.token_ids for c in out_cached[request_id].outputs]
        want = [c.token_ids for c in out_uncached[request_id].outputs]
        assert got == want, request_id
    assert cached.logits.keys() == uncached.logits.keys()
    for key, want in uncached.logits.items():
        error = (cached.logits[key] - want).abs().max() / want.abs().max()
        assert error <= REL_TOL, (key, float(error))


@pytest.mark.parametrize("block_size, kernel_block_size", [(16, 8), (64, 64)])
def test_cached_run_equals_uncached_run(model_dir, block_size, kernel_block_size):
    uncached = make_engine(model_dir, caching=False, block_size=block_size, kernel_block_size=kernel_block_size)
    cached = make_engine(model_dir, block_size=block_size, kernel_block_size=kernel_block_size)
    out_uncached = run_workload(uncached)
    out_cached = run_workload(cached, check_every_step=True)
    assert_same(cached, uncached, out_cached, out_uncached)
    hit = sum(o.num_cached_tokens for o in out_cached.values())
    assert hit > 0 and sum(o.num_cached_tokens for o in out_uncached.values()) == 0
    assert cached.num_prefill_tokens < uncached.num_prefill_tokens
    stats = cached.stats()["cache"]
    assert cached.stats()["num_preemptions"] == 0
    assert stats.num_hit_tokens == sum(c.num_cached_tokens for o in out_cached.values() for c in o.outputs)
    assert stats.saves_by_reason["finish"] > 0 and stats.hits_by_reason["finish"] > 0


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda_engine)])
def test_pool_slots_never_written_never_reach_the_logits(model_dir, device):
    """Every KV slot starts as NaN in both engines: a recycled page's stale bytes (a freed checkpoint's fp32 state
    read as bf16 KV holds NaN and inf) past a sequence's context, or in a padding page of the batch's block
    table (CUDA: also the decode graphs' padding rows), must not reach the logits. The runs still equal a clean
    uncached run (on CUDA in fp32, as `test_cuda_fp32_cached_run_equals_uncached_run`)."""
    options = {} if device == "cpu" else CUDA_FP32
    clean = make_engine(model_dir, caching=False, **options)
    engines = [make_engine(model_dir, caching=caching, **options) for caching in (False, True)]
    for engine in engines:
        for kv in engine.runner.pools.kv_groups:
            kv.fill_(float("nan"))
    want = run_workload(clean)
    for engine in engines:
        assert_same(engine, clean, run_workload(engine, check_every_step=True), want)


@needs_cuda_engine
def test_cuda_fp32_cached_run_equals_uncached_run(model_dir):
    """The same workload on CUDA's kernels (fla's chunked rule, the Triton decode step and attention kernels, the
    decode graphs) in fp32, which the engine runs as IEEE fp32 (`TRITON_F32_DEFAULT=ieee`, and fla's triangular
    solve set to IEEE by `fla_chunk_forward`; docs/kernels.md): the cached run's greedy tokens equal the uncached
    run's and its logits are within `REL_TOL` of them, as on the CPU. Issue 32 asks that every new kernel keep
    this; `benchmarks/gpu_engine.py --dtypes float32` measures the same on a larger workload. With fla's tf32
    solve the logits parted by up to 5.2e-4 here (tokens still equal); with IEEE by 7e-6 (H200, session 51)."""
    check_cached_equals_uncached(model_dir, **CUDA_FP32)


def check_cached_equals_uncached(model_dir, **options) -> None:
    """The workload run with prefix caching (its integrity checked every step) gives the uncached run's tokens and
    logits, and hits."""
    uncached = make_engine(model_dir, caching=False, **options)
    cached = make_engine(model_dir, **options)
    out_uncached = run_workload(uncached)
    out_cached = run_workload(cached, check_every_step=True)
    assert_same(cached, uncached, out_cached, out_uncached)
    assert sum(o.num_cached_tokens for o in out_cached.values()) > 0


def test_pressure_evicts_and_preempts_and_still_matches(model_dir):
    # 26 blocks of 16 tokens (a checkpoint state takes 3) for up to 6 running sequences of up to ~250 tokens.
    uncached = make_engine(model_dir, caching=False)
    tight = make_engine(
        model_dir, num_blocks=26, max_model_len=300, max_num_seqs=6, max_num_batched_tokens=256
    )
    out_uncached = run_workload(uncached, seed=1, reply_lens=(20, 40))
    out_tight = run_workload(tight, seed=1, check_every_step=True, reply_lens=(20, 40))
    assert_same(tight, uncached, out_tight, out_uncached)
    stats = tight.stats()
    assert stats["num_preemptions"] > 0
    assert sum(stats["cache"].evictions_by_kind.values()) > 0
    # the server's snapshot (/metrics, /health) carries the cache's counters as they are
    state = read_engine_state(tight)
    cache = stats["cache"]
    assert (state.checkpoint_saves, state.checkpoint_hits, state.declined_saves, state.checkpoint_evictions) == (
        cache.saves_by_reason, cache.hits_by_reason, cache.declined_saves, cache.evictions_by_kind)
    # every request that reports cached tokens restored a checkpoint; the n = 2 request's completions and a
    # preempted sequence's re-admission restore one each
    assert sum(state.checkpoint_hits.values()) >= sum(o.num_cached_tokens > 0 for o in out_tight.values()) > 0
    tight.clear_cache()
    tight.check_integrity()
    assert tight.stats()["num_blocks_used"] == 0 and tight.stats()["num_slots_used"] == 0


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def finish_one(engine: LLMEngine, request_id: str, prompt: list[int], max_tokens: int):
    engine.add_request(request_id, prompt, greedy(max_tokens))
    while True:
        for output in engine.step():
            if output.request_id == request_id and output.finished:
                return output


def test_multi_turn_reuses_the_whole_previous_conversation(model_dir):
    engine = make_engine(model_dir)
    reference = make_engine(model_dir, caching=False)
    rng = random.Random(3)
    history = tokens(rng, 45)  # 45 = 2 * 16 + 13: turn 1 ends mid-block
    expected_hits = []
    for turn in range(3):
        out = finish_one(engine, f"t{turn}", history, 6)
        ref = finish_one(reference, f"t{turn}", history, 6)
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        expected_hits.append(out.num_cached_tokens)
        reply = out.outputs[0].token_ids
        # The finish checkpoint is at every fed token: the prompt and all replies but the last token.
        fed = len(history) + len(reply) - 1
        history = history + reply + tokens(rng, 9 + turn)
        if turn < 2:
            next_hit = fed
    assert expected_hits[0] == 0
    assert expected_hits[1] == 45 + 6 - 1
    assert expected_hits[2] == next_hit
    assert expected_hits[2] % 16 != 0


def test_shared_system_prompt_hits_the_third_request_at_the_divergence_step(model_dir):
    engine = make_engine(model_dir)
    rng = random.Random(4)
    system = tokens(rng, 53)
    suffixes = [[200 + i] + tokens(rng, 20) for i in range(3)]
    hits = [finish_one(engine, f"r{i}", system + suffix, 3).num_cached_tokens for i, suffix in enumerate(suffixes)]
    assert hits == [0, 0, 53]
    assert engine.stats()["cache"].hits_by_reason["branch_point"] == 1


def test_two_requests_restore_one_checkpoint_in_the_same_forward(model_dir):
    engine = make_engine(model_dir)
    reference = make_engine(model_dir, caching=False)
    rng = random.Random(5)
    prompt = tokens(rng, 40)
    first = finish_one(engine, "first", prompt, 4)
    finish_one(reference, "first", prompt, 4)
    base = prompt + first.outputs[0].token_ids
    followups = {"a": base + tokens(rng, 7), "b": base + tokens(rng, 12)}
    results = {}
    for e in (engine, reference):
        for name, p in followups.items():
            e.add_request(name, p, greedy(5))
        outs = {}
        while e.has_unfinished_requests():
            outs.update({o.request_id: o for o in e.step() if o.finished})
        results[e is engine] = outs
    for name in followups:
        assert results[True][name].num_cached_tokens == 40 + 4 - 1
        assert results[True][name].outputs[0].token_ids == results[False][name].outputs[0].token_ids
    for key, want in reference.logits.items():
        if key[0] in followups:
            assert (engine.logits[key] - want).abs().max() / want.abs().max() <= REL_TOL


def test_identical_resend_is_a_zero_prefill_hit_from_the_first_resend(model_dir):
    """The prefill-end checkpoint keeps the last position's hidden state: a resend computes only its sample
    (issue 12; before, the first resend hit 0 and saved a branch point at 49 for the second)."""
    engine = make_engine(model_dir)
    prompt = tokens(random.Random(6), 50)
    outs = [finish_one(engine, f"r{i}", prompt, 3) for i in range(3)]
    assert [o.num_cached_tokens for o in outs] == [0, 50, 50]
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1
