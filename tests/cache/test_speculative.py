"""Speculative steps in the cache: a decoding sequence feeds its last token and n drafts; `accept` keeps a
prefix of them. Drafts never reach the trie or a checkpoint before they are accepted, their KV lies only in the
sequence's private blocks, and a partial acceptance returns the `STATE_ROLLBACK` copy of the right draft state."""

from __future__ import annotations

import pytest

from hybridcache.cache import CacheConfig, CacheRequest, CopyKind, IntegrityError, PrefixCache, SaveReason
from tests.cache.conftest import tokens

B = 8
K = 3


def running(prompt: tuple[int, ...], *rids: str, paged: bool = True) -> PrefixCache:
    """A cache (speculative k = 3) running each of `rids` over `prompt`, prefilled in one step."""
    config = CacheConfig(block_size=B, num_blocks=64, num_slots=4, full_prompt_hits=True, num_speculative_tokens=K,
                         state_pages=2 if paged else None)
    cache = PrefixCache(config)
    for rid in rids:
        match = cache.match(CacheRequest(rid, prompt), max_step=0)
        assert cache.admit(match, len(prompt) + 2 * K) is not None
        cache.commit_step({rid: prompt})
    return cache


def verify(cache: PrefixCache, rid: str, token: int, drafts: tuple[int, ...]) -> None:
    assert cache.ensure_capacity(rid, cache.num_computed(rid) + 1 + 2 * K)
    cache.commit_step({rid: (token, *drafts)}, {rid: len(drafts)})


def test_drafts_join_the_tokens_only_when_accepted_and_a_partial_acceptance_rolls_the_state_back():
    prompt = tokens(13, seed=1)
    cache = running(prompt, "a")
    verify(cache, "a", 50, (51, 52, 53))  # positions 13 | 14 15 16: the drafts would fill block 1
    assert cache.num_computed("a") == 14 and cache.stats.num_nodes == 1  # block 1 is not full of accepted tokens
    cache.check_integrity()
    slot = cache.slot("a")
    plan = cache.accept({"a": (51,)})  # one of three kept: the state after verify position 1
    assert plan.pairs(CopyKind.STATE_ROLLBACK) == [(slot * K + 1, slot)]
    assert not plan.ops[0].paged  # a whole slot, also when checkpoints are paged
    assert cache.num_computed("a") == 15 and cache.stats.num_nodes == 1
    cache.check_integrity()
    verify(cache, "a", 60, (61, 62))  # positions 15 | 16 17
    assert cache.stats.num_nodes == 2  # token 60 completes block 1 (positions 8..15)
    plan = cache.accept({"a": (61, 62)})  # all kept: the slot already holds the state after them
    assert plan.is_empty and cache.num_computed("a") == 18
    cache.check_integrity()


def test_rejected_drafts_never_reach_the_trie_and_accepted_ones_that_fill_a_block_do():
    prompt = tokens(14, seed=2)
    cache = running(prompt, "a", "b")
    verify(cache, "a", 70, (71, 72))  # positions 14 | 15 16: draft 71 would complete block 1
    assert cache.accept({"a": ()}).pairs(CopyKind.STATE_ROLLBACK) == [(cache.slot("a") * K, cache.slot("a"))]
    assert cache.stats.num_nodes == 1
    cache.commit_step({"a": (99,)})  # the token the verify sampled instead completes block 1
    assert cache._seqs["a"].nodes[1].token_ids == (*prompt[8:], 70, 99)
    assert cache.ensure_capacity("b", 15 + 2 * K)
    cache.commit_step({"b": (70, 71, 72)}, {"b": 2})
    cache.accept({"b": (71, 72)})  # accepted: block 1 of "b" = [..., 70, 71] joins the trie
    assert cache._seqs["b"].nodes[1].token_ids == (*prompt[8:], 70, 71)
    assert cache.stats.num_nodes == 3
    cache.check_integrity()


def test_finish_after_acceptance_saves_exactly_the_accepted_tokens():
    prompt = tokens(10, seed=3)
    cache = running(prompt, "a")
    verify(cache, "a", 5, (6, 7, 9))
    with pytest.raises(ValueError, match="drafts not judged"):
        cache.finish("a")
    cache.accept({"a": (6, 7)})
    assert cache.finish("a")  # a finish checkpoint at step 13 = prompt + [5, 6, 7]
    hit = cache.match(CacheRequest("b", (*prompt, 5, 6, 7, 1)))
    assert hit.cached_len == 13
    cache.release_match(hit)
    cache.check_integrity()


@pytest.mark.parametrize("bad", ["too_many", "no_token_before", "prefill", "save", "unjudged", "keeps_more",
                                 "missing"])
def test_bad_speculative_calls_are_refused_and_change_nothing(bad):
    prompt = tokens(12, seed=4)
    cache = running(prompt, "a")
    assert cache.ensure_capacity("a", cache.num_computed("a") + 1 + 2 * K)
    if bad == "too_many":
        call = lambda: cache.commit_step({"a": (1, 2, 3, 4, 5)}, {"a": 4})  # noqa: E731
    elif bad == "no_token_before":
        call = lambda: cache.commit_step({"a": (1, 2)}, {"a": 2})  # noqa: E731
    elif bad == "prefill":
        match = cache.match(CacheRequest("p", prompt), max_step=0)
        cache.admit(match, len(prompt) + 2 * K)
        call = lambda: cache.commit_step({"p": (*prompt, 1)}, {"p": 1})  # noqa: E731
    elif bad == "save":
        cache.reserve_save("a", 14, SaveReason.CHUNK_END)
        call = lambda: cache.commit_step({"a": (1, 2)}, {"a": 1})  # noqa: E731
    elif bad == "unjudged":
        cache.commit_step({"a": (1, 2)}, {"a": 1})
        call = lambda: cache.commit_step({"a": (3,)})  # noqa: E731
    elif bad == "keeps_more":
        cache.commit_step({"a": (1, 2)}, {"a": 1})
        call = lambda: cache.accept({"a": (2, 3)})  # noqa: E731
    else:  # drafts not judged by the step's accept stay unjudged: the next commit is refused
        cache.commit_step({"a": (1, 2)}, {"a": 1})
        cache.accept({})
        call = lambda: cache.commit_step({"a": (3,)})  # noqa: E731
    before = (cache.num_computed("a"), cache.block_ids("a"), cache.stats.num_nodes)
    with pytest.raises(ValueError):
        call()
    assert (cache.num_computed("a"), cache.block_ids("a"), cache.stats.num_nodes) == before
    cache.check_integrity()


def test_integrity_catches_drafts_outside_private_blocks():
    prompt = tokens(16, seed=5)  # two full blocks, both in the trie
    cache = running(prompt, "a")
    verify(cache, "a", 1, (2,))
    seq = cache._seqs["a"]
    seq.num_drafts = 2 * B  # claim drafts beyond its blocks
    with pytest.raises(IntegrityError, match="drafts"):
        cache.check_integrity()
    seq.num_drafts = 1
    cache.check_integrity()


def test_abort_and_preempt_drop_unjudged_drafts():
    prompt = tokens(12, seed=6)
    cache = running(prompt, "a", "b")
    verify(cache, "a", 1, (2, 3))
    cache.abort("a")
    cache.check_integrity()
    verify(cache, "b", 1, (2, 3))
    cache.preempt("b")
    cache.check_integrity()
    assert cache.running_ids() == []
