"""`PENDING_TOKEN` (async scheduling): a decoding sequence feeds the previous step's sample before its value is
known; a block it fills joins the trie at `accept`, which gives its value, deduplicated like any other."""

from __future__ import annotations

import pytest

from hybridcache.cache import PENDING_TOKEN, CacheConfig, CacheRequest, PrefixCache, SaveReason
from tests.cache.conftest import tokens

B = 8


def running(prompt: tuple[int, ...], decoded: tuple[int, ...], *rids: str) -> PrefixCache:
    """A cache running each of `rids` over `prompt`, then `decoded` fed one token per step (no checkpoints)."""
    cache = PrefixCache(CacheConfig(block_size=B, num_blocks=64, num_slots=8, full_prompt_hits=True))
    for rid in rids:
        match = cache.match(CacheRequest(rid, prompt), max_step=0)
        assert cache.admit(match, len(prompt)) is not None
        cache.commit_step({rid: prompt})
    for token in decoded:
        for rid in rids:
            assert cache.ensure_capacity(rid, cache.num_computed(rid) + 1)
        cache.commit_step({rid: (token,) for rid in rids})
    return cache


def feed_pending(cache: PrefixCache, *rids: str) -> None:
    for rid in rids:
        assert cache.ensure_capacity(rid, cache.num_computed(rid) + 1)
    cache.commit_step({rid: (PENDING_TOKEN,) for rid in rids})


def test_a_block_filled_by_a_pending_token_joins_the_trie_when_it_is_filled_in():
    prompt, decoded = tokens(13, seed=1), (5, 6)
    cache = running(prompt, decoded, "a")  # 15 tokens: block 1 holds positions 8..14
    feed_pending(cache, "a")  # position 15 fills block 1 with a token not known yet
    assert cache.stats.num_nodes == 1 and cache.num_computed("a") == 16
    cache.check_integrity()
    cache.accept({"a": (7,)})
    assert cache.stats.num_nodes == 2
    cache.check_integrity()
    # The block's content is the real token: a sequence that feeds the same 16 tokens shares it.
    other = running(prompt, (5, 6, 7), "b")
    assert other.stats.num_nodes == 2


def test_a_filled_in_pending_token_deduplicates_onto_an_identical_block():
    prompt = tokens(13, seed=2)
    cache = running(prompt, (5, 6), "a", "b")
    cache.commit_step({})  # (no step for either)
    assert cache.ensure_capacity("a", 16)
    cache.commit_step({"a": (7,)})  # a's block 1 enters the trie with 7 at position 15
    feed_pending(cache, "b")
    own = cache.block_ids("b")[1]
    assert own != cache.block_ids("a")[1]
    cache.accept({"b": (7,)})
    assert cache.block_ids("b")[1] == cache.block_ids("a")[1]  # b shares a's block; its own copy is freed
    assert cache.stats.num_nodes == 2
    cache.check_integrity()


def test_a_pending_token_mid_block_needs_no_insert_and_finish_waits_for_it():
    cache = running(tokens(10, seed=3), (), "a")
    feed_pending(cache, "a")
    with pytest.raises(ValueError, match="pending token"):
        cache.finish("a")
    cache.accept({"a": (42,)})
    assert cache.finish("a")  # a FINISH checkpoint at step 11, its tail holding the real token
    cache.check_integrity()
    hit = cache.match(CacheRequest("b", tokens(10, seed=3) + (42, 1)))
    assert hit.cached_len == 11


def test_accept_where_nothing_is_pending():
    cache = running(tokens(10, seed=4), (3,), "a")
    cache.accept({"a": (9,)})  # its sample was never fed: nothing to take
    cache.accept({"gone": (9,)})  # not running (preempted or retired): nothing to do
    assert cache._seqs["a"].token_ids == [*tokens(10, seed=4), 3]
    feed_pending(cache, "a")
    with pytest.raises(ValueError, match="pending token"):
        cache.accept({"a": (-5,)})
    with pytest.raises(ValueError, match="pending token"):
        cache.accept({"a": (9, 9)})
    cache.check_integrity()


@pytest.mark.parametrize("case", ["in the prompt", "not last", "with a save"])
def test_commit_refuses_a_pending_token_it_cannot_take(case):
    prompt = tokens(15, seed=5)
    cache = PrefixCache(CacheConfig(block_size=B, num_blocks=64, num_slots=8))
    match = cache.match(CacheRequest("a", prompt), max_step=0)
    cache.admit(match, len(prompt))
    if case == "in the prompt":
        fed = prompt[:-1] + (PENDING_TOKEN,)
    else:
        cache.commit_step({"a": prompt})
        cache.ensure_capacity("a", 17)
        fed = (PENDING_TOKEN, 3) if case == "not last" else (PENDING_TOKEN,)
        if case == "with a save":
            assert cache.reserve_save("a", 16, SaveReason.DECODE_INTERVAL)
    with pytest.raises(ValueError, match="differ from its prompt" if case == "in the prompt" else "pending token"):
        cache.commit_step({"a": fed})
    cache.check_integrity()  # refused before anything changed
