"""The host tier under tensor parallelism (gloo, 2 CPU ranks): each rank keeps its shard of every host block, and
every rank runs the host copies of each step's plan. With a device pool small enough that most hits come from
the host, the cache-equivalence workload on two ranks gives the tokens and logits of an uncached single rank and
the tokens of one rank with the same host tier (the same cache decisions: the host tier has as many blocks on two
ranks as on one), the cache intact after every step; `/metrics` counts the tier once."""

from __future__ import annotations

import pytest

from hybridcache.server.engine_state import read_engine_state
from tests.engine.test_cache_equivalence import assert_same, make_engine, run_workload

from .folders import write_folder

HOST_GIB = 1 / 64
# 30 blocks of 16 tokens (a state takes 3), as tests/engine/test_host_tier_engine.py: the device keeps little
OPTIONS = dict(num_blocks=30, max_model_len=300, max_num_seqs=6, max_num_batched_tokens=256)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_folder(tmp_path_factory.mktemp("qwen3_next"), "qwen3_next")


def test_host_tier_on_two_ranks_matches_one_rank_and_uncached(model_dir):
    uncached = make_engine(model_dir, caching=False)
    single = make_engine(model_dir, host_cache_gib=HOST_GIB, **OPTIONS)
    tp = make_engine(model_dir, host_cache_gib=HOST_GIB, tensor_parallel_size=2, **OPTIONS)
    try:
        assert tp.num_host_blocks == single.num_host_blocks > 0
        out_uncached = run_workload(uncached, seed=1, reply_lens=(20, 40))
        out_single = run_workload(single, seed=1, check_every_step=True, reply_lens=(20, 40))
        out_tp = run_workload(tp, seed=1, check_every_step=True, reply_lens=(20, 40))
        assert_same(tp, uncached, out_tp, out_uncached)
        for request_id, output in out_single.items():
            assert [c.token_ids for c in out_tp[request_id].outputs] == [c.token_ids for c in output.outputs]
            assert out_tp[request_id].num_cached_tokens == output.num_cached_tokens, request_id
        stats = tp.stats()["cache"]
        assert stats.num_hits > 0 and stats.num_host_hits > stats.num_hits / 2, stats
        assert stats.num_demoted_blocks > 0 and stats.num_promoted_checkpoints == stats.num_host_hits
        assert stats == single.stats()["cache"]  # the same decisions, counted once (the cache runs once)
        state, single_state = read_engine_state(tp), read_engine_state(single)
        assert (state.num_host_blocks, state.num_host_hits, state.num_promotions) == (
            single_state.num_host_blocks, single_state.num_host_hits, single_state.num_promotions)
        # bytes are those of all ranks: each holds half of every block here (heads split evenly)
        assert state.block_bytes == single_state.block_bytes == 2 * tp.memory_plan.block_bytes
        tp.clear_cache()
        tp.check_integrity()
        assert tp.stats()["cache"].num_host_checkpoints == 0
    finally:
        tp.runner.shutdown()


def test_host_memory_is_checked_for_every_rank_together(model_dir, monkeypatch):
    """The ranks share one host: their CPU pools and host tiers together are checked against its memory (each
    rank checked only its own share, so two ranks could take twice what the check allowed). Given 3/4 of what the
    two ranks need (more than one rank's share), start-up is refused before any pool is allocated."""
    from hybridcache.engine import rank_runner

    needs = []
    check = rank_runner.check_host_memory
    monkeypatch.setattr(rank_runner, "check_host_memory",
                        lambda pool, host, config, available: needs.append(pool + host) or check(pool, host, config,
                                                                                                    available))
    tp = make_engine(model_dir, host_cache_gib=HOST_GIB, tensor_parallel_size=2, **OPTIONS)
    plan = tp.memory_plan
    tp.close()
    assert needs == [2 * (plan.budget_bytes + tp.num_host_blocks * plan.block_bytes)]
    monkeypatch.setattr(rank_runner, "available_host_bytes", lambda: needs[0] * 3 // 4)  # the driver's rank 0
    with pytest.raises(ValueError, match="bytes of memory are available"):
        make_engine(model_dir, host_cache_gib=HOST_GIB, tensor_parallel_size=2, **OPTIONS)
