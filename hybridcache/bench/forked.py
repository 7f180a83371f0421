"""The `n` > 1 completions of one request under a policy that shares prompts in flight, in the engine's order
(`ForkedRun`); replay.py's `CacheReplay.run` hands them here, and its other policies run them in waves.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING

from hybridcache.bench.workloads import SimRequest
from hybridcache.cache import CacheRequest

if TYPE_CHECKING:
    from hybridcache.bench.replay import CacheReplay, ReplaySeq


class ForkedRun:
    """The `n` completions of `request` in the engine's order when prompts are shared in flight
    (`scheduler/in_flight.py`, the scheduler's steps with one token budget per step, steps synchronous), on
    `replay`'s cache and through its admission, feed, commit and finish (`run` once)::

        step 0        completion 0 is admitted and plans its first chunk; the others wait for its prefill
        ...           completion 0 prefills its prompt (the last chunk saves the prompt end and samples)
        next step     completion 0 feeds its first output token, then the others are admitted: they hit
                      the whole prompt and only sample (when completion 0 hit it all, in step 0 already)
        then          all decode together, completion 0 one token ahead; each finishes (its finish
                      checkpoint) at the end of the step that sampled its last token, in batch order

    A completion with no room waits for one to finish; one that fits with nothing running only as a miss
    runs as one, one that fits not even then runs without the cache (`uncacheable`). Steps in which
    every running completion decodes and nothing can be admitted are fed in one commit up to the next
    finish or block fill (`_decode_together`)."""

    def __init__(self, replay: CacheReplay, request: SimRequest, cache_requests: Sequence[CacheRequest]) -> None:
        self.replay, self.request, self.cache_requests = replay, request, cache_requests
        self.prompt_len = len(request.prompt_ids)
        self.waiting = list(enumerate(request.outputs()))  # (completion index, its output), in order
        self.running: list[ReplaySeq] = []
        self.num_sampled: dict[Hashable, int] = {}
        self.blocked = False  # a waiting completion found no room: only a finish (or a drop) makes room

    def run(self) -> None:
        """Step until every completion has finished or run without the cache."""
        replay, running = self.replay, self.running
        while running or self.waiting:
            before = [s.rid for s in running]
            if running and (self.blocked or not self.waiting) and len(running) <= replay.config.chunk_budget and all(
                    s.computed >= self.prompt_len for s in running):
                stepped, fed = self._decode_together()
            else:
                stepped, fed = self._step()
            if fed or stepped:  # a step that only samples (zero-prefill hits) still commits its restores
                replay._commit(fed)
            self._end_step(stepped)
            if len(before) > sum(s.rid in before for s in running):
                self.blocked = False  # a completion finished or was dropped: there may be room now
        if replay.config.check_integrity:
            replay.cache.check_integrity()

    def _step(self) -> tuple[list[ReplaySeq], dict]:
        """Plan one scheduler step: the running completions first (a prefill chunk or one decode token each,
        while the budget lasts), then the waiting ones in order while the budget lasts and none of the running
        ones is still prefilling its prompt (the scheduler's `find_leader`). Returns the completions that compute
        or sample in the step and their fed tokens; sets `blocked` when admission found no room."""
        replay, request, running, waiting = self.replay, self.request, self.running, self.waiting
        cache, prompt_len = replay.cache, self.prompt_len
        budget = replay.config.chunk_budget
        stepped: list[ReplaySeq] = []
        fed: dict = {}
        prefilling = any(s.computed < prompt_len for s in running)  # as the scheduler sees it: before this step
        for seq in list(running):
            if budget == 0:
                break
            if seq.computed < prompt_len:
                plan = replay._plan(seq, prompt_len, budget)
                end, reason = plan.end, plan.reason
            else:
                end, reason = seq.computed + 1, None
            if not cache.ensure_capacity(seq.rid, end):
                replay._drop(request, seq, running)
                continue
            budget = max(0, budget - replay._feed(request.prompt_ids, seq, end, reason, fed))
            stepped.append(seq)
        while waiting and budget > 0 and not self.blocked:
            index, output = waiting[0]
            rid = (request.request_id, index)
            if prefilling:  # it waits for the prompt being prefilled, unless its own hit covers the prompt
                match = cache.match(self.cache_requests[index])
                cache.release_match(match)
                if match.cached_len < prompt_len:
                    break
            seq = replay._admit_one(self.cache_requests[index], rid, output, prompt_len, None, budget)
            if seq is None and not running:
                seq = replay._admit_one(self.cache_requests[index], rid, output, prompt_len, 0, budget)
            if seq is None:
                if running:
                    self.blocked = True
                    break
                waiting.pop(0)
                replay._uncacheable(request)
                continue
            waiting.pop(0)
            running.append(seq)
            self.num_sampled[rid] = 0
            prefilling = prefilling or seq.computed < prompt_len
            if seq.computed < prompt_len:
                plan = replay._plan(seq, prompt_len, budget)
                budget = max(0, budget - replay._feed(request.prompt_ids, seq, plan.end, plan.reason, fed))
            stepped.append(seq)
        return stepped, fed

    def _decode_together(self) -> tuple[list[ReplaySeq], dict]:
        """Every running completion decodes up to the step in which the first of them samples its last token or
        fills a block: the steps' tokens in one commit. The same as one commit per step, since blocks are taken
        only in a segment's first step and fill (joining the trie, where a completion's block that repeats
        another's is swapped for it and freed) only in its last. Returns the completions fed and their tokens."""
        replay, running, num_sampled = self.replay, self.running, self.num_sampled
        prompt_len, size = self.prompt_len, replay.block_size
        steps = min(min(len(s.output_ids) - num_sampled[s.rid], size - s.computed % size) for s in running)
        stepped, fed = [], {}
        for seq in list(running):
            end = seq.computed + steps
            if not replay.cache.ensure_capacity(seq.rid, end):
                replay._drop(self.request, seq, running)
                continue
            fed[seq.rid] = seq.output_ids[seq.computed - prompt_len:end - prompt_len]
            num_sampled[seq.rid] += steps - 1  # the last step's sample is counted by `_end_step`
            seq.computed = end
            stepped.append(seq)
        return stepped, fed

    def _end_step(self, stepped: list[ReplaySeq]) -> None:
        """After a step's commit: the stepped completions whose computed tokens reach their last known token
        sampled one; those that sampled their whole output finish, in batch order."""
        num_sampled = self.num_sampled
        done = []
        for seq in stepped:
            if seq.computed == self.prompt_len + num_sampled[seq.rid]:
                num_sampled[seq.rid] += 1
                if num_sampled[seq.rid] == len(seq.output_ids):
                    done.append(seq)
        if done:
            self.replay._sample_memory()
            self.blocked = False  # room may have been made (also by one admitted in this very step)
        for seq in done:
            self.running.remove(seq)
            self.replay._finish(self.request, seq)
