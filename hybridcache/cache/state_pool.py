"""State slots: one per running sequence (its runtime slot) and one per checkpoint.

There is one pool: checkpoints borrow slots that no running sequence uses and give them back by being
evicted when a running sequence needs a slot. `owners[slot]` names the holder, for integrity checks and
for the ownership transfer of a finished sequence's runtime slot to its checkpoint.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable


class StatePool:
    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.owners: list[Hashable | None] = [None] * num_slots
        self._free: deque[int] = deque(range(num_slots))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self._free)

    def free_ids(self) -> list[int]:
        return list(self._free)

    def allocate(self, owner: Hashable) -> int:
        """A free slot now held by `owner`; raises when none is free (callers make room first)."""
        if not self._free:
            raise RuntimeError("no free state slot (make room before allocating)")
        slot = self._free.popleft()
        self.owners[slot] = owner
        return slot

    def transfer(self, slot: int, owner: Hashable) -> None:
        """Hand a held slot to a new owner without a copy (finished sequence -> its checkpoint)."""
        if self.owners[slot] is None:
            raise RuntimeError(f"transfer of free slot {slot}")
        self.owners[slot] = owner

    def free(self, slot: int) -> None:
        if self.owners[slot] is None:
            raise RuntimeError(f"double free of slot {slot}")
        self.owners[slot] = None
        self._free.append(slot)
