"""Hypothesis stateful test: random admit / step / finish / preempt / abort / clear / pressure sequences, and resends
preempted before their first step (a host hit promoted, then evicted before its loads ran).

After every operation: `check_integrity()` and the fake device (every running sequence, checkpoint and
trie node holds exactly the KV and state its ids claim). Every reported hit is checked against a reference
model of what was saved (the prefix at the hit step was saved, with routed experts when asked), and, as
long as nothing was ever evicted or cleared, the hit must be the deepest saved prefix the request allows.
Requests draw an adapter and a cache salt: the reference model keys a saved prefix by its root (adapter and
salt), so a hit across roots fails it, and the fake device's identities hold the root too.
Paged runs draw a host tier too (`host_blocks`, 0 = none): device eviction demotes there, hits promote back,
and the fake device checks every host node and host checkpoint as well (every id names live bytes in exactly
one tier: integrity counts each block's holders in each tier).
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from hybridcache.cache import CacheConfig, CacheRequest, CostModel, MultimodalSpan, PrefixCache
from tests.cache.checked_evictor import check_picks
from tests.cache.fake_engine import FakeDevice, fingerprint

DOCS = [tuple((d * 7 + i * 3) % 11 for i in range(40)) for d in range(3)]


class CacheMachine(RuleBasedStateMachine):
    @initialize(
        block_size=st.sampled_from([4, 8]),
        num_blocks=st.integers(4, 64),
        num_slots=st.integers(2, 12),
        cap=st.integers(1, 3),
        eviction=st.sampled_from(["lru", "flop_aware"]),
        decode=st.booleans(),
        full_hits=st.booleans(),
        admission=st.sampled_from(["all", "learned"]),
        state_pages=st.one_of(st.none(), st.integers(1, 3)),
        host_blocks=st.sampled_from([0, 3, 8, 24, 96]),
        slow_copies=st.integers(0, 3),
    )
    def setup(self, block_size, num_blocks, num_slots, cap, eviction, decode, full_hits, admission, state_pages,
              host_blocks, slow_copies):
        # two pools, or paged: checkpoint states in `state_pages` blocks each (the block pool is the one budget),
        # with or without a host tier behind it (then a small device pool, so that eviction demotes often)
        host_blocks = host_blocks if state_pages else 0
        if host_blocks:
            num_blocks = 4 + num_blocks // 4
        config = CacheConfig(
            block_size=block_size, num_blocks=num_blocks, num_slots=num_slots, max_checkpoints_per_anchor=cap,
            eviction=eviction, decode_checkpoint_interval=2 * block_size if decode else None,
            full_prompt_hits=full_hits, admission=admission, state_pages=state_pages,
            host_blocks=host_blocks,
        )
        self.max_back = 0 if full_hits else 1  # a match may reach prompt_len - max_back
        # now and then host copies so slow that a short promotion does not pay (it is skipped)
        bandwidth = 5e-13 if slow_copies == 0 else float("inf")
        self.cache = PrefixCache(config, CostModel(attn_flops_per_token_pair=0.5, host_bandwidth=bandwidth))
        check_picks(self.cache)  # every eviction victim is checked against a full scan
        self.device = FakeDevice(self.cache)
        self.size = block_size
        self.saved: dict[tuple, bool] = {}  # prefix identity -> routed-expert history known
        self.lossless = True
        self.histories: list[tuple[int, ...]] = []
        self.prompts: list[tuple[int, ...]] = []
        self.divergence: dict[int, int] = {}
        self.next_id = 0

    # -- helpers -------------------------------------------------------------------------------------------

    def _key(self, request: CacheRequest, token_ids, step: int) -> tuple:
        return ((request.adapter, request.cache_salt), tuple(token_ids[:step]), request.spans_in(0, step))

    def _record(self, request: CacheRequest, token_ids, step: int, routed: bool) -> None:
        key = self._key(request, token_ids, step)
        self.saved[key] = self.saved.get(key, False) or routed

    def _expected(self, request: CacheRequest) -> int:
        best = 0
        for step in range(1, request.prompt_len + 1 - self.max_back):
            routed = self.saved.get(self._key(request, request.prompt_ids, step))
            if routed is None or not request.is_safe(step):
                continue
            if step % self.size and request.routed_experts and not routed:
                continue
            best = step
        return best

    def _lossy_now(self) -> None:
        stats = self.cache.stats
        if stats.evictions_by_kind or stats.declined_saves.get("anchor_full"):
            self.lossless = False

    def _seqs(self):
        return self.cache._seqs

    # -- rules ---------------------------------------------------------------------------------------------

    @precondition(lambda self: len(self.cache._seqs) < 4)
    @rule(data=st.data())
    def new_request(self, data):
        if self.prompts and data.draw(st.integers(0, 3)) == 0:
            base = data.draw(st.sampled_from(self.prompts))  # a resend
        elif self.histories and data.draw(st.booleans()):
            base = data.draw(st.sampled_from(self.histories))  # the next turn
        else:
            doc = data.draw(st.sampled_from(DOCS))
            base = doc[: data.draw(st.integers(1, len(doc)))]
        suffix = tuple(data.draw(st.lists(st.integers(0, 10), max_size=2 * self.size)))
        prompt = (base + suffix)[:60]
        self.prompts.append(prompt)
        spans = ()
        if len(prompt) >= 6 and data.draw(st.integers(0, 2)) == 0:
            spans = (MultimodalSpan(2, 6, data.draw(st.sampled_from(["a", "a", "b"]))),)
        request = CacheRequest(
            self.next_id, prompt, adapter=data.draw(st.sampled_from([None, None, "lora"])), mm_spans=spans,
            routed_experts=data.draw(st.integers(0, 3)) == 0,
            cache_salt=data.draw(st.sampled_from([None, None, "tenant-a", "tenant-b"])),
        )
        self.next_id += 1
        before = fingerprint(self.cache)
        match = self.cache.match(request)
        s = match.cached_len
        assert 0 <= s <= request.prompt_len - self.max_back and request.is_safe(s)
        assert s <= match.divergence_len <= request.prompt_len - self.max_back
        host_hit = match.checkpoint_id is not None and match.checkpoint_id not in self.cache._life.checkpoints
        assert len(match.block_ids) == s // self.size or host_hit and len(match.block_ids) < s // self.size
        if s:
            routed = self.saved.get(self._key(request, request.prompt_ids, s))
            assert routed is not None, f"hit at {s} on a prefix that was never saved"
            assert not (s % self.size and request.routed_experts and not routed), "routed experts not kept"
        if self.lossless:
            assert s == self._expected(request), "a saved prefix was not found"
        after_match = fingerprint(self.cache)
        admitted = self.cache.admit(match)
        if admitted is None:
            assert fingerprint(self.cache) == after_match
            self.cache.release_match(match)
            assert fingerprint(self.cache) == before
        else:
            assert admitted.num_computed == s
            self.divergence[request.request_id] = match.divergence_len
        self._lossy_now()

    @precondition(lambda self: bool(self.cache._seqs))
    @rule(data=st.data(), num_steps=st.integers(1, 4))
    def steps(self, data, num_steps):
        for _ in range(num_steps):
            if self._seqs():
                self.step(data)
            self.cache.check_integrity()
            self.device.check()

    def step(self, data):
        cache, size = self.cache, self.size
        rids = data.draw(st.lists(st.sampled_from(sorted(self._seqs())), min_size=1, unique=True))
        fed, pending = {}, []
        for rid in rids:
            if rid not in self._seqs():
                continue  # preempted below
            seq = self._seqs()[rid]
            request, start = seq.request, seq.num_computed
            if start < request.prompt_len:
                end = min(request.prompt_len, start + data.draw(st.integers(1, 2 * size)))
                div = self.divergence.get(rid, 0)
                branch = start < div < end
                if branch:
                    end = div
                new = request.prompt_ids[start:end]
            else:
                end, new, branch = start + 1, [data.draw(st.integers(0, 10))], False
            if not cache.ensure_capacity(rid, end):
                before = fingerprint(cache)
                victims = [r for r in self._seqs() if r != rid and r not in fed]
                if not victims or not data.draw(st.booleans()):
                    assert fingerprint(cache) == before
                    continue
                self._preempt(data.draw(st.sampled_from(victims)), keep=data.draw(st.booleans()))
                if not cache.ensure_capacity(rid, end):
                    continue
            fed[rid] = list(new)
            if end <= request.prompt_len:
                reason = "branch_point" if branch else ("prefill_end" if end == request.prompt_len else "chunk_end")
                if reason == "chunk_end" and not data.draw(st.booleans()):
                    reason = None
            else:
                interval = cache.config.decode_checkpoint_interval
                reason = "decode_interval" if interval and end % interval == 0 else None
            if reason is not None:
                routed = "re" if data.draw(st.booleans()) else None
                if cache.reserve_save(rid, end, reason, routed):
                    pending.append((rid, end, routed is not None))
        if not fed:
            return
        self.device.run_step(fed)
        for rid, step, routed in pending:
            seq = self._seqs()[rid]
            self._record(seq.request, seq.token_ids, step, routed)
        self._lossy_now()

    def _retire(self, rid, keep: bool, finish: bool) -> None:
        seq = self._seqs()[rid]
        request, token_ids, step = seq.request, list(seq.token_ids), seq.num_computed
        declined = dict(self.cache.stats.declined_saves)
        routed = "re" if finish and request.routed_experts else None
        kept = self.cache.finish(rid, routed) if finish else self.cache.preempt(rid, keep)
        dup = self.cache.stats.declined_saves.get("duplicate", 0) > declined.get("duplicate", 0)
        if kept or dup:
            self._record(request, token_ids, step, routed is not None)
        if finish and step >= request.prompt_len:
            self.histories.append(tuple(token_ids))
        self._lossy_now()

    def _preempt(self, rid, keep: bool) -> None:
        self._retire(rid, keep, finish=False)

    @precondition(lambda self: bool(self.cache._seqs))
    @rule(data=st.data())
    def finish(self, data):
        done = sorted(rid for rid, seq in self._seqs().items() if not seq.has_pending_work)
        if done:  # a sequence admitted but not yet stepped has no forward to finish after
            self._retire(data.draw(st.sampled_from(done)), keep=True, finish=True)

    @precondition(lambda self: bool(self.cache._seqs))
    @rule(data=st.data(), keep=st.booleans())
    def preempt(self, data, keep):
        self._preempt(data.draw(st.sampled_from(sorted(self._seqs()))), keep)

    @precondition(lambda self: bool(self.cache._seqs))
    @rule(data=st.data())
    def abort(self, data):
        self.cache.abort(data.draw(st.sampled_from(sorted(self._seqs()))))

    @rule(roll=st.integers(0, 9))
    def clear(self, roll):
        if roll == 0:  # rare: it wipes what the other rules build
            self.cache.clear()
            self.lossless = False

    @rule(num_blocks=st.integers(1, 12), roll=st.integers(0, 3))
    def pressure(self, num_blocks, roll):
        """A request that wants many blocks at once: evicts, or fails without a trace."""
        if roll:
            return
        request = CacheRequest(("pressure", self.next_id), (10,) * (num_blocks * self.size))
        self.next_id += 1
        match = self.cache.match(request)
        if self.cache.admit(match) is None:
            self.cache.release_match(match)
            return
        before = fingerprint(self.cache)
        if not self.cache.ensure_capacity(request.request_id, num_blocks * self.size):
            assert fingerprint(self.cache) == before
        self.cache.abort(request.request_id)
        self._lossy_now()

    @precondition(lambda self: bool(self.prompts) and self.cache._life.host is not None)
    @rule(data=st.data(), num_blocks=st.integers(4, 24))
    def resend_dropped_at_once(self, data, num_blocks):
        """A resend (often a host hit, promoted at admission) preempted without a checkpoint before its first step,
        then a request that wants many blocks: what the promotion brought back may be evicted before the plan that
        loads it is built (its loads must go with it)."""
        request = CacheRequest(("resend", self.next_id), data.draw(st.sampled_from(self.prompts)))
        self.next_id += 1
        match = self.cache.match(request)
        if self.cache.admit(match) is None:
            self.cache.release_match(match)
            return
        self.cache.preempt(request.request_id, keep_checkpoint=False)
        self.cache.check_integrity()
        self.pressure(num_blocks, roll=0)

    @invariant()
    def consistent(self):
        if not hasattr(self, "cache"):
            return
        self.cache.check_integrity()
        self.device.check()

    def teardown(self):
        if not hasattr(self, "cache"):
            return
        for rid in list(self._seqs()):
            self.cache.abort(rid)
        self.cache.clear()
        stats = self.cache.stats
        assert (stats.num_blocks_used, stats.num_slots_used, stats.num_checkpoints) == (0, 0, 0), stats
        assert (stats.num_host_checkpoints, stats.num_host_nodes) == (0, 0), stats


TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = settings(
    max_examples=200, stateful_step_count=50, deadline=None, suppress_health_check=list(HealthCheck),
)


@pytest.mark.slow
def test_cache_machine_long():
    run_state_machine_as_test(
        CacheMachine,
        settings=settings(
            max_examples=1000, stateful_step_count=80, deadline=None, suppress_health_check=list(HealthCheck)
        ),
    )
