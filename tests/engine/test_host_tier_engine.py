"""The host tier in the engine (`--host-cache-gib`): with a device pool small enough that most hits come from the
host, cached runs still equal uncached ones, on the cache-equivalence workload and on random traffic."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridcache.sampling import SamplingParams
from hybridcache.server.engine_state import read_engine_state

from .model_folders import write_tiny_model
from .test_cache_equivalence import assert_same, make_engine, run_workload, tokens

HOST_GIB = 1 / 64  # far more host blocks than the tiny models' workloads fill


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("qwen3_next"), "qwen3_next")


def host_engine(model_dir, **options):
    # 30 blocks of 16 tokens (a state takes 3), as the pressure test: the device keeps little between turns
    return make_engine(model_dir, num_blocks=30, max_model_len=300, max_num_seqs=6, max_num_batched_tokens=256,
                       host_cache_gib=HOST_GIB, **options)


def test_most_hits_come_from_the_host_and_cached_equals_uncached(model_dir):
    uncached = make_engine(model_dir, caching=False)
    cached = host_engine(model_dir)
    out_uncached = run_workload(uncached, seed=1, reply_lens=(20, 40))
    out_cached = run_workload(cached, seed=1, check_every_step=True, reply_lens=(20, 40))
    assert_same(cached, uncached, out_cached, out_uncached)
    stats = cached.stats()["cache"]
    assert stats.num_hits > 0 and stats.num_host_hits > stats.num_hits / 2, stats
    assert stats.num_promoted_checkpoints == stats.num_host_hits and stats.num_demoted_blocks > 0
    state = read_engine_state(cached)
    assert (state.num_host_hits, state.num_promotions, state.num_demoted_blocks) == (
        stats.num_host_hits, stats.num_promoted_checkpoints, stats.num_demoted_blocks)
    assert state.num_host_blocks > 0 and state.block_bytes > 0
    cached.clear_cache()
    cached.check_integrity()
    assert cached.stats()["cache"].num_host_checkpoints == 0


@pytest.fixture(scope="module")
def host_pair(model_dir):
    """An engine with a host tier behind a tiny pool, and an uncached one (reused across hypothesis examples)."""
    options = dict(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=200)
    return (make_engine(model_dir, num_blocks=14, host_cache_gib=HOST_GIB, **options),
            make_engine(model_dir, caching=False, **options))


def _requests(max_tokens: int, max_size: int):
    return st.lists(st.tuples(st.integers(0, 2), st.integers(1, 60), st.integers(1, max_tokens), st.integers(1, 2)),
                    min_size=1, max_size=max_size)


@settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck))
@given(requests=_requests(12, 5), seed=st.integers(0, 1000))
def test_host_tier_matches_uncached_on_random_traffic(host_pair, requests, seed):
    """Random mixes of shared-prefix prompts, lengths and n under a 14-block pool with a host tier: every request
    gets the tokens an uncached engine gives, and the cache stays intact after every step. The host engine is
    reused across examples, so later ones hit what earlier ones demoted."""
    check_traffic(host_pair, requests, seed)


@pytest.mark.slow
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(requests=_requests(24, 7), seed=st.integers(0, 1000))
def test_host_tier_matches_uncached_on_more_random_traffic(host_pair, requests, seed):
    """The same with more and longer examples (minutes on the CPU)."""
    check_traffic(host_pair, requests, seed)


def check_traffic(host_pair, requests, seed) -> None:
    rng = random.Random(seed)
    stems = [tokens(rng, 40) for _ in range(3)]
    results = []
    for engine in host_pair:
        for i, (stem, extra, max_tokens, n) in enumerate(requests):
            params = SamplingParams(temperature=0, max_tokens=max_tokens, n=n, ignore_eos=True)
            engine.add_request(f"{seed}-{i}", stems[stem] + tokens(random.Random(seed + i), extra), params)
        finished = {}
        while engine.has_unfinished_requests():
            finished.update((o.request_id, o) for o in engine.step() if o.finished)
            engine.check_integrity()
        results.append({rid: [c.token_ids for c in o.outputs] for rid, o in finished.items()})
    assert results[0] == results[1]
