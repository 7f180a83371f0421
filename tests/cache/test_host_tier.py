"""The host tier (host_tier.py): demotion on device eviction, promotion on a hit, the host's own eviction,
promotions that do not pay, twins across the tiers. Every step runs on the fake device, which keeps host memory
and checks every host node and host checkpoint against what its ids claim."""

from __future__ import annotations

import pytest

from hybridcache.cache import CacheConfig, CacheRequest, CopyKind, CostModel, PrefixCache
from hybridcache.cache.checkpoint import Checkpoint
from hybridcache.cache.host_order import HostOrder, proven_at_demotion
from hybridcache.cache.request import SaveReason
from tests.cache.checked_evictor import check_picks
from tests.cache.fake_engine import Driver, FakeDisk, fingerprint

B = 4


def make(num_blocks: int = 8, host_blocks: int = 16, cost: CostModel | None = None) -> tuple[PrefixCache, Driver]:
    cache = PrefixCache(CacheConfig(block_size=B, num_blocks=num_blocks, num_slots=2, state_pages=1,
                                    host_blocks=host_blocks), cost)
    check_picks(cache)
    return cache, Driver(cache)


def fill_device(driver: Driver, first: int = 100) -> None:
    """A request of unrelated tokens that needs most of the device pool: evicts (demotes) the older chains."""
    driver.run(CacheRequest(("filler", first), tuple(range(first, first + 5 * B))), decode=[7])


def test_eviction_demotes_and_a_hit_promotes_before_the_forward():
    cache, driver = make()
    prompt = tuple(range(10))  # 2 full blocks + 2 tail tokens: a prefill-end checkpoint at 10 (frozen tail)
    driver.run(CacheRequest("a", prompt))
    fill_device(driver)
    stats = cache.stats
    assert stats.num_demoted_blocks >= 2 and stats.num_demoted_checkpoints >= 1
    probe = cache.match(CacheRequest("probe", prompt + (1,)))
    assert probe.cached_len == 10  # found in the host tier
    cache.release_match(probe)
    demoted = cache.stats
    match = driver.admit(CacheRequest("b", prompt + (50, 51, 52)))
    assert match.cached_len == 10 and match.block_ids == ()  # the chain is all in the host tier
    copies = driver.step("b", [50, 51, 52])
    kinds = [op.kind for op in copies.ops]
    assert kinds.index(CopyKind.HOST_LOAD) < kinds.index(CopyKind.KV_RESTORE) < kinds.index(CopyKind.STATE_RESTORE)
    # 2 nodes + the state's page + the frozen tail come back
    assert len(copies.pairs(CopyKind.HOST_LOAD)) == 4
    after = cache.stats
    assert (after.num_host_hits, after.num_host_hit_tokens) == (1, 10)
    assert after.num_promoted_checkpoints == 1 and after.num_promoted_blocks == 2
    # in exactly one tier: the device's now (making room for it demoted some of the filler's chain)
    assert match.checkpoint_id in cache._life.checkpoints and match.checkpoint_id not in cache._life.host.order
    assert after.num_demoted_blocks > demoted.num_demoted_blocks
    cache.finish("b")
    cache.check_integrity()


def test_a_demotion_is_a_host_save_before_anything_writes_the_freed_block():
    cache, driver = make(num_blocks=6)
    driver.run(CacheRequest("a", tuple(range(9))))
    match = cache.match(CacheRequest("c", tuple(range(200, 200 + 4 * B))))
    assert cache.admit(match, 4 * B) is not None
    copies = driver.device.run_step({"c": list(range(200, 200 + 4 * B))})
    saves = copies.pairs(CopyKind.HOST_SAVE)
    assert saves and copies.ops[0].kind is CopyKind.HOST_SAVE
    written = {dst for dst in cache.block_ids("c")}
    assert {src for src, _ in saves} & written  # the freed blocks are reused by c, after the save read them
    driver.device.check()
    cache.check_integrity()


def test_a_promotion_released_before_its_step_cancels_its_loads():
    """A host hit promotes (HOST_LOADs queued for the next plan); the request is preempted before any step and a
    large request evicts the promoted chain, freeing its device blocks. Their loads are dropped with their host
    blocks: no load may write a free block, or one allocated again (a second load into it lost the first host block:
    the state machine's "host block ref count 1 != 0 holders")."""
    cache, driver = make(num_blocks=8, host_blocks=6)
    prompt = tuple(range(10))
    driver.run(CacheRequest("a", prompt))
    fill_device(driver)
    match = driver.admit(CacheRequest("b", prompt + (50, 51)))
    assert match.cached_len == 10 and len(cache._life.host.loading()) == 4  # 2 nodes, the page, the frozen tail
    cache.preempt("b", keep_checkpoint=False)
    big = CacheRequest("c", tuple(range(300, 300 + 6 * B)))
    assert cache.admit(cache.match(big)) is not None and cache.ensure_capacity("c", 6 * B)
    reused = set(cache.block_ids("c")) & {1, 3}  # the promoted state page and frozen tail, freed and reused by c
    assert reused and not reused & set(cache._life.host.loading_into())
    assert cache._life.host.loading_into() == [4]  # the chain's first node is still a device node: its load stays
    cache.check_integrity()
    cache.abort("c")
    cache.check_integrity()
    driver.run(CacheRequest("d", prompt + (60,)))
    driver.device.check()  # every node, checkpoint and host item holds the bytes its ids claim
    cache.check_integrity()


def test_what_falls_out_of_the_host_tier_is_gone():
    cache, driver = make(num_blocks=8, host_blocks=4)  # room for one chain of 2 nodes + page + tail
    driver.run(CacheRequest("a", tuple(range(10))))
    fill_device(driver)
    assert cache.stats.num_host_checkpoints >= 1
    driver.run(CacheRequest("a2", tuple(range(300, 310))))
    fill_device(driver, first=400)  # demotes a2's chain: the host drops a's, the oldest demotion
    assert cache.stats.num_host_dropped >= 1
    match = cache.match(CacheRequest("probe", tuple(range(10)) + (1,)))
    assert match.cached_len == 0
    cache.release_match(match)
    cache.check_integrity()


def test_a_prompt_that_shares_a_demoted_prefix_finds_its_branch_point_in_the_host_tier():
    """The divergence walks the host nodes that continue the device path: c shares 6 tokens with a's chain, which
    is on the host, so c saves a branch point at 6 and d, diverging there too, hits it."""
    cache, driver = make()
    driver.run(CacheRequest("a", tuple(range(10))))
    fill_device(driver)
    assert cache.stats.num_host_nodes >= 1
    c = tuple(range(6)) + (90, 91, 92, 93, 94)
    match = cache.match(CacheRequest("probe", c))
    assert (match.cached_len, match.divergence_len) == (0, 6)
    cache.release_match(match)
    driver.run(CacheRequest("c", c), branch=True)
    d = driver.admit(CacheRequest("d", tuple(range(6)) + (70, 71, 72)))
    assert d.cached_len == 6 and d.checkpoint_reason == "branch_point"
    driver.step("d", [70, 71, 72])
    cache.finish("d")
    cache.check_integrity()


def test_a_promotion_that_does_not_pay_is_skipped():
    slow = CostModel(host_bandwidth=1.0, device_flops=1e12)  # copies crawl: recomputing 10 tokens is cheaper
    cache, driver = make(cost=slow)
    prompt = tuple(range(10))
    driver.run(CacheRequest("a", prompt))
    fill_device(driver)
    assert cache.stats.num_host_checkpoints >= 1
    match = driver.admit(CacheRequest("b", prompt + (1, 2)))
    assert match.cached_len == 0
    stats = cache.stats
    assert (stats.num_promotions_skipped, stats.num_host_hits) == (1, 0)
    cache.abort("b")
    cache.check_integrity()


def test_recomputing_a_demoted_block_absorbs_its_host_twin():
    cache, driver = make()
    prompt = tuple(range(10))
    driver.run(CacheRequest("a", prompt))
    fill_device(driver)
    host = cache._life.host
    assert {n.token_ids for n in host.iter_nodes()} >= {prompt[:4], prompt[4:8]}
    # computed again from scratch (skip_reading: no hit), its blocks are inserted on the device: the host twins
    # of those blocks go, what hung off them (the checkpoint at 10) now hangs off the device nodes
    driver.run(CacheRequest("again", prompt[:8] + (77, 78), skip_reading=True))
    assert not {n.token_ids for n in host.iter_nodes()} & {prompt[:4], prompt[4:8]}
    cache.check_integrity()
    match = cache.match(CacheRequest("probe", prompt + (1,)))
    assert match.cached_len == 10  # still found: the host checkpoint on a device anchor
    cache.release_match(match)


def test_admit_without_room_for_the_promotion_changes_nothing():
    cache, driver = make(num_blocks=8)
    prompt = tuple(range(10))
    driver.run(CacheRequest("a", prompt))
    fill_device(driver)
    assert cache.admit(cache.match(CacheRequest("hog", tuple(range(500, 500 + 7 * B)))), 7 * B) is not None
    before = fingerprint(cache)
    match = cache.match(CacheRequest("b", prompt + (1,)))
    assert match.cached_len == 10
    after_match = fingerprint(cache)
    assert cache.admit(match) is None
    assert fingerprint(cache) == after_match
    cache.release_match(match)
    assert fingerprint(cache) == before
    cache.check_integrity()


def test_host_blocks_need_paged_states():
    with pytest.raises(ValueError, match="host_blocks"):
        CacheConfig(block_size=B, num_blocks=8, num_slots=4, host_blocks=8)


def test_worked_example_of_cache_md():
    size = 16
    cache = PrefixCache(CacheConfig(block_size=size, num_blocks=6, num_slots=2, state_pages=1, host_blocks=8))
    driver = Driver(cache)
    driver.admit(CacheRequest("a", tuple(range(37))))
    plan = driver.step("a", list(range(37)), [("prefill_end",)])
    assert plan.pairs(CopyKind.KV_SAVE) == [(2, 4)] and plan.pairs(CopyKind.STATE_SAVE) == [(0, 3)]
    cache.finish("a")
    match = cache.match(CacheRequest("b", tuple(range(100, 148))))
    admitted = cache.admit(match, 48)
    assert admitted is not None and admitted.block_ids == (5, 2, 3)  # 3: freed by the demotion
    plan = driver.device.run_step({"b": list(range(100, 148))})
    assert [op.kind for op in plan.ops] == [CopyKind.HOST_SAVE]
    assert plan.pairs(CopyKind.HOST_SAVE) == [(1, 0), (3, 1), (4, 2)]
    driver.device.check()
    cache.abort("b")
    match = cache.match(CacheRequest("c", tuple(range(37)) + (7, 8, 9)))
    assert (match.cached_len, match.block_ids) == (37, (0,))
    assert cache.admit(match, 40) is not None
    plan = driver.device.run_step({"c": [7, 8, 9]})
    assert plan.pairs(CopyKind.HOST_LOAD) == [(0, 4), (1, 1), (2, 3)]
    assert plan.pairs(CopyKind.KV_RESTORE) == [(3, 2)] and plan.pairs(CopyKind.STATE_RESTORE) == [(1, 0)]
    driver.device.check()
    cache.check_integrity()
    stats = cache.stats
    assert (stats.num_host_hits, stats.num_promoted_checkpoints, stats.num_promoted_blocks) == (1, 1, 1)
    assert (stats.num_host_checkpoints, stats.num_host_nodes) == (0, 0)


def with_disk(disk: FakeDisk, num_blocks: int, host_blocks: int) -> tuple[PrefixCache, Driver]:
    cache = PrefixCache(CacheConfig(block_size=B, num_blocks=num_blocks, num_slots=2, state_pages=1,
                                    host_blocks=host_blocks), tier_behind=disk)
    driver = Driver(cache)
    disk.attach(driver.device)
    return cache, driver


def test_what_the_host_drops_comes_back_into_another_cache_with_its_bytes():
    """The disk tier's contract on the cache side (`TierBehind`): every checkpoint the host tier's own eviction
    drops is told (`keep`) with its chain and state as they are then (bytes read through the fake device); a fresh
    cache (a restart) asked on a match for a deeper checkpoint hangs it in its host tier (`adopt_stored`), where it
    holds what its ids claim (`FakeDevice.check`), and the match hits it and runs on it."""
    disk = FakeDisk()
    cache, driver = with_disk(disk, num_blocks=8, host_blocks=12)
    prompts = [tuple(range(i * 50, i * 50 + 10)) for i in range(6)]  # 2 blocks + a 2-token tail each
    for i, prompt in enumerate(prompts):
        driver.run(CacheRequest(("p", i), prompt))
        fill_device(driver, first=1000 + 100 * i)
    assert len(disk.kept) >= 3, "the host tier dropped little"

    again_disk = FakeDisk(list(disk.kept))  # (it keeps what its own host tier drops too)
    restarted, again = with_disk(again_disk, num_blocks=16, host_blocks=64)
    for i, (stored, _, _) in enumerate(disk.kept):
        prompt = tuple(t for _, tokens in stored.chain for t in tokens) + stored.tail_ids
        request = CacheRequest(("back", i), prompt + (7, 8))
        deepest = again_disk.find(request, B, len(request.prompt_ids) - 1)[0].step  # this one, or one deeper
        match = again.run(request, decode=[3])  # checks every block's and state's bytes at every step
        assert match.cached_len >= deepest >= stored.step, i
    assert restarted.stats.num_host_hits > 0 and restarted.stats.num_promoted_checkpoints > 0
    restarted.check_integrity()


def test_at_shutdown_the_device_pools_checkpoints_are_handed_behind_too():
    """`PrefixCache.keep_behind` (the engine's shutdown with a disk tier) hands every checkpoint the cache holds,
    the host tier's and the device pool's published ones, with their chains and states as they are (bytes read
    through the fake device, device pages included), and leaves the cache as it was; a fresh cache (a restart) hits
    each of them with the right bytes."""
    disk = FakeDisk()
    cache, driver = with_disk(disk, num_blocks=10, host_blocks=40)
    prompts = [tuple(range(i * 50, i * 50 + 10)) for i in range(3)]
    for i, prompt in enumerate(prompts):
        driver.run(CacheRequest(("p", i), prompt))
    fill_device(driver, first=1000)  # demotes some to the host tier, the rest stays on the device
    stats = cache.stats
    total = stats.num_checkpoints + stats.num_host_checkpoints  # (`num_checkpoints`: the device pool's)
    assert stats.num_host_checkpoints > 0 and stats.num_checkpoints > 0 and stats.num_host_dropped == 0
    before = (stats.num_checkpoints, stats.num_host_checkpoints, stats.num_blocks_used, stats.num_host_blocks_used)
    progress: list[tuple[int, int]] = []
    assert cache.keep_behind(lambda done, total: progress.append((done, total))) == total
    assert progress == [(done, total) for done in range(1, total + 1)]
    # not kept: only a finish checkpoint whose state copy rides on the next step's plan (the filler's)
    unwritten = sum(c.unwritten for c in cache._life.published())
    assert unwritten == 1 and disk.num_not_kept == unwritten and len(disk.kept) == total - unwritten
    assert sum(not stored.chain for stored, _, _ in disk.kept) < total  # chains of device blocks were read too
    after = cache.stats
    assert (after.num_checkpoints, after.num_host_checkpoints, after.num_blocks_used,
            after.num_host_blocks_used) == before
    cache.check_integrity()

    restarted, again = with_disk(FakeDisk(list(disk.kept)), num_blocks=16, host_blocks=64)
    for i, (stored, _, _) in enumerate(disk.kept):
        prompt = tuple(t for _, tokens in stored.chain for t in tokens) + stored.tail_ids
        match = again.run(CacheRequest(("back", i), prompt + (7, 8)), decode=[3])  # checks every block's bytes
        assert match.cached_len >= stored.step, i
    assert restarted.stats.num_promoted_checkpoints > 0
    restarted.check_integrity()


def test_host_order_worked_example():
    """host_order.py's worked example: a proven checkpoint demoted first is due one host capacity later, so the
    two unproven ones demoted after it go first; ties go to the unproven one; a pinned one is passed over."""
    order = HostOrder(protection=100)
    a, b, c = (Checkpoint(ckpt_id=i, adapter=None, step=8, reason=SaveReason.CHUNK_END, slot=None,
                          frozen_block=None, routed_experts=None, owner=None, last_access=0) for i in range(3))
    order.add(a, proven=True)
    order.tick(10)
    order.add(b, proven=False)
    order.tick(10)
    order.add(c, proven=False)
    assert [order.due(x) for x in (a, b, c)] == [100, 10, 20] and order.is_proven(a) and not order.is_proven(b)
    b.num_pins = 1
    assert order.victim() is c
    b.num_pins = 0
    dropped = []
    while (victim := order.victim()) is not None:
        dropped.append(victim.ckpt_id)
        order.remove(victim)
    assert dropped == [1, 2, 0] and list(order.ids()) == []
    order.add(a, proven=True)  # at clock 20: due at 120
    order.tick(100)
    order.add(b, proven=False)  # at clock 120: due then too
    assert order.due(a) == order.due(b) == 120 and order.victim() is b


def test_proven_at_demotion():
    """host_order.py's rule: hit before or a branch point, and not shadowed."""
    def ckpt(reason, hit=False, shadowed=False):
        c = Checkpoint(ckpt_id=0, adapter=None, step=8, reason=reason, slot=None, frozen_block=None,
                       routed_experts=None, owner=None, last_access=0)
        c.was_hit, c.shadowed = hit, shadowed
        return c

    assert not proven_at_demotion(ckpt(SaveReason.CHUNK_END))
    assert proven_at_demotion(ckpt(SaveReason.CHUNK_END, hit=True))
    assert proven_at_demotion(ckpt(SaveReason.BRANCH_POINT))
    assert not proven_at_demotion(ckpt(SaveReason.PREFILL_END))
    assert not proven_at_demotion(ckpt(SaveReason.FINISH, hit=True, shadowed=True))


def test_a_demoted_branch_point_is_kept_as_proven():
    """A branch point is saved where a prompt leaves a prefix an earlier one read: two requests read its prefix,
    so the host keeps it one host capacity longer, as one a hit proved, though it was never hit; the unhit
    turn ends demoted with it are not."""
    cache, driver = make()
    host = cache._life.host
    driver.run(CacheRequest("a", tuple(range(10))))
    driver.run(CacheRequest("c", tuple(range(6)) + (90, 91, 92, 93, 94)), branch=True)
    (branch,) = [c for c in cache._life.published() if c.reason is SaveReason.BRANCH_POINT]
    assert branch.step == 6 and not branch.was_hit
    fill_device(driver)
    fill_device(driver, first=200)
    assert branch.on_host and host.queues.is_proven(branch)
    turn_ends = [c for c in host.order.values() if c.reason.is_turn_end]
    assert turn_ends and not any(host.queues.is_proven(c) for c in turn_ends)
    assert all(host.queues.due(branch) > host.queues.due(c) for c in turn_ends)
    cache.check_integrity()


@pytest.mark.parametrize("first_turn", ["hit", "not hit", "hit and gone past"])
def test_the_host_keeps_what_a_hit_proved_longer(first_turn):
    """Three chains of 10 tokens (2 nodes, a page and a frozen tail: 4 blocks each) are demoted in turn to a host
    of 9 blocks, so the third's demotion drops one of the first two. With the order of demotion that is the first
    (`a`); when a hit proved `a` before it was demoted, `b` goes instead, unless the hit was a continuation that
    went past `a` (a deeper turn end of its chain: `a` is shadowed, its next turn has come)."""
    cache, driver = make(num_blocks=8, host_blocks=9)
    host = cache._life.host
    a = tuple(range(10))
    driver.run(CacheRequest("a", a))
    (ckpt_a,) = cache._life.published()
    if first_turn != "not hit":
        nxt = CacheRequest("a2", a + (99, 98))
        assert driver.admit(nxt).cached_len == 10
        if first_turn == "hit":
            driver.step("a2", [99])  # no save: nothing goes past `a`
            cache.abort("a2")
        else:
            driver.step("a2", [99, 98], [("prefill_end",)])
            cache.finish("a2")
        assert ckpt_a.was_hit and ckpt_a.shadowed == (first_turn == "hit and gone past")
    for first in (100, 200, 300):
        driver.run(CacheRequest(("filler", first), tuple(range(first, first + 10))))
    probe = cache.match(CacheRequest("probe-a", a + (1,)))
    kept_a = probe.cached_len == 10
    cache.release_match(probe)
    probe = cache.match(CacheRequest("probe-b", tuple(range(100, 111))))
    kept_b = probe.cached_len == 10
    cache.release_match(probe)
    assert cache.stats.num_host_dropped >= 1
    assert (kept_a, kept_b) == ((True, False) if first_turn == "hit" else (False, True))
    assert host.queues.is_proven(ckpt_a) if kept_a else True
    cache.check_integrity()


def test_a_fall_out_never_reads_a_host_page_its_plan_has_not_written():
    """A checkpoint demoted before its finish copy ran gets HOST_FINISH in the next plan; until that plan has run
    its host pages hold nothing of it, so a fall-out of it in the same step (its bytes read at once, for the
    disk) is refused, as one whose HOST_SAVE is pending is; after the plan it is what a tier behind keeps."""
    cache = PrefixCache(CacheConfig(block_size=16, num_blocks=6, num_slots=2, state_pages=1, host_blocks=8))
    driver = Driver(cache)
    driver.admit(CacheRequest("a", tuple(range(37))))
    driver.step("a", list(range(37)), [("prefill_end",)])
    cache.finish("a")
    assert cache.admit(cache.match(CacheRequest("b", tuple(range(100, 148)))), 48) is not None
    driver.device.run_step({"b": list(range(100, 148))})  # a's checkpoint demoted: HOST_SAVE ran
    host = cache._life.host
    (ckpt,) = host.order.values()
    page = ckpt.pages[0]
    assert host.fall_out(ckpt) is not None
    host.finishing(page)
    assert host.fall_out(ckpt) is None
    host.end_step()
    assert host.fall_out(ckpt) is not None


# ---- probe (POST /v1/cache/match's dry run) with a host tier --------------------------------------------------


@pytest.mark.parametrize("pays", [True, False], ids=["promotion-pays", "promotion-does-not-pay"])
def test_probe_predicts_the_host_hit_the_request_then_gets(pays):
    """A prompt whose chain and checkpoint were demoted: `probe` answers what the request then gets (the host hit
    when its promotion pays, else the device's miss), and changes nothing: no pin, no hold, no recency change."""
    cost = None if pays else CostModel(host_bandwidth=1.0, device_flops=1e12)
    cache, driver = make(cost=cost)
    prompt = tuple(range(10))  # 2 full blocks + 2 tail tokens: a prefill-end checkpoint at 10
    driver.run(CacheRequest("a", prompt))
    fill_device(driver)
    assert cache.stats.num_host_checkpoints >= 1 and cache.probe(CacheRequest("q", prompt + (1,))).kv_len == 0
    before = fingerprint(cache)
    probe = cache.probe(CacheRequest("q", prompt + (1, 2)))
    assert fingerprint(cache) == before
    cache.check_integrity()
    request = CacheRequest("b", prompt + (1, 2))
    match = driver.admit(request)
    assert probe.cached_len == match.cached_len == (10 if pays else 0)
    assert cache.stats.num_host_hits == int(pays)
    driver.step("b", request.prompt_ids[match.cached_len:])
    cache.finish("b")
    cache.check_integrity()


def test_probe_does_not_fault_in_from_the_disk_tier():
    """With a tier behind the host, `probe` reads neither it nor its host tier's state changes (a match would hang
    the disk's checkpoint in the host tier first): it answers what the device and host tiers hold."""
    disk = FakeDisk()
    cache, driver = with_disk(disk, num_blocks=8, host_blocks=12)
    prompts = [tuple(range(i * 50, i * 50 + 10)) for i in range(6)]
    for i, prompt in enumerate(prompts):
        driver.run(CacheRequest(("p", i), prompt))
        fill_device(driver, first=1000 + 100 * i)
    restarted, _ = with_disk(FakeDisk(list(disk.kept)), num_blocks=16, host_blocks=64)
    stored = disk.kept[0][0]
    prompt = tuple(t for _, tokens in stored.chain for t in tokens) + stored.tail_ids
    before = fingerprint(restarted)
    assert restarted.probe(CacheRequest("q", prompt + (7, 8))).cached_len == 0
    assert fingerprint(restarted) == before
    restarted.check_integrity()


X_TAIL = (10, 11, 12, 13, 20, 21)


def _shared_demoted_in_this_pass():
    """x's checkpoint at 10 chains through `shared` (0..3) and is on the host; in the pass being planned, q's
    allocation demotes `shared` itself (a's checkpoint at 6 with it): its HOST_SAVE is in the plan. Returns
    (disk, cache, driver, shared, x's host checkpoint, the host node of `shared`)."""
    disk = FakeDisk()
    cache, driver = with_disk(disk, num_blocks=8, host_blocks=16)
    host = cache._life.host
    shared = (0, 1, 2, 3)
    driver.run(CacheRequest("x", shared + X_TAIL))
    driver.run(CacheRequest("a", shared + (30, 31)))
    driver.run(CacheRequest("filler", tuple(range(100, 109))))  # demotes x's chain below `shared`
    (ckpt_x,) = (c for c in host.order.values() if c.step == 10)
    assert cache.admit(cache.match(CacheRequest("q", tuple(range(200, 210))))) is not None
    assert cache.ensure_capacity("q", 10)
    (node,) = (n for n in host.iter_nodes() if n.token_ids == shared)
    return disk, cache, driver, shared, ckpt_x, node


def test_a_fall_out_never_reads_a_host_block_a_promotion_in_its_pass_is_loaded_from_before_its_save():
    """In one scheduling pass a node is demoted (HOST_SAVE device -> host block h queued), promoted back (HOST_LOAD
    h -> device queued), then the host's own eviction drops an older host checkpoint whose chain runs through it:
    h holds nothing of the node until the plan runs, so that fall-out is not kept (a tier behind that reads h at
    once, as the engine's does, would write stale bytes under a valid checksum). After the plan it is kept, with
    the right bytes (`FakeDisk` checks every fall-out it is handed). Found by the scheduler state machine with a
    tier behind the host (hunt 128)."""
    disk, cache, driver, shared, ckpt_x, node = _shared_demoted_in_this_pass()
    host = cache._life.host
    assert node.host_block in host._saves
    match = cache.match(CacheRequest("b", shared + (30, 31, 40)))
    assert match.cached_len == 6 and cache.admit(match) is not None  # promotes `shared` back from that host block
    disk.keep(host.fall_out(ckpt_x))  # what the host's own eviction would hand it now
    assert disk.num_not_kept == 1 and not disk.kept
    driver.device.run_step({"q": list(range(200, 210)), "b": [40]})
    driver.device.check()
    cache.check_integrity()
    assert host.make_room(host.num_free + 1)  # drops x's checkpoint, the one due first
    assert ckpt_x.ckpt_id not in host.order
    assert [stored.step for stored, _, _ in disk.kept] == [10]  # kept, its bytes checked


def test_a_fall_out_through_a_node_demoted_in_its_pass_reads_it_from_the_device_block_its_save_reads():
    """In one scheduling pass a node is demoted (HOST_SAVE device block d -> host block h queued), then the host's
    own eviction drops an older host checkpoint whose chain runs through it. Such a fall-out was not kept (up to a
    quarter of the host's drops on small pools, hunt 184); h holds nothing yet, but d still holds the node's KV
    (the save is the plan's first copy: nothing writes d before it), so the fall-out names d for that block and is
    kept with the right bytes (`FakeDisk` reads memory as it is at that moment, as the engine's keeper does, and
    checks it), and a restarted cache serves it."""
    disk, cache, driver, shared, ckpt_x, node = _shared_demoted_in_this_pass()
    host = cache._life.host
    x_prompt = shared + X_TAIL
    device_block = host._saves[node.host_block]  # the save is in the plan being built
    fall_out = host.fall_out(ckpt_x)
    assert fall_out is not None and (fall_out.blocks[0].on_host, fall_out.blocks[0].block_id) == (False, device_block)
    assert host.make_room(host.num_free + 1)  # drops x's checkpoint, the one due first, in the same pass
    assert ckpt_x.ckpt_id not in host.order
    assert disk.num_not_kept == 0 and [stored.step for stored, _, _ in disk.kept] == [10]  # its bytes checked
    driver.device.run_step({"q": list(range(200, 210))})
    driver.device.check()
    cache.check_integrity()

    restarted, again = with_disk(FakeDisk(list(disk.kept)), num_blocks=16, host_blocks=64)
    match = again.run(CacheRequest("back", x_prompt + (7, 8)), decode=[3])  # checks every block's bytes
    assert match.cached_len == 10 and restarted.stats.num_promoted_checkpoints == 1
    restarted.check_integrity()


def test_a_disk_checkpoint_too_large_for_the_host_tier_gives_way_to_a_shallower_one():
    """The tier behind offers a prompt's checkpoints deepest first; one whose chain and state do not fit in the host
    tier at once gives way to the next (a host tier smaller than the deepest one's need made the disk tier
    write-only for long prompts: no hit at all after a restart)."""
    disk = FakeDisk()
    cache, driver = with_disk(disk, num_blocks=24, host_blocks=32)
    prompt = tuple(range(26))  # 6 blocks + a 2-token tail
    driver.run(CacheRequest("a", prompt), chunk=8)  # chunk ends at 8, 16, 24, then the prompt's end at 26
    assert cache.keep_behind() >= 4
    assert sorted(stored.step for stored, _, _ in disk.kept) == [8, 16, 24, 26]
    # a restart with 4 host blocks: 26 needs 6 chain blocks + a page + its frozen tail, 16 needs 4 + 1; 8 needs 3
    restarted, again = with_disk(FakeDisk(list(disk.kept)), num_blocks=24, host_blocks=4)
    match = again.run(CacheRequest("b", prompt + (7,)), decode=[3])  # checks every block's bytes
    assert match.cached_len == 8 and restarted.stats.num_promoted_checkpoints == 1
    restarted.check_integrity()


def test_a_record_of_another_prompt_from_the_tier_behind_is_not_adopted():
    """What the tier behind answers is checked against the prompt (chain hashes and tokens, tail), as the device
    trie checks tokens after a hash match: a record that disagrees is not hung in the host tier, nor read."""
    disk = FakeDisk()
    cache, driver = with_disk(disk, num_blocks=8, host_blocks=16)
    driver.run(CacheRequest("a", tuple(range(10))))
    assert cache.keep_behind() == 1
    (stored, blocks, state), = disk.kept
    prompt = tuple(range(10, 20))  # another prompt: the record claims its chain anyway
    other = CacheRequest("b", prompt + (1,))
    restarted, again = with_disk(FakeDisk([(stored, blocks, state)]), num_blocks=8, host_blocks=16)
    restarted._life.host.behind.find = lambda request, block_size, max_step: [stored]
    before = fingerprint(restarted)
    match = restarted.match(other)
    assert match.cached_len == 0
    restarted.release_match(match)
    assert fingerprint(restarted) == before and not restarted._life.host.behind.asked


def test_a_failed_write_of_a_disk_checkpoint_into_host_memory_hangs_nothing():
    """The tier behind's `placed` (the engine's HostPool.write of a disk checkpoint's bytes) raising: the error goes
    to the caller and the host tier holds nothing of that checkpoint (it was hung before its bytes were written,
    so the same prompt was then served from host blocks holding garbage); the next match faults it in again."""
    disk = FakeDisk()
    cache, driver = with_disk(disk, num_blocks=8, host_blocks=16)
    prompt = tuple(range(10))
    driver.run(CacheRequest("a", prompt))
    assert cache.keep_behind() == 1
    restarted, again = with_disk(FakeDisk(list(disk.kept)), num_blocks=8, host_blocks=16)
    before = fingerprint(restarted)
    restarted._life.host.behind.fail_placed = MemoryError("host memory")
    with pytest.raises(MemoryError, match="host memory"):
        restarted.match(CacheRequest("b", prompt + (1,)))
    assert fingerprint(restarted) == before  # no host node, no checkpoint, every host block free
    again.device.check()
    restarted.check_integrity()
    match = again.run(CacheRequest("b", prompt + (1,)), decode=[3])  # checks the bytes it is served
    assert match.cached_len == 10 and restarted.stats.num_promoted_checkpoints == 1


def test_clearing_the_cache_clears_the_tier_behind():
    """`PrefixCache.clear` (`LLM.reset_prefix_cache`) drops what the tier behind keeps too: the same prompt is then
    a miss in every tier."""
    disk = FakeDisk()
    cache, driver = with_disk(disk, num_blocks=8, host_blocks=16)
    prompt = tuple(range(10))
    driver.run(CacheRequest("a", prompt))
    assert cache.keep_behind() == 1 and disk.kept
    cache.clear()
    assert not disk.kept
    assert cache.match(CacheRequest("b", prompt + (1,))).cached_len == 0
