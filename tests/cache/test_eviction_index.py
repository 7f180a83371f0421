"""The structures that make eviction and matching fast: recency order, leaf heaps, the pruned FLOP-aware
pick, the reclaimable-blocks lower bound, cached block hashes and the first-token child index. Each is
checked against the plain computation it replaces."""

from __future__ import annotations

import random

import pytest

from hybridcache.cache import CacheConfig, CacheRequest, CostModel, MultimodalSpan, PrefixCache
from hybridcache.cache.checkpoint import Checkpoint, CheckpointState
from hybridcache.cache.eviction_index import LeafHeap, RecencyOrder
from hybridcache.cache.policy import FlopAwarePolicy
from hybridcache.cache.request import SaveReason
from hybridcache.cache.trie import Trie, chain_hash, prompt_block_hashes, root_hash
from tests.cache.checked_evictor import check_picks
from tests.cache.conftest import make_driver, tokens
from tests.cache.fake_engine import Driver


def _ckpt(ckpt_id: int, step: int, last_access: int, frozen: bool) -> Checkpoint:
    ckpt = Checkpoint(
        ckpt_id=ckpt_id, adapter=None, step=step, reason=SaveReason.CHUNK_END, slot=ckpt_id,
        frozen_block=7 if frozen else None, routed_experts=None, owner="r", last_access=0,
    )
    ckpt.state = CheckpointState.PUBLISHED
    ckpt.last_access = last_access
    return ckpt


def test_recency_order_skips_pinned_and_tracks_touches_and_max_steps():
    order = RecencyOrder(track_steps=True)
    a, b, c = _ckpt(0, 40, 1, True), _ckpt(1, 90, 2, False), _ckpt(2, 70, 3, True)
    for ckpt in (a, b, c):
        order.add(ckpt)
    assert order.first_unpinned() is a
    a.num_pins = 1
    assert order.first_unpinned() is b and order.count_unpinned() == 2 and order.count_unpinned(1) == 1
    b.last_access = 4
    order.touch(b)
    assert [x.ckpt_id for x in order.oldest_first()] == [0, 2, 1]
    assert order.max_step(True) is c and order.max_step(False) is b
    c.num_pins = 1
    assert order.max_step(True) is None  # a and c pinned
    a.num_pins = 0
    assert order.max_step(True) is a  # the pinned c was skipped and kept
    c.num_pins = 0
    assert order.max_step(True) is c
    order.remove(c)
    c.state = CheckpointState.RELEASED
    assert order.max_step(True) is a and len(order) == 2


def test_recency_orders_step_heaps_stay_bounded_by_the_live_entries():
    """A released checkpoint whose step is below a live one never reaches a heap's top to be dropped lazily: with
    one deep checkpoint kept, the step heaps held every shallower checkpoint ever added (a flop-aware server grew
    about two entries a request, with their tails). Compacted, they stay within twice the live count (+ 64), and
    `max_step` still finds the deepest live entry of each group."""
    order = RecencyOrder(track_steps=True)
    deep = _ckpt(0, 10_000, 0, False)
    order.add(deep)
    shallow = {}
    for i in range(1, 2001):
        shallow[i] = _ckpt(i, i, i, i % 2 == 0)
        order.add(shallow[i])
        if i > 5:  # the five newest shallow ones stay
            gone = shallow.pop(i - 5)
            order.remove(gone)
            gone.state = CheckpointState.RELEASED
    assert len(order) == 6
    assert sum(map(len, order._steps.values())) <= 2 * len(order) + 64
    live = [c for c in order.oldest_first() if c.frozen_block is not None]
    assert order.max_step(False) is deep and order.max_step(True) is max(live, key=lambda c: c.step)


def test_leaf_heap_drops_stale_entries_and_keeps_skipped_ones():
    trie = Trie()
    root = trie.root(None)
    n1 = trie.add_child(root, 1, (1,), (), 10, now=5)
    n2 = trie.add_child(root, 2, (2,), (), 11, now=3)
    heap = LeafHeap(dead=True)
    heap.push(n1)
    heap.push(n2)
    assert heap.pick(lambda n: True) is n2
    assert heap.pick(lambda n: n is not n2) is n1
    assert heap.pick(lambda n: True) is n2  # n2 was skipped, not dropped
    n2.last_access = 9  # touched: its old entry is stale until pushed again
    assert heap.pick(lambda n: True) is n1
    heap.push(n2)
    trie.add_child(n1, 3, (3,), (), 12, now=6)  # n1 is no longer a leaf
    assert heap.pick(lambda n: True) is n2
    assert len(heap) == 1  # the stale entries were dropped on the way


@pytest.mark.parametrize("alpha", [0.0, 0.3, 1.0, 5.0])
@pytest.mark.parametrize("seed", range(4))
def test_pruned_flop_aware_pick_equals_full_scoring(alpha, seed):
    rng = random.Random(seed)
    cost = CostModel(flops_per_token=rng.choice([0.0, 1.0, 3.0]), attn_flops_per_token_pair=rng.choice([0.0, 0.5]),
                     kv_bytes_per_token=2.0, state_bytes=50.0)
    policy = FlopAwarePolicy(alpha, cost, block_size=8)
    assert policy.can_prune
    for trial in range(50):
        times = rng.sample(range(1, 10_000), rng.randint(1, 30))
        candidates = [_ckpt(i, rng.randint(1, 500), t, rng.random() < 0.5) for i, t in enumerate(times)]
        by_time = sorted(candidates, key=lambda c: c.last_access)
        top = max(policy.efficiency(c) for c in candidates)
        fast = policy.pick_checkpoint_by_recency(iter(by_time), by_time[-1], top)
        assert fast is policy.pick_checkpoint(candidates), (trial, alpha)


def _pressure_run(
    eviction: str, seed: int, num_blocks: int, num_slots: int, chunk: int | None = None,
    state_pages: int | None = None,
) -> PrefixCache:
    """Many prompts sharing prefixes, through a cache far too small, with every pick checked (prefilled in
    chunks of `chunk` tokens, each saving a checkpoint; `state_pages`: paged, one pool of blocks)."""
    cache = PrefixCache(
        CacheConfig(block_size=8, num_blocks=num_blocks, num_slots=num_slots, eviction=eviction,
                    max_checkpoints_per_anchor=2, state_pages=state_pages),
        CostModel(attn_flops_per_token_pair=0.5),
    )
    check_picks(cache)
    driver = Driver(cache)
    rng = random.Random(seed)
    stems = [tokens(rng.randint(5, 40), seed=100 + i, vocab=50) for i in range(5)]
    for i in range(60):
        prompt = rng.choice(stems) + tokens(rng.randint(1, 30), seed=1000 * seed + i, vocab=50)
        driver.run(CacheRequest(f"r{i}", prompt), chunk=chunk)
        cache.check_integrity()
    return cache


@pytest.mark.parametrize("eviction", ["lru", "flop_aware"])
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize(
    ("num_blocks", "num_slots", "chunk", "state_pages", "kinds"),
    [
        # frozen tails go only when no leaf can: chunked prefills leave them on the running sequence's path
        (12, 40, 5, None, ("dead_block", "frozen_tail", "leaf", "leaf_checkpoint")),
        (40, 6, None, None, ("dead_block", "checkpoint")),
        # paged: 32 blocks for KV and checkpoint states (8 blocks each), one runtime slot
        (32, 1, 5, 8, ("dead_block", "leaf", "leaf_checkpoint", "checkpoint")),
    ],
    ids=["kv-pressure", "state-pressure", "paged"],
)
def test_indexed_victims_match_full_scans_under_pressure(
    eviction, seed, num_blocks, num_slots, chunk, state_pages, kinds,
):
    cache = _pressure_run(eviction, seed, num_blocks, num_slots, chunk, state_pages)  # raises if a victim differs
    evictions = cache.stats.evictions_by_kind
    assert all(evictions.get(kind, 0) > 0 for kind in kinds), evictions


def test_reclaimable_lower_bound_climbs_single_child_chains_only():
    driver = make_driver(block_size=4, num_blocks=64, num_slots=8)
    cache = driver.cache
    evictor = cache._life.evictor
    base = tokens(12, seed=1)
    driver.run(CacheRequest("a", base + tokens(6, seed=2)))  # chain of 4 full blocks (16 tokens + tail)
    driver.run(CacheRequest("b", base + tokens(9, seed=3)))  # branches after block 3
    full = evictor.reclaimable_blocks()
    for enough in range(1, full + 2):
        assert (evictor.reclaimable_blocks(enough) >= enough) == (full >= enough)
    assert evictor.reclaimable_blocks(full + 1) == full


def test_prompt_block_hashes_equal_the_chain_and_are_computed_once():
    prompt = tokens(50, seed=4)
    spans = (MultimodalSpan(10, 20, "img"),)
    request = CacheRequest("a", prompt, adapter="lora", mm_spans=spans)
    hashes = prompt_block_hashes(request, 16, chain_hash)
    parent, expected = root_hash("lora"), []
    for i in range(3):
        parent = chain_hash(parent, prompt[16 * i:16 * (i + 1)], request.spans_in(16 * i, 16 * (i + 1)))
        expected.append(parent)
    assert hashes == expected
    assert prompt_block_hashes(request, 16, chain_hash) is hashes
    custom = prompt_block_hashes(request, 16, lambda p, t, s: p + len(t))
    assert custom == [root_hash("lora") + 16 * k for k in (1, 2, 3)]
    assert prompt_block_hashes(request, 8, chain_hash)[:2] != hashes[:2]


def test_first_token_index_of_a_wide_node_finds_divergence():
    driver = make_driver(block_size=4, num_blocks=200, num_slots=40)
    cache = driver.cache
    stem = tokens(4, seed=5)
    for i in range(Trie.INDEX_FIRST_TOKEN_AT + 4):
        driver.run(CacheRequest(f"r{i}", stem + (i, 900 + i, 1, 2, 3)))
    (stem_node,) = [n for n in cache._life.trie.iter_nodes() if n.depth == 1]
    assert stem_node.by_first is not None and len(stem_node.by_first) == Trie.INDEX_FIRST_TOKEN_AT + 4
    cache.check_integrity()
    probe = cache.match(CacheRequest("probe", stem + (7, 907, 5, 5, 5)))
    assert probe.divergence_len == 4 + 2  # agrees with child (7, 907, 1, 2) on two tokens
    cache.release_match(probe)


def test_first_token_index_follows_adds_and_removals():
    trie = Trie()
    root = trie.root(None)
    children = []
    for i in range(3 * Trie.INDEX_FIRST_TOKEN_AT):
        block = (i % 5, i)
        children.append(trie.add_child(root, chain_hash(root.hash, block, ()), block, (), i, now=i))

    def check() -> None:
        for first in range(6):
            expected = [c for c in children if c.attached and c.token_ids[0] == first]
            assert sorted(map(id, trie.children_starting_with(root, first))) == sorted(map(id, expected))

    assert root.by_first is not None
    check()
    while len(root.children) > 1:
        trie.remove_leaf(next(c for c in children if c.attached))
        check()
        if len(root.children) <= Trie.INDEX_FIRST_TOKEN_AT // 2:
            assert root.by_first is None


def test_a_registered_eviction_policy_is_one_class_chosen_by_name():
    """A policy is one `EvictionPolicy` class registered by name: `CacheConfig(eviction=name)` builds it and the
    evictor applies it (by the full-scan defaults, checked pick by pick under pressure); unknown names are
    refused."""
    from hybridcache.cache.policy import EVICTION_POLICIES, EvictionPolicy, LruPolicy, register_eviction

    picks: list[int] = []

    @register_eviction("test-mru")
    class MostRecentFirst(EvictionPolicy):
        def pick_checkpoint(self, candidates):
            victim = max(candidates, key=lambda c: (c.last_access, c.ckpt_id))
            picks.append(victim.ckpt_id)
            return victim

        def pick_leaf(self, candidates):  # leaves as LRU (dead leaves always go oldest first)
            return LruPolicy().pick_leaf(candidates)

    try:
        cache = _pressure_run("test-mru", 0, 40, 6)  # state pressure: checkpoints evicted by the policy
        assert isinstance(cache._life.evictor.policy, MostRecentFirst)
        assert picks and cache.stats.evictions_by_kind.get("checkpoint", 0) > 0
        with pytest.raises(ValueError, match="already registered"):
            register_eviction("lru")(MostRecentFirst)
    finally:
        del EVICTION_POLICIES["test-mru"]
    with pytest.raises(ValueError, match="eviction must be one of"):
        CacheConfig(block_size=8, num_blocks=8, num_slots=2, eviction="test-mru")
