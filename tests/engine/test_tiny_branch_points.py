"""Tiny hits cost a whole state: a branch point (where a prompt diverges from cached content) is saved only when
its prefix is worth the state its checkpoint occupies, i.e. at a step of at least `CostModel.state_tokens` of
the engine's real cost model (the tokens whose KV takes a state's bytes: k pages x B when states are paged)."""

from __future__ import annotations

import random

import pytest

from hybridcache.cache import CacheConfig, CostModel, PrefixCache
from hybridcache.config import EngineConfig
from hybridcache.engine.engine import LLMEngine
from hybridcache.sampling import SamplingParams

from .model_folders import write_tiny_model

BLOCK = 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("qwen3_next"), "qwen3_next")


def run(engine: LLMEngine, request_id: str, prompt: list[int]) -> int:
    """Run one request to its end; its cached tokens."""
    engine.add_request(request_id, prompt, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                cached = output.outputs[0].num_cached_tokens
    return cached


def test_the_engine_sets_the_shortest_branch_point_from_its_state_bytes(model_dir):
    engine = LLMEngine(model_dir, EngineConfig(block_size=BLOCK, kernel_block_size=8))
    cache = engine.scheduler.cache
    state_tokens = cache.cost_model.state_tokens
    assert state_tokens == cache.config.state_pages * BLOCK  # a state holds k pages: k x B tokens of KV
    assert cache.config.min_branch_point_step == state_tokens
    assert not cache.saves_branch_point(state_tokens - 1) and cache.saves_branch_point(state_tokens)


@pytest.mark.parametrize("extra", [-1, 0])
def test_a_branch_point_shorter_than_a_state_is_saved_only_once_two_prompts_left_there(model_dir, extra):
    """The value rule (`PrefixCache.saves_branch_point`: step x the cached continuations leaving the prompt there
    >= a state's tokens): one token short of a state's worth, r1 (one continuation, r0's) saves nothing, and r2
    (two: r0's and r1's) saves it, so r3 hits; exactly a state's worth, r1 saves it and r2 and r3 hit."""
    engine = LLMEngine(model_dir, EngineConfig(block_size=BLOCK, kernel_block_size=8))
    cache = engine.scheduler.cache
    shared = cache.config.min_branch_point_step + extra
    rng = random.Random(7)
    system = [rng.randrange(256) for _ in range(shared)]
    hits = [run(engine, f"r{i}", system + [200 + i] + [rng.randrange(256) for _ in range(20)]) for i in range(4)]
    stats = cache.stats
    assert hits == ([0, 0, 0, shared] if extra < 0 else [0, 0, shared, shared])
    assert stats.saves_by_reason["branch_point"] == 1
    assert stats.hits_by_reason["branch_point"] == (1 if extra < 0 else 2)
    engine.check_integrity()


def test_cost_model_state_tokens_and_the_cache_default():
    assert CostModel(kv_bytes_per_token=512.0, state_bytes=24576.0).state_tokens == 48
    assert CostModel(kv_bytes_per_token=512.0, state_bytes=24577.0).state_tokens == 49  # rounded up
    assert CostModel(kv_bytes_per_token=0.0, state_bytes=64.0).state_tokens == 0  # no KV: nothing to compare
    cache = PrefixCache(CacheConfig(block_size=4, num_blocks=16, num_slots=4))
    assert cache.saves_branch_point(1)  # a cache built without a threshold saves a branch point anywhere
    with pytest.raises(ValueError, match="min_branch_point_step"):
        CacheConfig(min_branch_point_step=-1)
