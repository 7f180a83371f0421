"""Matching: step geometry, misses, collisions, multimodal identity, adapters, routed experts."""

from __future__ import annotations

import pytest

from hybridcache.cache import CacheConfig, CacheRequest, CopyKind, MultimodalSpan, PrefixCache
from tests.cache.conftest import make_driver, tokens
from tests.cache.fake_engine import Driver

B = 32


def save_at(driver: Driver, prompt: tuple[int, ...], step: int, rid: str = "src", **kw) -> None:
    """Prefill `prompt` with a chunk ending at `step` (a chunk_end save there), then abort it."""
    request = CacheRequest(rid, prompt, **kw)
    driver.admit(request)
    driver.step(rid, prompt[:step], [("chunk_end",)])
    driver.cache.abort(rid)
    driver.cache.check_integrity()


@pytest.mark.parametrize("step", [5, B - 1, B, B + 1, 2 * B, 3 * B + 17], ids=lambda s: f"step{s}")
def test_step_geometry_hits_exactly(step):
    driver = make_driver(block_size=B)
    base = tokens(4 * B, seed=1)
    save_at(driver, base, step)
    request = CacheRequest("r", base[:step] + tokens(10, seed=2))
    match = driver.cache.match(request)
    assert match.cached_len == step
    assert len(match.block_ids) == step // B
    admitted = driver.cache.admit(match)
    assert admitted.num_computed == step
    assert len(admitted.block_ids) == step // B + (1 if step % B else 0)
    copies = driver.step("r", request.prompt_ids[step:], [("prefill_end",)])
    assert len(copies.pairs(CopyKind.STATE_RESTORE)) == 1
    if step % B:
        frozen, private = copies.pairs(CopyKind.KV_RESTORE)[0]
        assert private == admitted.block_ids[-1] and private not in match.block_ids and frozen != private
    else:
        assert copies.pairs(CopyKind.KV_RESTORE) == []
    assert driver.cache.stats.hits_by_reason == {"chunk_end": 1}


def test_partial_hit_private_block_stays_writable():
    driver = make_driver(block_size=16)
    prompt = tokens(40, seed=3)
    driver.run(CacheRequest("a", prompt), decode=[1, 2, 3])
    request = CacheRequest("b", prompt + (1, 2, 3) + (9, 9, 9, 9, 9))
    match = driver.admit(request)
    assert match.cached_len == 43 and match.checkpoint_reason.value == "finish"
    private = driver.cache.block_ids("b")[2]
    assert driver.cache._life.blocks.ref_counts[private] == 1
    driver.step("b", request.prompt_ids[43:])
    for token in range(20):
        driver.step("b", [token])  # the fake device checks every position written and read
    assert driver.cache.num_computed("b") == 68


def test_tail_mismatch_and_full_prefix_mismatch_miss():
    driver = make_driver(block_size=16)
    prompt = tokens(30, seed=4)
    save_at(driver, prompt, 21)
    tail_differs = prompt[:18] + (5000,) + prompt[19:]
    block_differs = prompt[:3] + (5000,) + prompt[4:]
    for rid, p in [("tail", tail_differs), ("block", block_differs)]:
        match = driver.cache.match(CacheRequest(rid, p))
        assert match.cached_len == 0 and match.checkpoint_id is None
        driver.cache.release_match(match)
    assert driver.cache.match(CacheRequest("same", prompt)).cached_len == 21


def test_hash_collision_is_verified_exactly():
    cache = PrefixCache(CacheConfig(block_size=8, num_blocks=64, num_slots=16), hash_fn=lambda p, t, s: 7)
    driver = Driver(cache)
    p1, p2 = tokens(20, seed=5), tokens(20, seed=6)
    save_at(driver, p1, 13, rid="s1")
    save_at(driver, p2, 11, rid="s2")
    assert cache.match(CacheRequest("x", p1)).cached_len == 13
    assert cache.match(CacheRequest("y", p2)).cached_len == 11
    other = cache.match(CacheRequest("z", tokens(20, seed=7)))
    assert other.cached_len == 0
    cache.check_integrity()


def test_multimodal_content_and_boundaries():
    driver = make_driver(block_size=16)
    prompt = tokens(60, seed=8)
    image = MultimodalSpan(10, 30, "cat")
    save_at(driver, prompt, 35, rid="s", mm_spans=[image])
    same = driver.cache.match(CacheRequest("same", prompt, mm_spans=[image]))
    assert same.cached_len == 35
    other_image = driver.cache.match(CacheRequest("dog", prompt, mm_spans=[MultimodalSpan(10, 30, "dog")]))
    assert other_image.cached_len == 0
    no_image = driver.cache.match(CacheRequest("none", prompt))
    assert no_image.cached_len == 0
    # a save strictly inside a span is refused; the boundary itself is fine
    request = CacheRequest("in", tokens(60, seed=9), mm_spans=[MultimodalSpan(10, 30, "x")])
    driver.admit(request)
    assert driver.cache.ensure_capacity("in", 20)
    assert not driver.cache.reserve_save("in", 20, "chunk_end")
    assert driver.cache.stats.declined_saves["unsafe"] == 1
    driver.step("in", request.prompt_ids[:30], [("chunk_end",)])
    assert driver.cache.match(CacheRequest("in2", request.prompt_ids, mm_spans=request.mm_spans)).cached_len == 30


def test_match_skips_checkpoints_inside_a_span_of_the_request():
    driver = make_driver(block_size=16)
    prompt = tokens(60, seed=10)
    save_at(driver, prompt, 20)
    # same tokens, but this request has an image over [18, 25): step 20 is inside it
    match = driver.cache.match(CacheRequest("r", prompt, mm_spans=[MultimodalSpan(18, 25, "img")]))
    assert match.cached_len == 0


def test_adapters_are_separated():
    driver = make_driver(block_size=16)
    prompt = tokens(40, seed=11)
    save_at(driver, prompt, 33, adapter="lora-a")
    assert driver.cache.match(CacheRequest("base", prompt)).cached_len == 0
    assert driver.cache.match(CacheRequest("b", prompt, adapter="lora-b")).cached_len == 0
    assert driver.cache.match(CacheRequest("a", prompt, adapter="lora-a")).cached_len == 33


def test_routed_experts_fail_closed():
    driver = make_driver(block_size=16)
    prompt = tokens(50, seed=12)
    request = CacheRequest("src", prompt)
    driver.admit(request)
    driver.step("src", prompt[:32], [("chunk_end",)])   # aligned: no tail
    driver.step("src", prompt[32:40], [("chunk_end",)])  # partial, no routed-expert history
    driver.cache.abort("src")
    wants = CacheRequest("r", prompt, routed_experts=True)
    assert driver.cache.match(wants).cached_len == 32
    assert driver.cache.match(CacheRequest("plain", prompt)).cached_len == 40
    # with the history stored, the partial hit is allowed and the history is returned
    driver.admit(CacheRequest("src2", prompt, routed_experts=True))
    assert not driver.cache.reserve_save("src2", 45, "chunk_end") if driver.cache.ensure_capacity("src2", 45) else 0
    assert driver.cache.stats.declined_saves["routed_experts"] == 1
    driver.step("src2", prompt[32:45], [("chunk_end", "experts-of-tail")])
    driver.cache.abort("src2")
    match = driver.cache.match(CacheRequest("r2", prompt, routed_experts=True))
    assert match.cached_len == 45 and match.routed_experts == "experts-of-tail"


def test_never_hits_the_whole_prompt_and_branch_points_fix_identical_resend():
    driver = make_driver(block_size=16)
    prompt = tokens(40, seed=13)
    driver.run(CacheRequest("first", prompt), finish=False)
    driver.cache.abort("first")
    resend = driver.cache.match(CacheRequest("again", prompt))
    assert resend.cached_len == 0  # only the prefill-end checkpoint at 40 exists
    assert resend.divergence_len == 39
    driver.cache.release_match(resend)
    driver.run(CacheRequest("again", prompt), branch=True, finish=False)
    driver.cache.abort("again")
    third = driver.cache.match(CacheRequest("third", prompt))
    assert third.cached_len == 39 and third.checkpoint_reason.value == "branch_point"


def test_divergence_point_reported():
    driver = make_driver(block_size=16)
    shared = tokens(16 + 5, seed=14)
    driver.run(CacheRequest("a", shared + tokens(30, seed=15)))
    match = driver.cache.match(CacheRequest("b", shared + tokens(30, seed=16)))
    assert match.cached_len == 0
    assert match.divergence_len == 21


def test_same_checkpoint_restored_into_several_requests_in_one_forward():
    driver = make_driver(block_size=16)
    prompt = tokens(45, seed=17)
    save_at(driver, prompt, 37)
    cache = driver.cache
    for rid in ("x", "y", "z"):
        assert cache.admit(cache.match(CacheRequest(rid, prompt))).num_computed == 37
        assert cache.ensure_capacity(rid, 45)
    copies = driver.device.run_step({rid: prompt[37:] for rid in ("x", "y", "z")})
    driver.device.check()
    cache.check_integrity()
    assert len({src for src, _ in copies.pairs(CopyKind.STATE_RESTORE)}) == 1
    assert len({dst for _, dst in copies.pairs(CopyKind.STATE_RESTORE)}) == 3
    assert len({dst for _, dst in copies.pairs(CopyKind.KV_RESTORE)}) == 3
