"""Continuous batching: which sequences feed how many tokens in the next forward.

Each step has a token budget (`max_num_batched_tokens`). Running sequences go first, oldest first (a decode
costs one token, an unfinished prefill takes what the budget leaves); then waiting sequences are admitted
in arrival order while the budget, the slot count and memory allow. Long prompts are therefore prefilled in
chunks that end wherever the budget runs out.

When a running sequence cannot get the blocks it needs, the newest running sequence is preempted: it gives
back its blocks and slot and goes back to the front of the waiting queue, to recompute later.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from hybridcache.engine.sequence import SeqStatus, Sequence
from hybridcache.scheduler.plain_memory import PlainMemory


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
    def of(cls, seq: Sequence, num_tokens: int) -> ScheduledChunk:
        return cls(seq, seq.num_computed, num_tokens, seq.num_computed + num_tokens == seq.num_tokens)


class Scheduler:
    """Waiting and running queues over a memory manager; see the module docstring for the policy."""

    def __init__(self, memory: PlainMemory, *, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.memory = memory
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
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
            num_tokens = min(seq.num_remaining, budget)
            while not self.memory.grow(seq, seq.num_computed + num_tokens):
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status is SeqStatus.RUNNING:
                chunks.append(ScheduledChunk.of(seq, num_tokens))
                budget -= num_tokens
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            num_tokens = min(seq.num_remaining, budget)
            if not self.memory.admit(seq, seq.num_computed + num_tokens):
                break
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            num_tokens = min(seq.num_remaining, budget)
            chunks.append(ScheduledChunk.of(seq, num_tokens))
            budget -= num_tokens
        return chunks

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence and release what it holds."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.memory.release(seq)
        seq.status = SeqStatus.FINISHED

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.memory.release(seq)
        seq.num_computed = 0
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
