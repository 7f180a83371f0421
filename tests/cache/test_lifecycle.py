"""Saving, pins, eviction, rollback, dedupe, finish/preempt/abort, integrity, multi-turn chains."""

from __future__ import annotations

import pytest

from hybridcache.cache import CacheConfig, CacheRequest, CostModel, IntegrityError, PrefixCache
from hybridcache.cache.checkpoint import CheckpointState
from hybridcache.cache.policy import FlopAwarePolicy, LruPolicy
from tests.cache.checked_evictor import check_picks
from tests.cache.conftest import make_driver, tokens
from tests.cache.fake_engine import fingerprint


def test_reserved_checkpoint_is_invisible_until_published():
    driver = make_driver()
    cache = driver.cache
    prompt = tokens(40, seed=1)
    driver.admit(CacheRequest("a", prompt))
    assert cache.ensure_capacity("a", 25)
    assert cache.reserve_save("a", 25, "chunk_end")
    early = cache.match(CacheRequest("b", prompt))
    assert early.cached_len == 0
    cache.release_match(early)
    driver.device.run_step({"a": prompt[:25]})
    assert cache.match(CacheRequest("c", prompt)).cached_len == 25


def test_detached_checkpoint_is_dropped_with_its_leaf():
    driver = make_driver(num_blocks=6, num_slots=8)
    cache = driver.cache
    prompt = tokens(40, seed=2)
    driver.run(CacheRequest("a", prompt, ))  # prefill_end at 40 and finish at 40 (duplicate)
    anchor_ckpts = cache._life.published()
    assert [c.step for c in anchor_ckpts] == [40]
    ckpt = anchor_ckpts[0]
    other = CacheRequest("b", tokens(90, seed=3))
    driver.admit(other)
    assert cache.ensure_capacity("b", 90)  # needs every block: evicts the leaf with its checkpoint, then the rest
    assert ckpt.state is CheckpointState.RELEASED and not ckpt.is_usable
    assert cache.match(CacheRequest("c", prompt + (1,))).cached_len == 0
    kinds = cache.stats.evictions_by_kind
    assert kinds == {"leaf": 1, "leaf_checkpoint": 1, "dead_block": 1}
    cache.check_integrity()


def test_pinned_checkpoint_survives_every_eviction_path():
    driver = make_driver(num_blocks=6, num_slots=3)
    cache = driver.cache
    prompt = tokens(40, seed=4)
    driver.run(CacheRequest("a", prompt))
    match = cache.match(CacheRequest("b", prompt + (7, 7)))
    assert match.cached_len == 40
    pinned = cache._life.checkpoints[match.checkpoint_id]
    # KV pressure: a sequence wanting every block cannot take the pinned checkpoint's blocks
    driver.admit(CacheRequest("big", tokens(90, seed=5)))
    before = fingerprint(cache)
    assert not cache.ensure_capacity("big", 90)
    assert fingerprint(cache) == before
    assert cache.ensure_capacity("big", 48)  # the free blocks are enough
    # state pressure: slots are all taken by 'big' and the pinned checkpoint (num_slots=3)
    assert cache.reserve_save("big", 48, "chunk_end")
    assert not cache.admit(cache.match(CacheRequest("c", tokens(5, seed=6)))) and True
    cache.clear()
    assert pinned.is_usable and pinned.num_pins == 1
    cache.check_integrity()
    cache.abort("big")
    admitted = cache.admit(match)
    assert admitted is not None and admitted.num_computed == 40
    driver.step("b", [7, 7])


def test_failed_admission_and_released_match_roll_back_exactly():
    driver = make_driver(num_blocks=4, num_slots=2)
    cache = driver.cache
    prompt = tokens(30, seed=7)
    driver.run(CacheRequest("a", prompt))  # finish checkpoint at 30 (partial) holds a slot
    driver.admit(CacheRequest("hog", tokens(3, seed=8)))  # the second slot
    before_match = fingerprint(cache)
    match = cache.match(CacheRequest("b", prompt + (1,)))
    assert match.cached_len == 30
    after_match = fingerprint(cache)
    assert cache.admit(match) is None  # no slot: the only other one holds the pinned checkpoint
    assert fingerprint(cache) == after_match
    cache.release_match(match)
    assert fingerprint(cache) == before_match
    with pytest.raises(ValueError):
        cache.release_match(match)
    cache.check_integrity()


def test_dedupe_shares_the_canonical_block_after_the_forward():
    driver = make_driver()
    cache = driver.cache
    prompt = tokens(40, seed=9)
    for rid in ("a", "b"):
        driver.admit(CacheRequest(rid, prompt))
        assert cache.ensure_capacity(rid, 40)
    before = {rid: cache.block_ids(rid) for rid in ("a", "b")}
    used = cache.stats.num_blocks_used
    driver.device.run_step({"a": prompt, "b": prompt})
    after = {rid: cache.block_ids(rid) for rid in ("a", "b")}
    assert after["a"][:2] == after["b"][:2] == before["a"][:2]
    assert after["b"][2] == before["b"][2]  # the partial block stays private
    assert cache.stats.num_deduplicated_blocks == 2
    assert cache.stats.num_blocks_used == used - 2
    driver.device.check()
    for token in range(30):  # both keep decoding into their own partial blocks
        driver.device.run_step({"a": [token], "b": [token + 1]}) if all(
            cache.ensure_capacity(r, cache.num_computed(r) + 1) for r in ("a", "b")
        ) else pytest.fail("no room")
        driver.device.check()
    cache.check_integrity()


def test_frozen_tail_is_released_with_its_checkpoint():
    driver = make_driver()
    cache = driver.cache
    driver.run(CacheRequest("a", tokens(37, seed=10)))
    (ckpt,) = cache._life.published()
    frozen = ckpt.frozen_block
    assert frozen is not None and cache._life.blocks.ref_counts[frozen] == 1
    cache._life.release(ckpt, None)
    assert cache._life.blocks.ref_counts[frozen] == 0 and frozen in cache._life.blocks.free_ids()
    cache.check_integrity()


def test_eviction_order_dead_blocks_then_leaves_with_their_checkpoints():
    driver = make_driver(num_blocks=12)
    cache = driver.cache
    driver.run(CacheRequest("live", tokens(40, seed=11)))  # 2 nodes + frozen tail
    dead = CacheRequest("dead", tokens(32, seed=12))
    driver.admit(dead)
    driver.step("dead", dead.prompt_ids)
    cache.abort("dead")  # its 2 blocks stay in the trie with no checkpoint: dead weight
    assert cache.stats.num_nodes == 4
    free = cache._life.blocks.num_free
    driver.admit(CacheRequest("x", tokens(16 * (free + 2), seed=13)))
    assert cache.ensure_capacity("x", 16 * (free + 2))
    assert cache.stats.evictions_by_kind == {"dead_block": 2}
    assert cache.ensure_capacity("x", 16 * (free + 3))  # the leaf goes with its checkpoint and frozen tail
    assert cache.stats.evictions_by_kind == {"dead_block": 2, "leaf": 1, "leaf_checkpoint": 1}
    assert cache.ensure_capacity("x", 16 * (free + 4))  # the frozen block freed one more
    assert cache.stats.evictions_by_kind == {"dead_block": 2, "leaf": 1, "leaf_checkpoint": 1}
    assert cache.ensure_capacity("x", 16 * (free + 5))
    assert cache.stats.evictions_by_kind == {"dead_block": 3, "leaf": 1, "leaf_checkpoint": 1}
    cache.check_integrity()


def test_a_frozen_tail_goes_only_when_no_leaf_can():
    driver = make_driver(num_blocks=8)
    cache = driver.cache
    prompt = tokens(40, seed=16)
    driver.run(CacheRequest("a", prompt))  # nodes 1-2, a checkpoint at 40 with a frozen tail (3 blocks)
    (early,) = cache._life.published()
    longer = CacheRequest("x", prompt + tokens(20, seed=17))
    assert driver.admit(longer).cached_len == 40
    # node 3 under node 2; no save at 60 (a deeper save of x would shadow `early`, which would then go first)
    driver.step("x", longer.prompt_ids[40:])
    assert cache._life.blocks.num_free == 3 and early.anchor.children and not early.shadowed
    assert cache.ensure_capacity("x", 112)  # the three free blocks
    assert cache.stats.evictions_by_kind == {}
    assert cache.ensure_capacity("x", 128)  # every leaf is held by x: the oldest frozen tail goes
    assert cache.stats.evictions_by_kind == {"frozen_tail": 1}
    assert early.state is CheckpointState.RELEASED
    cache.check_integrity()


def test_leaf_eviction_releases_block_aligned_checkpoints():
    driver = make_driver(num_blocks=3)
    cache = driver.cache
    driver.run(CacheRequest("a", tokens(32, seed=14)))  # aligned checkpoint on the second node
    driver.admit(CacheRequest("x", tokens(40, seed=15)))
    assert cache.ensure_capacity("x", 40)
    assert cache.stats.evictions_by_kind == {"leaf_checkpoint": 1, "leaf": 1, "dead_block": 1}
    assert cache.stats.num_checkpoints == 0
    cache.check_integrity()


def test_state_pressure_evicts_checkpoints_by_lru():
    driver = make_driver(num_slots=3)
    cache = driver.cache
    old, new = tokens(20, seed=16), tokens(20, seed=17)
    driver.run(CacheRequest("old", old))
    driver.run(CacheRequest("new", new))
    driver.admit(CacheRequest("r1", tokens(5, seed=18)))
    driver.admit(CacheRequest("r2", tokens(5, seed=19)))
    assert cache.stats.evictions_by_kind == {"checkpoint": 1}
    assert cache.match(CacheRequest("q1", new + (1,))).cached_len == 20
    assert cache.match(CacheRequest("q2", old + (1,))).cached_len == 0


def test_flop_aware_prefers_keeping_expensive_checkpoints():
    policy = FlopAwarePolicy(alpha=2.0, cost=CostModel(state_bytes=10.0), block_size=16)
    driver = make_driver()
    driver.run(CacheRequest("short", tokens(17, seed=20)))
    driver.run(CacheRequest("long", tokens(200, seed=21)))
    short, long = sorted(driver.cache._life.published(), key=lambda c: c.step)
    assert LruPolicy().pick_checkpoint([short, long]) is short
    long.last_access = 0  # older, but saves far more per byte
    assert LruPolicy().pick_checkpoint([short, long]) is long
    assert policy.pick_checkpoint([short, long]) is short


def test_flop_aware_cache_runs_clean():
    cache = PrefixCache(
        CacheConfig(block_size=8, num_blocks=20, num_slots=4, eviction="flop_aware", flop_aware_alpha=0.5),
        CostModel(flops_per_token=2.0, attn_flops_per_token_pair=0.1, kv_bytes_per_token=4, state_bytes=100),
    )
    from tests.cache.fake_engine import Driver

    check_picks(cache)
    driver = Driver(cache)
    for i in range(8):
        driver.run(CacheRequest(f"r{i}", tokens(20 + 3 * i, seed=22 + i % 3)))
    assert sum(cache.stats.evictions_by_kind.values()) > 0
    cache.clear()
    assert cache.stats.num_blocks_used == 0 and cache.stats.num_slots_used == 0


def _alternate(cap: int) -> list[int]:
    """Two prompts share 2 blocks and differ in their tails; each is resent (with a new last block) 3 times."""
    driver = make_driver(max_checkpoints_per_anchor=cap)
    cache = driver.cache
    shared = tokens(32, seed=30)
    p1, p2 = shared + tokens(7, seed=31), shared + tokens(9, seed=32)
    hits = []
    for round_ in range(3):
        for name, p in (("p1", p1), ("p2", p2)):
            rid = f"{name}-{round_}"
            match = driver.run(CacheRequest(rid, p + tokens(16, seed=100 + round_)), finish=False)
            cache.abort(rid)
            if round_ == 0:
                driver.run(CacheRequest(rid + "-finish", p))
            else:
                hits.append(match.cached_len)
    return hits


def test_two_tails_on_one_anchor_both_keep_hitting():
    assert _alternate(cap=2) == [39, 41] * 2
    assert _alternate(cap=1) == [0, 41] * 2  # one checkpoint per anchor (the seed) thrashes


def test_anchor_cap_evicts_by_policy():
    driver = make_driver(max_checkpoints_per_anchor=2)
    cache = driver.cache
    shared = tokens(32, seed=30)
    for i in range(3):
        driver.run(CacheRequest(i, shared + tokens(5 + i, seed=40 + i)))
    anchor = cache._life.published()[0].anchor
    assert anchor.num_checkpoints() == 2 and cache.stats.evictions_by_kind == {"anchor_cap": 1}
    assert sorted(c.step for c in anchor.iter_checkpoints()) == [38, 39]
    cache.check_integrity()


def test_multi_turn_chain_grows_after_partial_hits():
    driver = make_driver(block_size=16)
    cache = driver.cache
    history = tokens(37, seed=40)
    cached = []
    for turn in range(3):
        request = CacheRequest(f"turn{turn}", history)
        match = driver.run(request, decode=tokens(6, seed=41 + turn))
        cached.append(match.cached_len)
        history = history + tokens(6, seed=41 + turn) + tokens(21, seed=50 + turn)
    assert cached[0] == 0
    assert cached[1] == 43 and cached[2] == 43 + 21 + 6
    assert cache.stats.hits_by_reason == {"finish": 2}
    assert cache.stats.num_nodes == (70 + 21 + 6) // 16


def test_decode_interval_keeps_one_live_per_sequence():
    driver = make_driver(decode_checkpoint_interval=16)
    cache = driver.cache
    driver.admit(CacheRequest("a", tokens(10, seed=60)))
    driver.step("a", tokens(10, seed=60))
    for token in range(60):
        saves = [("decode_interval",)] if (cache.num_computed("a") + 1) % 16 == 0 else []
        driver.step("a", [token], saves)
    live = [c for c in cache._life.published() if c.reason.value == "decode_interval"]
    assert len(live) == 1 and live[0].step == 64
    assert cache.stats.saves_by_reason["decode_interval"] == 4
    assert cache.stats.evictions_by_kind["decode_replaced"] == 3


def test_repeat_branch_admission_declines_first_sighting():
    cache = PrefixCache(CacheConfig(block_size=16, num_blocks=64, num_slots=8, admission="repeat_branch"))
    from tests.cache.fake_engine import Driver

    check_picks(cache)
    driver = Driver(cache)
    prompt = tokens(40, seed=70)
    for rid in ("a", "b"):
        driver.admit(CacheRequest(rid, prompt))
        assert cache.ensure_capacity(rid, 20)
    assert not cache.reserve_save("a", 20, "branch_point")
    assert cache.reserve_save("b", 20, "branch_point")
    assert cache.reserve_save("a", 20, "chunk_end")
    assert cache.stats.declined_saves == {"policy": 1}


def test_preempt_keeps_a_checkpoint_and_abort_keeps_nothing():
    driver = make_driver()
    cache = driver.cache
    prompt = tokens(50, seed=80)
    driver.admit(CacheRequest("a", prompt))
    driver.step("a", prompt[:29])
    assert cache.preempt("a")
    assert cache.match(CacheRequest("a", prompt)).cached_len == 29
    driver.admit(CacheRequest("b", tokens(50, seed=81)))
    driver.step("b", tokens(50, seed=81)[:29])
    cache.abort("b")
    assert cache.match(CacheRequest("b", tokens(50, seed=81))).cached_len == 0


def test_abort_in_the_middle_of_planning_releases_everything():
    driver = make_driver()
    cache = driver.cache
    prompt = tokens(50, seed=90)
    driver.run(CacheRequest("a", prompt[:30]))
    driver.admit(CacheRequest("b", prompt))
    assert cache.ensure_capacity("b", 45)
    assert cache.reserve_save("b", 45, "chunk_end")
    cache.abort("b")
    copies = driver.device.run_step({})
    assert copies.is_empty
    cache.check_integrity()
    cache.clear()
    assert cache.stats.num_blocks_used == 0 and cache.stats.num_slots_used == 0


def test_clear_frees_everything_after_all_requests_finish():
    driver = make_driver(num_blocks=40, num_slots=6)
    for i in range(10):
        driver.run(CacheRequest(i, tokens(20 + 7 * i, seed=i % 4)), decode=[1, 2, 3], chunk=16, branch=True)
    stats = driver.cache.stats
    assert stats.num_blocks_used > 0 and stats.num_running == 0
    driver.cache.clear()
    stats = driver.cache.stats
    assert (stats.num_blocks_used, stats.num_slots_used, stats.num_nodes, stats.num_checkpoints) == (0, 0, 0, 0)
    driver.cache.check_integrity()


def test_check_integrity_reports_a_wrong_count():
    driver = make_driver()
    driver.run(CacheRequest("a", tokens(40, seed=99)))
    node = next(iter(driver.cache._life.trie.leaves))
    driver.cache._life.blocks.ref_counts[node.block_id] += 1
    with pytest.raises(IntegrityError, match=f"block {node.block_id} ref count 2 != 1 holders"):
        driver.cache.check_integrity()


def test_check_integrity_reports_a_wrong_pin():
    driver = make_driver()
    driver.run(CacheRequest("a", tokens(40, seed=98)))
    (ckpt,) = driver.cache._life.published()
    ckpt.num_pins = 1
    with pytest.raises(IntegrityError, match="has 1 pins, holders say 0"):
        driver.cache.check_integrity()


def test_stats_count_queries_hits_and_saves():
    driver = make_driver()
    prompt = tokens(40, seed=97)
    driver.run(CacheRequest("a", prompt))
    driver.run(CacheRequest("b", prompt + (1, 2)))
    stats = driver.cache.stats
    assert (stats.num_queries, stats.num_query_tokens, stats.num_hits, stats.num_hit_tokens) == (2, 82, 1, 40)
    assert stats.saves_by_reason == {"prefill_end": 2}
    assert stats.declined_saves == {"duplicate": 2}  # both finished where their prefill ended
    assert stats.hit_rate == pytest.approx(40 / 82)


def test_admit_with_a_first_chunk_takes_its_blocks_or_nothing():
    driver = make_driver(num_blocks=7, num_slots=4)
    cache = driver.cache
    prompt = tokens(40, seed=21)
    driver.run(CacheRequest("a", prompt))  # finish checkpoint at 40 = 2B + 8: 2 trie blocks + a frozen tail
    request = CacheRequest("b", prompt + tokens(60, seed=22))
    match = cache.match(request)
    assert match.cached_len == 40
    before = fingerprint(cache)
    assert cache.admit(match, num_tokens=200) is None  # 13 blocks: more than the pool holds
    assert fingerprint(cache) == before
    admitted = cache.admit(match, num_tokens=90)  # 6 blocks: 2 shared + restored tail + 3 new; 4 of 4 free
    assert admitted is not None and admitted.num_computed == 40
    assert len(admitted.block_ids) == 6 and admitted.block_ids[:2] == match.block_ids
    assert len(set(admitted.block_ids)) == 6
    cache.check_integrity()
