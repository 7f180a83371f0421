"""One owner of a sequence's tokens: the cache reads the scheduler's `Seq.token_ids` (the very list, through
admission, preemption and re-admission), and each step's known tokens reach both in one call (`Scheduler.accept`
-> `PrefixCache.accept`); a token changed behind the cache's back fails `check_integrity`."""

from __future__ import annotations

import pytest

from hybridcache.cache import PENDING_TOKEN, CacheConfig, CacheRequest, IntegrityError, PrefixCache
from hybridcache.sampling import SamplingParams
from hybridcache.scheduler.save_plan import checkpoint_policy
from hybridcache.scheduler.scheduler import Accepted, Scheduler
from hybridcache.scheduler.sequence import Seq, SeqStatus
from tests.cache.fake_engine import FakeDevice

B = 4


def make_seq(seq_id: int, prompt: list[int], max_tokens: int = 16) -> Seq:
    return Seq(seq_id=seq_id, request_id=str(seq_id), index=0, token_ids=list(prompt), prompt_len=len(prompt),
               params=SamplingParams(temperature=0, max_tokens=max_tokens), generator=None, arrival=seq_id)


def make_scheduler(num_blocks: int = 64, k: int = 0) -> tuple[Scheduler, FakeDevice]:
    policy = checkpoint_policy("hybridcache")
    cache = PrefixCache(CacheConfig(block_size=B, num_blocks=num_blocks, num_slots=4, num_speculative_tokens=k,
                                    full_prompt_hits=policy.full_prompt_hits))
    return Scheduler(cache, policy, max_num_seqs=4, max_num_batched_tokens=64, num_speculative_tokens=k), \
        FakeDevice(cache)


def shares_lists(scheduler: Scheduler) -> bool:
    return all(scheduler.cache._seqs[seq.seq_id].token_ids is seq.token_ids for seq in scheduler.running)


def step(scheduler: Scheduler, device: FakeDevice):
    output = scheduler.schedule()
    device.execute_step(output)
    for chunk in output.chunks:
        chunk.seq.num_computed = chunk.end - chunk.num_drafts
    return output


def test_the_replaced_calls_are_gone():
    for owner, name in ((PrefixCache, "fill_pending"), (PrefixCache, "accept_drafts"), (Scheduler, "fill_token"),
                        (Scheduler, "accept_drafts")):
        assert not hasattr(owner, name), name


def test_the_cache_reads_the_schedulers_list_through_preemption_and_readmission():
    scheduler, device = make_scheduler(num_blocks=7)
    first, second = make_seq(0, list(range(10))), make_seq(1, list(range(50, 60)))
    scheduler.add(first)
    scheduler.add(second)
    waited: set[Seq] = set()
    readmitted = False
    for token in range(100, 116):
        output = step(scheduler, device)
        assert shares_lists(scheduler)
        readmitted |= any(seq in waited for seq in scheduler.running)
        sampled = [c.seq for c in output.chunks if c.samples] + [s.seq for s in output.samples]
        scheduler.accept({seq: Accepted(token) for seq in sampled})  # synchronous: appended, not fed yet
        waited |= {seq for seq in (first, second) if seq.status is SeqStatus.WAITING and seq.num_tokens > 10}
        for seq in sampled:
            assert seq.token_ids[-1] == token
            if seq.status is SeqStatus.RUNNING:  # the cache sees the sample only once it is fed
                assert scheduler.cache.num_computed(seq.seq_id) == seq.num_tokens - 1
        scheduler.check_integrity()
        device.check()
    assert readmitted and scheduler.num_preemptions > 0  # preempted, then re-admitted with the same list
    assert first.num_tokens > 10 and second.num_tokens > 10


def test_async_pending_token_and_verify_row_reach_both_in_one_call():
    scheduler, device = make_scheduler(k=2)
    seq = make_seq(0, list(range(7)))
    scheduler.add(seq)
    step(scheduler, device)  # prefill 0..6, samples position 7
    seq.token_ids.append(PENDING_TOKEN)  # async: t+1 is planned before t's sample is on the host
    output = scheduler.schedule()
    assert output.chunks[0].token_ids == (PENDING_TOKEN,)
    cache = scheduler.cache
    assert cache.num_computed(0) == 8 and cache.stats.num_nodes == 1  # block 1 (4..7) held back
    scheduler.accept({seq: Accepted(70)})  # t's token: the list's -1 becomes 70, and the cache takes it
    assert seq.token_ids[7] == 70 and cache._seqs[0].token_ids is seq.token_ids
    assert cache.stats.num_nodes == 2 and cache._seqs[0].nodes[1].token_ids == (4, 5, 6, 70)
    device.execute_step(output)  # (the device reads t's token when it runs t+1)
    seq.num_computed = 8
    scheduler.accept({seq: Accepted(80)})  # t+1's sample, not fed yet: appended, nothing for the cache
    seq.drafts = [81, 82]
    output = step(scheduler, device)  # verify row 80 | 81 82
    assert output.chunks[0].num_drafts == 2 and seq.token_ids[-1] == 80
    device.execute_rollback(scheduler.accept({seq: Accepted(90, kept=(81,))}))
    assert seq.token_ids[8:] == [80, 81, 90] and seq.num_computed == 10 == cache.num_computed(0)
    scheduler.check_integrity()
    device.check()


def test_a_token_changed_behind_the_caches_back_fails_integrity():
    scheduler, device = make_scheduler()
    seq = make_seq(0, list(range(9)))
    scheduler.add(seq)
    step(scheduler, device)
    scheduler.check_integrity()
    seq.token_ids[5] = 99  # block 1 (4..7) is a trie node
    with pytest.raises(IntegrityError, match="token list differs"):
        scheduler.check_integrity()
    seq.token_ids[5] = 5
    seq.token_ids[8] = PENDING_TOKEN  # a computed token, not the pending one
    with pytest.raises(IntegrityError, match="known computed tokens"):
        scheduler.check_integrity()


def test_bad_token_lists_and_tokens_are_refused_and_change_nothing():
    cache = PrefixCache(CacheConfig(block_size=B, num_blocks=16, num_slots=2))
    prompt = (1, 2, 3, 4, 5)
    match = cache.match(CacheRequest("a", prompt), max_step=0)
    with pytest.raises(ValueError, match="does not start with its prompt"):
        cache.admit(match, len(prompt), [1, 2, 3])
    owned = list(prompt)
    assert cache.admit(match, len(prompt) + 1, owned) is not None
    cache.commit_step({"a": prompt})
    owned.append(PENDING_TOKEN)
    cache.commit_step({"a": (PENDING_TOKEN,)})
    owned[-1] = 7  # the owner writes its token first; the cache checks it
    with pytest.raises(ValueError, match="holds others"):
        cache.accept({"a": (8,)})
    assert cache._seqs["a"].pending and cache.stats.num_nodes == 1
    cache.check_integrity()
    cache.accept({"a": (7,)})
    assert cache._seqs["a"].token_ids is owned and owned == [1, 2, 3, 4, 5, 7]
    assert cache.stats.num_nodes == 1 and not cache._seqs["a"].pending
    owned.append(9)
    with pytest.raises(ValueError, match="differ from its prompt or token list"):
        cache.commit_step({"a": (8,)})  # position 6 holds 9
    cache.commit_step({"a": (9,)})
    assert owned == [1, 2, 3, 4, 5, 7, 9] and cache.num_computed("a") == 7
    cache.check_integrity()
