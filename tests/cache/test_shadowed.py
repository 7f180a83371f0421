"""Shadowed checkpoints: a turn end that a continuation was restored from, once the continuation publishes a
deeper checkpoint of the same chain, is the first to go under pressure (every kind of pressure), and a hit
clears the mark."""

from __future__ import annotations

from hybridcache.cache import CacheConfig, CacheRequest, PrefixCache
from hybridcache.cache.checkpoint import CheckpointState
from tests.cache.checked_evictor import check_picks
from tests.cache.conftest import make_driver, tokens
from tests.cache.fake_engine import Driver

PROMPT = tokens(40, seed=1)
REPLY = (5, 6)


def _chat(driver: Driver, first: str = "t1", second: str = "t2"):
    """Turn 1 (prefill end P1 at 40, finish F1 at 42), then turn 2 = turn 1's tokens + 20 (restored from F1;
    prefill end P2 at 62, finish F2 at 63). Returns (P1, F1, P2, F2)."""
    cache = driver.cache
    driver.run(CacheRequest(first, PROMPT), decode=REPLY)
    p1, f1 = sorted((c for c in cache._life.published() if c.owner == first), key=lambda c: c.step)
    nxt = CacheRequest(second, PROMPT + REPLY + tokens(20, seed=2))
    assert driver.admit(nxt).cached_len == 42
    assert not f1.shadowed  # restored from, not gone past yet
    driver.step(second, nxt.prompt_ids[42:], [("prefill_end",)])
    driver.step(second, [7])
    cache.finish(second)
    cache.check_integrity()
    by_step = {c.step: c for c in cache._life.published() if c.owner == second}
    return p1, f1, by_step[62], by_step[63]


def test_the_turn_end_a_continuation_went_past_is_shadowed_and_a_hit_clears_it():
    driver = make_driver()
    p1, f1, p2, f2 = _chat(driver)
    assert [c.shadowed for c in (p1, f1, p2, f2)] == [False, True, False, False]
    # an edited second message leaves the chain at 42: F1 serves it, and is not shadowed any more
    edited = CacheRequest("edit", PROMPT + REPLY + tokens(9, seed=3))
    match = driver.cache.match(edited)
    assert match.checkpoint_id == f1.ckpt_id
    driver.cache.admit(match)
    assert not f1.shadowed
    driver.cache.check_integrity()


def test_state_pressure_takes_the_shadowed_checkpoint_before_the_least_recently_used():
    driver = make_driver(num_slots=4)  # P1, F1, P2, F2 fill it
    cache = driver.cache
    p1, f1, p2, f2 = _chat(driver)
    driver.admit(CacheRequest("other", tokens(20, seed=4)))  # its runtime slot: one checkpoint must go
    assert cache.stats.evictions_by_kind == {"shadowed": 1}
    assert f1.state is CheckpointState.RELEASED and p1.state is CheckpointState.PUBLISHED  # P1 is older
    cache.check_integrity()


def test_kv_pressure_takes_a_shadowed_frozen_tail_before_the_leaf():
    driver = make_driver(num_blocks=7)  # 3 trie nodes and the frozen blocks of P1, F1, P2, F2 fill it
    cache = driver.cache
    p1, f1, p2, f2 = _chat(driver)
    assert cache._life.blocks.num_free == 0 and all(c.frozen_block is not None for c in (p1, f1, p2, f2))
    driver.admit(CacheRequest("other", tokens(8, seed=4)))
    assert cache.ensure_capacity("other", 8)
    assert cache.stats.evictions_by_kind == {"shadowed": 1}  # not the only leaf (with P2 and F2 on it)
    assert f1.state is CheckpointState.RELEASED and p2.state is f2.state is CheckpointState.PUBLISHED
    cache.check_integrity()


def test_one_budget_takes_the_shadowed_checkpoint_before_any_leaf():
    # paged (a checkpoint state in 4 blocks, KV and states in one pool): an older unrelated chain, then the two
    # turns, filling the pool exactly; a new request's first block then needs an eviction
    def cache_of(num_blocks):
        return check_picks(PrefixCache(CacheConfig(block_size=16, num_blocks=num_blocks, num_slots=4,
                                                   state_pages=4)))
    probe = Driver(cache_of(256))
    probe.run(CacheRequest("old", tokens(40, seed=5)), decode=REPLY)
    _chat(probe)
    driver = Driver(cache_of(probe.cache.stats.num_blocks_used))
    driver.run(CacheRequest("old", tokens(40, seed=5)), decode=REPLY)
    (old,) = [c for c in driver.cache._life.published() if c.step == 42]
    p1, f1, p2, f2 = _chat(driver)
    driver.admit(CacheRequest("other", tokens(8, seed=6)))  # a runtime slot is free; its first block is not
    assert driver.cache.ensure_capacity("other", 8)
    assert driver.cache.stats.evictions_by_kind == {"shadowed": 1}  # not the oldest leaf (the old chain's)
    assert f1.state is CheckpointState.RELEASED and old.state is CheckpointState.PUBLISHED
    driver.cache.check_integrity()


def test_shadowed_checkpoints_go_least_recently_used_first_whatever_order_they_were_shadowed_in():
    """Two chats restored in the order t, u but going deeper in the order u, t: F1 of t was used longer ago, so it
    is the shadowed victim, although u's F1 was shadowed first (the shadowed index is kept by recency, not by
    when a checkpoint joined it)."""
    driver = make_driver()
    cache = driver.cache
    other = tokens(40, seed=9)
    driver.run(CacheRequest("t1", PROMPT), decode=REPLY)
    driver.run(CacheRequest("u1", other), decode=REPLY)
    f1_t, f1_u = (next(c for c in cache._life.published() if c.owner == owner and c.step == 42)
                  for owner in ("t1", "u1"))
    t2 = CacheRequest("t2", PROMPT + REPLY + tokens(20, seed=2))
    u2 = CacheRequest("u2", other + REPLY + tokens(20, seed=3))
    assert driver.admit(t2).cached_len == 42  # F1 of t is used first ...
    assert driver.admit(u2).cached_len == 42  # ... then F1 of u
    driver.step("u2", u2.prompt_ids[42:], [("prefill_end",)])  # u goes deeper first: its F1 is shadowed first
    driver.step("t2", t2.prompt_ids[42:], [("prefill_end",)])
    assert f1_t.shadowed and f1_u.shadowed and f1_t.last_access < f1_u.last_access
    assert cache._life.evictor.shadowed_victim() is f1_t  # the checked evictor also compares with a full scan
    cache.check_integrity()
