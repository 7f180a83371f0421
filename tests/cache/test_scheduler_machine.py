"""Hypothesis stateful test of the scheduler over the cache and the fake device: requests with `n`
completions, identical and prefix-sharing prompts arriving together (in-flight sharing), zero-prefill hits,
finishes, aborts and memory pressure (two pools or one budget in bytes, with or without a host tier behind it,
and with or without a tier behind that, `FakeDisk`, which checks the bytes of every fall-out it is handed as
memory holds them then and hands checkpoints back on matches; learned admission or the mode's),
with synchronous or async steps (as `LLMEngine` runs them: the next step is planned with `PENDING_TOKEN` for
each token the previous one sampled, the tokens are filled in after the commit, and the previous step's
finishes come after that, so a finished sequence's row has already run one step more).
Speculative steps (k drafts, sync steps only): decoding sequences feed random drafts, keep a random prefix of
them (`Scheduler.accept`, whose rollback the fake device runs) and the fake device checks that no rejected draft's KV
or state is ever read as a sequence's, a checkpoint's or a trie node's.
Requests draw a cache salt (the fake device's identities hold it: a sequence served another salt's KV or state
fails them). After every step: `check_integrity()`, the fake device (every id holds what it claims; a
zero-prefill sample's slot holds its whole prompt's state), and no sequence waits forever.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from hybridcache.cache import PENDING_TOKEN, CacheConfig, CacheRequest, PrefixCache
from hybridcache.sampling import SamplingParams
from hybridcache.scheduler.save_plan import checkpoint_policy
from hybridcache.scheduler.scheduler import Accepted, Scheduler
from hybridcache.scheduler.sequence import Seq, SeqStatus
from tests.cache.checked_evictor import check_picks
from tests.cache.fake_engine import FakeDevice, FakeDisk

DOCS = [tuple((d * 5 + i * 3) % 13 for i in range(48)) for d in range(2)]


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(
        block_size=st.sampled_from([4, 8]),
        num_blocks=st.integers(12, 64),
        num_slots=st.integers(4, 12),
        budget=st.integers(4, 64),
        mode=st.sampled_from(["hybridcache", "hybridcache", "seed"]),
        eviction=st.sampled_from(["lru", "flop_aware"]),
        learned=st.booleans(),
        async_steps=st.booleans(),
        state_pages=st.one_of(st.none(), st.integers(1, 3)),
        host_blocks=st.sampled_from([0, 4, 16, 64]),
        spec_k=st.sampled_from([0, 0, 1, 3]),
        behind=st.booleans(),
    )
    def setup(self, block_size, num_blocks, num_slots, budget, mode, eviction, learned, async_steps, state_pages,
              host_blocks, spec_k, behind=False):
        policy = checkpoint_policy(mode)
        # two pools, or paged (the engine's way): checkpoint states in `state_pages` blocks, 3 runtime slots
        config = CacheConfig(block_size=block_size, num_blocks=num_blocks,
                             num_slots=3 if state_pages else num_slots,
                             max_checkpoints_per_anchor=policy.max_checkpoints_per_anchor, eviction=eviction,
                             full_prompt_hits=policy.full_prompt_hits,
                             admission="learned" if learned else policy.admission,
                             state_pages=state_pages, host_blocks=host_blocks if state_pages else 0,
                             num_speculative_tokens=spec_k)
        self.disk = FakeDisk() if behind and config.host_blocks else None
        self.cache = PrefixCache(config, tier_behind=self.disk)
        check_picks(self.cache)
        self.scheduler = Scheduler(self.cache, policy, max_num_seqs=3, max_num_batched_tokens=budget,
                                   num_speculative_tokens=spec_k)
        self.device = FakeDevice(self.cache)
        if self.disk is not None:
            self.disk.attach(self.device)
        self.seqs: list[Seq] = []
        self.idle_steps = 0
        self.spec_k = spec_k
        self.async_steps = async_steps and not spec_k  # (the engine runs speculative steps synchronously)
        self.launched: list[Seq] | None = None  # async: the sequences the last step sampled, not postprocessed

    @precondition(lambda self: len(self.scheduler.waiting) < 8)
    @rule(data=st.data(), n=st.integers(1, 3))
    def add(self, data, n):
        doc = data.draw(st.sampled_from(DOCS))
        prompt = doc[: data.draw(st.integers(1, len(doc)))] + tuple(data.draw(st.lists(st.integers(0, 12),
                                                                                       max_size=6)))
        salt = data.draw(st.sampled_from([None, None, "a", "b"]))  # the request's cache salt, its n completions'
        for index in range(n):
            seq = Seq(seq_id=len(self.seqs), request_id=str(len(self.seqs)), index=index, token_ids=list(prompt),
                      prompt_len=len(prompt), params=SamplingParams(temperature=0), generator=None,
                      arrival=len(self.seqs), cache_salt=salt)
            self.seqs.append(seq)
            self.scheduler.add(seq)

    @precondition(lambda self: self.scheduler.has_work or self.launched is not None)
    @rule(data=st.data())
    def step(self, data):
        previous, self.launched = self.launched, None
        pending = self._prepare(previous) if previous is not None else []
        for seq in self.scheduler.running:  # the drafter proposed some tokens (the scheduler decides where they go)
            seq.drafts = data.draw(st.lists(st.integers(0, 12), max_size=self.spec_k)) if self.spec_k else []
        try:
            output = self.scheduler.schedule()
        except RuntimeError:  # nothing fits even alone: too small a pool for this prompt; drop it
            if previous is not None:  # (the engine first finishes the step before; the next call raises again)
                self._complete(previous, pending, data)
                return
            seq = self.scheduler.waiting[0]
            seq.finish_reason = "abort"
            self.scheduler.finish(seq)
            return
        # the device reads the previous step's tokens when it runs this one
        self.scheduler.accept({seq: Accepted(data.draw(st.integers(0, 12))) for seq, _position in pending})
        self.device.execute_step(output)
        self.idle_steps = self.idle_steps + 1 if output.is_empty and previous is None else 0
        if previous is not None:
            self._complete(previous, [], data)
        sampled = [c.seq for c in output.chunks if c.samples] + [s.seq for s in output.samples]
        for chunk in output.chunks:
            if not chunk.seq.is_finished:
                chunk.seq.num_computed = chunk.end - chunk.num_drafts
        verified = {c.seq: list(c.token_ids[c.num_tokens - c.num_drafts:]) for c in output.chunks if c.num_drafts}
        if verified:  # keep a random prefix of each row's drafts
            kept = {seq: Accepted(kept=tuple(drafts[:data.draw(st.integers(0, len(drafts)))]))
                    for seq, drafts in verified.items()}
            self.device.execute_rollback(self.scheduler.accept(kept))
        if self.async_steps:
            self.launched = sampled
        else:
            for seq in sampled:
                seq.token_ids.append(data.draw(st.integers(0, 12)))
            self._finish_some(sampled, data)
        self.device.check()

    def _prepare(self, previous: list[Seq]) -> list[tuple[Seq, int]]:
        """Async: each live sequence of `previous` gets `PENDING_TOKEN`; one that reaches its length limit with
        it is retired before the next step is planned."""
        pending = []
        for seq in previous:
            if seq.is_finished:
                continue
            pending.append((seq, seq.num_tokens))
            seq.token_ids.append(PENDING_TOKEN)
            if len(seq.output_ids) >= 4:
                seq.finish_reason = "length"
                self.scheduler.finish(seq)
        return pending

    def _complete(self, previous: list[Seq], pending: list[tuple[Seq, int]], data) -> None:
        """Async: the tokens of `previous` (those still pending) are filled in, then some of its sequences stop."""
        self.scheduler.accept({seq: Accepted(data.draw(st.integers(0, 12))) for seq, _position in pending})
        self._finish_some([seq for seq in previous if not seq.is_finished], data)

    def _finish_some(self, sampled: list[Seq], data) -> None:
        for seq in sampled:
            if len(seq.output_ids) >= 4 or data.draw(st.integers(0, 3)) == 0:
                seq.finish_reason = "stop"
                self.scheduler.finish(seq)

    @precondition(lambda self: bool(self.scheduler.running))
    @rule(data=st.data())
    def abort(self, data):
        seq = data.draw(st.sampled_from(self.scheduler.running))
        seq.finish_reason = "abort"
        self.scheduler.finish(seq)

    @invariant()
    def consistent(self):
        if not hasattr(self, "scheduler"):
            return
        self.scheduler.check_integrity()
        assert self.idle_steps == 0, "a step with work scheduled nothing"
        for seq in self.scheduler.running:
            assert seq.status is SeqStatus.RUNNING
            assert self.cache._seqs[seq.seq_id].token_ids is seq.token_ids  # one owner of the tokens: no copy

    def teardown(self):
        if not hasattr(self, "scheduler"):
            return
        for seq in self.launched or ():  # async: the last step's sequences stop
            if not seq.is_finished:
                seq.finish_reason = "stop"
                self.scheduler.finish(seq)
        for _ in range(400):  # everything left finishes: nobody waits forever for a leader
            if not self.scheduler.has_work:
                break
            try:
                output = self.scheduler.schedule()
            except RuntimeError:  # as in `step`: the pool cannot hold this prompt even alone
                seq = self.scheduler.waiting[0]
                seq.finish_reason = "abort"
                self.scheduler.finish(seq)
                continue
            self.device.execute_step(output)
            for chunk in output.chunks:
                chunk.seq.num_computed = chunk.end - chunk.num_drafts
            verified = {c.seq: Accepted(kept=()) for c in output.chunks if c.num_drafts}
            if verified:
                self.device.execute_rollback(self.scheduler.accept(verified))
            for seq in [c.seq for c in output.chunks if c.samples] + [s.seq for s in output.samples]:
                seq.token_ids.append(1)
                seq.finish_reason = "stop"
                self.scheduler.finish(seq)
            self.scheduler.check_integrity()
        assert not self.scheduler.has_work, "sequences left waiting"
        self.cache.clear()
        stats = self.cache.stats
        assert (stats.num_blocks_used, stats.num_slots_used) == (0, 0), stats


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(
    max_examples=100, stateful_step_count=40, deadline=None, suppress_health_check=list(HealthCheck),
)


def make_seq(seq_id: int, prompt: list[int]) -> Seq:
    return Seq(seq_id=seq_id, request_id=str(seq_id), index=0, token_ids=list(prompt), prompt_len=len(prompt),
               params=SamplingParams(temperature=0), generator=None, arrival=seq_id)


def make_scheduler(mode: str = "hybridcache") -> tuple[Scheduler, FakeDevice]:
    policy = checkpoint_policy(mode)
    cache = PrefixCache(CacheConfig(block_size=4, num_blocks=64, num_slots=8,
                                    full_prompt_hits=policy.full_prompt_hits))
    return Scheduler(cache, policy, max_num_seqs=4, max_num_batched_tokens=100), FakeDevice(cache)


def run(scheduler: Scheduler, device: FakeDevice):
    output = scheduler.schedule()
    device.execute_step(output)
    for chunk in output.chunks:
        chunk.seq.num_computed = chunk.end
    for seq in [c.seq for c in output.chunks if c.samples] + [s.seq for s in output.samples]:
        seq.token_ids.append(99)
    scheduler.check_integrity()
    device.check()
    return output


def test_n_completions_wait_for_the_first_prefill_then_only_sample():
    scheduler, device = make_scheduler()
    prompt = list(range(30))
    seqs = [make_seq(i, prompt) for i in range(3)]
    for seq in seqs:
        scheduler.add(seq)
    first = run(scheduler, device)
    assert [(c.seq.seq_id, c.start, c.end) for c in first.chunks] == [(0, 0, 30)] and not first.samples
    second = run(scheduler, device)
    assert [(c.seq.seq_id, c.start) for c in second.chunks] == [(0, 30)]  # the leader decodes
    assert [s.seq.seq_id for s in second.samples] == [1, 2]
    assert [s.num_cached for s in seqs] == [0, 30, 30]


def test_a_prefix_sharing_prompt_makes_the_leader_save_where_they_part():
    scheduler, device = make_scheduler()
    leader, follower = make_seq(0, list(range(30))), make_seq(1, list(range(18)) + [77] * 9)
    scheduler.add(leader)
    scheduler.add(follower)
    first = run(scheduler, device)
    assert [(c.seq.seq_id, c.start, c.end) for c in first.chunks] == [(0, 0, 18)]  # a branch point at 18
    second = run(scheduler, device)
    assert [(c.seq.seq_id, c.start, c.end) for c in second.chunks] == [(0, 18, 30), (1, 18, 27)]
    assert follower.num_cached == 18


def test_seed_mode_does_not_share_in_flight():
    scheduler, device = make_scheduler("seed")
    for i in range(2):
        scheduler.add(make_seq(i, list(range(30))))
    first = run(scheduler, device)
    assert [(c.seq.seq_id, c.start, c.end) for c in first.chunks] == [(0, 0, 30), (1, 0, 30)]


def test_a_hit_that_needs_one_block_more_than_a_miss_runs_as_a_miss():
    # B = 4, 3 blocks. A (9 tokens) finishes at step 9: blocks 0-1 in the trie, its partial block frozen.
    # B extends A's prompt to 12 tokens: the hit at 9 needs the 2 pinned blocks, the frozen one and a private
    # copy of the tail (4 > 3); a miss evicts everything and needs 3. It must run (as a miss), not raise.
    policy = checkpoint_policy("hybridcache")
    cache = PrefixCache(CacheConfig(block_size=4, num_blocks=3, num_slots=4, full_prompt_hits=True))
    check_picks(cache)
    scheduler, device = Scheduler(cache, policy, max_num_seqs=2, max_num_batched_tokens=100), FakeDevice(cache)
    first = make_seq(0, list(range(9)))
    scheduler.add(first)
    run(scheduler, device)
    first.finish_reason = "stop"
    scheduler.finish(first)
    assert cache.stats.saves_by_reason.get("finish") == 1
    hit = cache.match(CacheRequest("probe", tuple(range(9)) + (5, 6, 7)))
    assert hit.cached_len == 9
    cache.release_match(hit)
    second = make_seq(1, list(range(9)) + [5, 6, 7])
    scheduler.add(second)
    output = run(scheduler, device)
    assert [(c.seq.seq_id, c.start, c.end) for c in output.chunks] == [(1, 0, 12)]
    assert second.num_cached == 0
    second.finish_reason = "stop"
    scheduler.finish(second)
    scheduler.check_integrity()


class _Scripted:
    """`data` for the machine's rules with the draws given in order (a found failure, replayed by hand; `add`
    draws a document, a length, a suffix and a cache salt)."""

    def __init__(self, *values) -> None:
        self.values = list(values)

    def draw(self, _strategy):
        return self.values.pop(0)


def test_a_finish_state_written_in_a_plan_is_not_demoted_by_that_plan():
    """Async, paged, a host tier: two sequences finish (their STATE_FINISH copies go into the next plan), and
    that plan's commit needs room. Demoting one of them there would queue a HOST_SAVE of its pages, which runs
    before the plan's STATE_FINISH writes them (host ops come first): the host would keep a page of garbage."""
    machine = SchedulerMachine()
    machine.setup(block_size=8, num_blocks=12, num_slots=4, budget=4, mode="hybridcache", eviction="lru",
                  learned=False, async_steps=True, state_pages=1, host_blocks=4, spec_k=0)
    first, second = DOCS
    machine.add(_Scripted(first, 1, [], None), 1)
    machine.add(_Scripted(first, 1, [1], None), 1)
    machine.step(_Scripted())
    machine.add(_Scripted(first, 1, [], None), 1)
    machine.step(_Scripted(0, 0, 0, 0))  # both earlier sequences finish
    machine.abort(_Scripted(machine.seqs[2]))
    machine.add(_Scripted(first, 2, [], None), 1)
    machine.add(_Scripted(second, 1, [], None), 1)
    machine.step(_Scripted(*[0] * 8))  # the fake device checks every host page
    machine.consistent()
    assert machine.cache.stats.num_demoted_checkpoints >= 1
    machine.teardown()
