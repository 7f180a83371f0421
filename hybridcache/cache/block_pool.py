"""Logical KV block ids with reference counts.

A block's reference count is its number of holders: the trie node that owns it (at most one), every
running sequence whose block list contains it, and the checkpoint whose frozen tail it is. A block with
count 0 is on the free list; `allocate` returns a block with count 1. `on_free`, when set, is told each block
that returns to the free list (the host tier cancels a load queued into it: host_tier.py, `cancel_load`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self.on_free: Callable[[int], None] | None = None

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def free_ids(self) -> list[int]:
        return list(self._free)

    def allocate(self) -> int:
        """A free block with count 1; raises when none is free (callers make room first)."""
        if not self._free:
            raise RuntimeError("no free KV block (make room before allocating)")
        block_id = self._free.popleft()
        self.ref_counts[block_id] = 1
        return block_id

    def incref(self, block_id: int) -> None:
        if self.ref_counts[block_id] <= 0:
            raise RuntimeError(f"incref of free block {block_id}")
        self.ref_counts[block_id] += 1

    def decref(self, block_id: int) -> None:
        """Drop one holder; the block returns to the free list when none is left."""
        count = self.ref_counts[block_id]
        if count <= 0:
            raise RuntimeError(f"decref of free block {block_id}")
        self.ref_counts[block_id] = count - 1
        if count == 1:
            self._free.append(block_id)
            if self.on_free is not None:
                self.on_free(block_id)
