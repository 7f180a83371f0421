"""Continuous batching over the prefix cache: which sequences feed how many tokens in the next forward.

Each step has a token budget (`max_num_batched_tokens`). Running sequences go first, oldest first (a decode
costs one token, an unfinished prefill takes what the budget leaves); then waiting sequences are admitted
in arrival order while the budget, `max_num_seqs` and memory allow. Where a chunk ends and which checkpoint
it saves come from `save_plan.plan_chunk` (branch points, chunk ends, block alignment per cache mode).

Admission is two-phase through `PrefixCache`: `match` (pins the checkpoint it would restore), then
`admit(match, first_chunk_end)` (slot + blocks for the cached prefix and the first chunk, restore copies
queued) or, when there is no room, `release_match`, which leaves the cache exactly as it was.

When a running sequence cannot grow, the newest running sequence is preempted: the cache keeps its computed
prefix as a checkpoint (when the mode saves any), frees the rest, and the sequence goes back to the front of
the waiting queue; on re-admission its prefix is a hit.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from hybridcache.cache import CacheRequest, PrefixCache
from hybridcache.engine.sequence import SeqStatus, Sequence
from hybridcache.scheduler.save_plan import CheckpointPolicy, ChunkPlan, plan_chunk


@dataclass(frozen=True)
class ScheduledChunk:
    """`seq` feeds `token_ids[start : start + num_tokens]` in this step. `samples`: the chunk reaches the
    end of the sequence's tokens, so a token is sampled from its logits."""

    seq: Sequence
    start: int
    num_tokens: int
    samples: bool

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @classmethod
    def of(cls, seq: Sequence, end: int) -> ScheduledChunk:
        start = seq.num_computed
        return cls(seq, start, end - start, end == seq.num_tokens)


class Scheduler:
    """Waiting and running queues over a `PrefixCache`; see the module docstring for the policy."""

    def __init__(
        self,
        cache: PrefixCache,
        policy: CheckpointPolicy | None,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        decode_checkpoint_interval: int | None = None,
    ) -> None:
        self.cache = cache
        self.policy = policy
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.decode_checkpoint_interval = decode_checkpoint_interval
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledChunk]:
        budget = self.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted = False
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not SeqStatus.RUNNING:  # preempted earlier in this loop
                continue
            plan = self._plan(seq, seq.num_computed, budget)
            while not self.cache.ensure_capacity(seq.seq_id, plan.end):
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status is SeqStatus.RUNNING:
                chunks.append(self._schedule(seq, plan))
                budget = max(0, budget - chunks[-1].num_tokens)  # a multimodal span may go over the budget
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not self._admit(seq, budget):
                break
            self.waiting.popleft()
            self.running.append(seq)
            chunks.append(self._schedule(seq, self._plan(seq, seq.num_computed, budget)))
            budget = max(0, budget - chunks[-1].num_tokens)
        return chunks

    def _admit(self, seq: Sequence, budget: int) -> bool:
        """Match and admit a waiting sequence with room for its first chunk; False changes nothing."""
        spans = tuple((m.start, m.end, m.content_hash) for m in seq.mm_inputs)
        match = self.cache.match(CacheRequest(seq.seq_id, tuple(seq.token_ids), mm_spans=spans))
        seq.cache_prompt_len = seq.num_tokens
        seq.branch_step = match.divergence_len if match.divergence_len > match.cached_len else None
        plan = self._plan(seq, match.cached_len, budget)
        if self.cache.admit(match, plan.end) is None:
            self.cache.release_match(match)
            return False
        seq.num_computed = match.cached_len
        if seq.num_cached is None:
            seq.num_cached = match.cached_len
        seq.status = SeqStatus.RUNNING
        return True

    def _plan(self, seq: Sequence, start: int, budget: int) -> ChunkPlan:
        return plan_chunk(
            self.policy,
            start=start,
            num_tokens=seq.num_tokens,
            budget=budget,
            prompt_len=seq.cache_prompt_len,
            block_size=self.cache.block_size,
            branch_step=seq.branch_step,
            decode_interval=self.decode_checkpoint_interval,
            spans=[(m.start, m.end) for m in seq.mm_inputs],
        )

    def _schedule(self, seq: Sequence, plan: ChunkPlan) -> ScheduledChunk:
        if plan.reason is not None:
            self.cache.reserve_save(seq.seq_id, plan.end, plan.reason)
        return ScheduledChunk.of(seq, plan.end)

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence. A running one that finished normally leaves a finish
        checkpoint when the mode saves them; an aborted one (`seq.finish_reason == 'abort'`) leaves nothing."""
        if seq in self.running:
            self.running.remove(seq)
            if self.policy is not None and self.policy.finish and seq.finish_reason != "abort":
                self.cache.finish(seq.seq_id)
            else:
                self.cache.abort(seq.seq_id)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.cache.preempt(seq.seq_id, keep_checkpoint=self.policy is not None and self.policy.finish)
        seq.num_computed = 0
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
