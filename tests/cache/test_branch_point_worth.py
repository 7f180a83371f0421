"""A branch point is worth its state by value: the step d where a prompt leaves cached content is saved when the
prefill it would have saved the n prompts already seen leaving there adds up to a state's worth,
d x n >= `CacheConfig.min_branch_point_step` (`PrefixCache.saves_branch_point`). n is
`MatchResult.divergence_count`: the child blocks and checkpoint tails that agree with the prompt up to d and no
further, on the device and in the host tier (a tail on the way of another continuation counted with it). A
shallow system prompt shared by enough conversations is thus saved (and hit) where a flat floor of d >= the
state's tokens never saved it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from hybridcache.cache import CacheConfig, CacheRequest, PrefixCache
from hybridcache.cache.matching import Below, Divergence, divergence_at
from hybridcache.sampling import SamplingParams
from hybridcache.scheduler.save_plan import checkpoint_policy
from hybridcache.scheduler.scheduler import Scheduler
from hybridcache.scheduler.sequence import Seq
from tests.cache.checked_evictor import check_picks
from tests.cache.conftest import make_driver, tokens
from tests.cache.fake_engine import Driver

SYSTEM = tokens(13, seed=1)  # a system prompt ending inside the first block (B = 16)


def divergence(cache: PrefixCache, prompt: tuple[int, ...]) -> tuple[int, int, int]:
    """(cached_len, divergence_len, divergence_count) of `prompt`, the match released."""
    match = cache.match(CacheRequest("probe", prompt))
    cache.release_match(match)
    return match.cached_len, match.divergence_len, match.divergence_count


def test_each_conversation_that_left_a_prompt_there_counts_once():
    driver = make_driver()
    driver.run(CacheRequest("a", SYSTEM + (50, 51, 52) + tokens(10, seed=2)))
    assert divergence(driver.cache, SYSTEM + (70,) * 10) == (0, 13, 1)
    # b leaves a at 15: its branch point (a checkpoint whose tail is SYSTEM + 50, 51) lies on the way of both
    driver.run(CacheRequest("b", SYSTEM + (50, 51, 60) + tokens(10, seed=3)), branch=True)
    assert driver.cache.stats.saves_by_reason["branch_point"] == 1
    assert divergence(driver.cache, SYSTEM + (70,) * 10) == (0, 13, 2)  # a and b, not the tail as a third
    assert divergence(driver.cache, SYSTEM + (50, 80) + (70,) * 8) == (0, 14, 2)
    assert divergence(driver.cache, SYSTEM + (50, 51, 60, 81) + (70,) * 8) == (15, 16, 1)  # b's block, then its tail


def test_at_a_block_boundary_every_child_block_and_tail_leaves_the_prompt():
    driver = make_driver()
    system = tokens(16, seed=4)
    driver.run(CacheRequest("long", system + tokens(20, seed=5)))  # a child block of the system prompt's node
    for i in range(2):  # prompts ending in the next block: their prefill-end checkpoints' tails hang off the node
        driver.run(CacheRequest(("short", i), system + tokens(8, seed=10 + i)))
    assert divergence(driver.cache, system + (999,) * 8) == (0, 16, 3)


def test_the_value_rule():
    cache = PrefixCache(CacheConfig(block_size=16, num_blocks=16, num_slots=4, min_branch_point_step=40))
    assert not cache.saves_branch_point(39) and cache.saves_branch_point(40)  # one continuation: the step alone
    assert not cache.saves_branch_point(13, 3) and cache.saves_branch_point(13, 4)  # 39 and 52 tokens of prefill
    assert PrefixCache(CacheConfig(block_size=16, num_blocks=16, num_slots=4)).saves_branch_point(1, 1)


def _conversation(seq_id: int) -> Seq:
    prompt = list(SYSTEM) + [500 + 10 * seq_id + j for j in range(7)]
    return Seq(seq_id=seq_id, request_id=str(seq_id), index=0, token_ids=prompt, prompt_len=len(prompt),
               params=SamplingParams(temperature=0), generator=None, arrival=seq_id)


@pytest.mark.parametrize(("floor", "cached"), [
    (27, [0, 0, 0, 0, 13, 13]),  # 13 x 3 >= 27: the fourth conversation saves the branch point, the fifth hits
    (40, [0, 0, 0, 0, 0, 13]),  # 13 x 4 >= 40: the fifth saves it
    (13 * 6, [0] * 6),  # five conversations before the sixth are too few
], ids=["by-the-4th", "by-the-5th", "too-few"])
def test_a_shallow_system_prompt_is_saved_once_enough_conversations_left_it(floor, cached):
    """Six conversations on a 13-token system prompt, the scheduler over a real cache (no model): with a flat floor
    of `floor` tokens none would ever be saved there."""
    cache = check_picks(PrefixCache(CacheConfig(block_size=16, num_blocks=64, num_slots=4,
                                                min_branch_point_step=floor)))
    scheduler = Scheduler(cache, checkpoint_policy("hybridcache"), max_num_seqs=4, max_num_batched_tokens=1000)
    seqs = [_conversation(i) for i in range(6)]
    for seq in seqs:
        scheduler.add(seq)
        while seq.num_computed < seq.prompt_len:
            for chunk in scheduler.schedule().chunks:
                chunk.seq.num_computed = chunk.end
            cache.check_integrity()
        seq.finish_reason = "stop"
        scheduler.finish(seq)
    assert [seq.num_cached for seq in seqs] == cached
    assert cache.stats.saves_by_reason.get("branch_point", 0) == (1 if any(cached) else 0)
    cache.check_integrity()


def test_continuations_in_the_host_tier_count_too():
    """a's chain is demoted to the host tier; c then puts the shared first block back on the device (absorbing
    its host twin) and leaves a at 6 with a device block: a prompt leaving both there counts both."""
    cache = PrefixCache(CacheConfig(block_size=4, num_blocks=8, num_slots=2, state_pages=1, host_blocks=16))
    check_picks(cache)
    driver = Driver(cache)
    driver.run(CacheRequest("a", tuple(range(10))))
    driver.run(CacheRequest("filler", tuple(range(100, 120))), decode=[7])
    assert cache.stats.num_host_nodes >= 2
    driver.run(CacheRequest("c", tuple(range(6)) + (70, 71, 72, 73, 74)))
    assert divergence(cache, tuple(range(6)) + (99, 98, 97)) == (0, 6, 2)
    cache.check_integrity()


class _Owner:
    """A stand-in for a trie node or a host `Hanging`: child blocks by hash, checkpoints with tails."""

    def __init__(self, blocks: list[tuple[int, ...]], tails: list[tuple[int, ...]]) -> None:
        self.children = {i: [SimpleNamespace(token_ids=b, spans=())] for i, b in enumerate(blocks)}
        self.tails = [SimpleNamespace(tail_ids=t, tail_spans=()) for t in tails]

    def iter_checkpoints(self):
        return iter(self.tails)

    def below(self) -> Below:
        return Below(self, lambda token: [c for b in self.children.values() for c in b if c.token_ids[0] == token])


def test_a_tail_in_one_tier_on_the_way_of_a_block_in_the_other_is_one_continuation():
    """One trie position in both tiers (a device node and the host tier's part of it): a branch point's checkpoint
    still on the device whose sequence's next block was demoted is one continuation, not two."""
    device, host = _Owner([], [(4, 5)]), _Owner([(4, 5, 6, 7)], [])
    request = CacheRequest("p", (0, 1, 2, 3, 4, 9, 9, 9))
    assert divergence_at(request, 4, 4, [device.below(), host.below()], max_step=7) == Divergence(5, 1)
    assert divergence_at(request, 4, 4, [device.below()], max_step=7) == Divergence(5, 1)
    other = _Owner([(4, 8, 8, 8)], [(4, 7)])  # two more continuations leaving the prompt at 5
    assert divergence_at(request, 4, 4, [device.below(), host.below(), other.below()], 7) == Divergence(5, 3)
    # at the block boundary: every block and non-empty tail, a tail on the way of a block counted with it
    request = CacheRequest("q", (0, 1, 2, 3, 9, 9, 9, 9))
    assert divergence_at(request, 4, 4, [device.below(), host.below(), other.below()], 7) == Divergence(4, 3)
