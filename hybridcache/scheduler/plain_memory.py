"""Block and slot allocation without prefix caching: a free list of KV blocks and one of state slots."""

from __future__ import annotations

from hybridcache.engine.sequence import Sequence


class PlainMemory:
    """Gives each running sequence a state slot and enough KV blocks for its tokens; shares nothing.

    Every call either succeeds completely or changes nothing, so the scheduler can preempt and retry.
    """

    def __init__(self, num_blocks: int, num_slots: int, block_size: int) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.num_slots = num_slots
        self._free_blocks = list(range(num_blocks - 1, -1, -1))
        self._free_slots = list(range(num_slots - 1, -1, -1))

    def admit(self, seq: Sequence, num_tokens: int) -> bool:
        """Take a slot and the blocks for `num_tokens` tokens for a waiting sequence."""
        if not self._free_slots or self._blocks_needed(seq, num_tokens) > len(self._free_blocks):
            return False
        seq.slot = self._free_slots.pop()
        seq.num_computed = 0
        seq.num_cached = 0
        return self.grow(seq, num_tokens)

    def grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Make the sequence's block list hold `num_tokens` tokens."""
        needed = self._blocks_needed(seq, num_tokens)
        if needed > len(self._free_blocks):
            return False
        seq.block_ids.extend(self._free_blocks.pop() for _ in range(needed))
        return True

    def commit_step(self, fed: list[tuple[Sequence, int]]) -> None:
        """The forward feeding `n` tokens of each `(seq, n)` is queued. Nothing to record without a cache."""

    def release(self, seq: Sequence) -> None:
        """Give back everything the sequence holds (finish, abort or preemption)."""
        self._free_blocks.extend(reversed(seq.block_ids))
        seq.block_ids = []
        if seq.slot is not None:
            self._free_slots.append(seq.slot)
            seq.slot = None

    def check_integrity(self) -> None:
        free = set(self._free_blocks)
        if len(free) != len(self._free_blocks) or not free <= set(range(self.num_blocks)):
            raise AssertionError("free block list holds duplicates or foreign ids")

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_blocks)

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    def _blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_ids))
