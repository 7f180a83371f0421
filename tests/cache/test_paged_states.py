"""Paged checkpoint states (`CacheConfig.state_pages`): a checkpoint's state in k KV blocks, one budget."""

from __future__ import annotations

from hybridcache.cache import CacheRequest
from hybridcache.cache.checkpoint import CheckpointState
from hybridcache.cache.plan import CopyKind
from tests.cache.conftest import make_driver, tokens

B = 16


def paged_driver(num_blocks: int = 64, k: int = 2, num_slots: int = 4):
    return make_driver(block_size=B, num_blocks=num_blocks, num_slots=num_slots, state_pages=k)


def test_a_save_takes_k_pages_and_copies_the_runtime_chunks_into_them():
    driver = paged_driver(k=3)
    cache = driver.cache
    prompt = tokens(40, seed=1)
    driver.admit(CacheRequest("a", prompt))
    slot = cache.slot("a")
    before = cache.stats.num_blocks_used
    copies = driver.step("a", prompt[:25], [("chunk_end",)])
    (ckpt,) = cache._life.published()
    assert ckpt.slot is None and len(ckpt.pages) == 3
    # 2 blocks for the 25 tokens, and the save's 3 pages and 1 frozen block
    assert cache.stats.num_blocks_used == before + 2 + 3 + 1
    assert copies.pairs(CopyKind.STATE_SAVE) == [(slot * 3 + j, page) for j, page in enumerate(ckpt.pages)]
    assert all(op.paged for op in copies.ops if op.kind.pool.value == "state")
    # a second request restores it: the three pages into the chunks of its own slot, j in order
    driver.admit(CacheRequest("b", prompt[:25] + (5, 6)))
    plan = driver.step("b", [5, 6])
    other = cache.slot("b")
    assert plan.pairs(CopyKind.STATE_RESTORE) == [(page, other * 3 + j) for j, page in enumerate(ckpt.pages)]


def test_finish_copies_the_freed_slot_into_pages_first_in_the_next_plan():
    driver = paged_driver(k=2, num_slots=1)
    cache = driver.cache
    prompt = tokens(40, seed=2)
    driver.run(CacheRequest("a", prompt), decode=[7, 8, 9])  # prefill_end at 40, then a FINISH at 43
    assert cache.stats.num_slots_used == 0  # the runtime slot went back at finish
    (finish,) = [c for c in cache._life.published() if c.step == 43]
    pending = driver.device.cache_pending_finish()
    assert finish in pending
    # the next step's plan: a new request reuses the freed slot and restores the very same checkpoint
    follow = CacheRequest("b", prompt + (7, 8, 9, 1, 2))
    driver.admit(follow)
    assert cache.slot("b") == pending[finish]
    plan = driver.step("b", [1, 2])
    kinds = [op.kind for op in plan.ops]
    assert kinds[0] is CopyKind.STATE_FINISH and kinds.index(CopyKind.STATE_RESTORE) > 0
    slot = pending[finish]
    assert plan.pairs(CopyKind.STATE_FINISH) == [(slot * 2 + j, page) for j, page in enumerate(finish.pages)]
    assert not driver.device.cache_pending_finish()
    driver.device.check()


def test_a_finish_checkpoint_released_before_the_next_plan_is_not_copied():
    driver = paged_driver(k=2)
    cache = driver.cache
    driver.run(CacheRequest("a", tokens(40, seed=3)), decode=[4])
    assert driver.device.cache_pending_finish()
    cache.clear()
    cache.check_integrity()
    driver.admit(CacheRequest("b", tokens(20, seed=4)))
    plan = driver.step("b", tokens(20, seed=4))
    assert plan.pairs(CopyKind.STATE_FINISH) == []
    assert cache.stats.num_blocks_used == 2  # b's blocks only: every page came back


def test_kv_and_states_share_the_pool_one_eviction_order():
    # 14 blocks, k = 4: two finished 20-token requests hold, each, 1 trie block + a frozen tail + 4 pages
    # (their prefill-end checkpoint at 20; the finish at 20 is the same one)
    driver = paged_driver(num_blocks=14, k=4)
    cache = driver.cache
    for i in range(2):
        driver.run(CacheRequest(f"r{i}", tokens(20, seed=10 + i)))
    assert cache.stats.num_blocks_used == 2 * (1 + 1 + 4)
    # a 150-token request needs 10 blocks: states go to make room for KV (no separate state pool to hold them)
    driver.admit(CacheRequest("long", tokens(150, seed=20)))
    assert cache.ensure_capacity("long", 150)
    assert all(c.state is CheckpointState.PUBLISHED for c in cache._life.published())
    assert cache.stats.num_checkpoints == 0 and cache.stats.evictions_by_kind
    cache.check_integrity()


def test_runtime_slots_are_never_evicted_for_and_a_finish_without_room_is_declined():
    driver = paged_driver(num_blocks=8, k=4, num_slots=1)
    cache = driver.cache
    driver.admit(CacheRequest("a", tokens(60, seed=5)))
    match = cache.match(CacheRequest("b", tokens(10, seed=6)))
    assert cache.admit(match) is None  # the one runtime slot is a's
    cache.release_match(match)
    driver.step("a", tokens(60, seed=5))  # 4 blocks of KV; no save (it would not fit with a frozen tail)
    assert cache.ensure_capacity("a", 8 * B)  # every block: nothing is left for a finish's 4 pages
    cache.finish("a")
    assert cache.stats.declined_saves.get("no_room") == 1 and cache.stats.num_checkpoints == 0
    assert cache.stats.num_slots_used == 0 and not driver.device.cache_pending_finish()
    cache.check_integrity()
