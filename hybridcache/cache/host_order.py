"""The host tier's own eviction order (`HostTier.make_room` asks it for each victim).

What a hit has proven is kept longer: S3-FIFO's split between a probation queue and a main queue (Yang et al.,
SOSP 2023), expressed as lifetimes. The clock counts host blocks allocated (demotion traffic). A host checkpoint
is due to go at the clock when it was demoted, plus, when it is **proven** (`proven_at_demotion`), one host
capacity (`protection`, the host's size in blocks): proven = hit at least once (`Checkpoint.was_hit`: a host hit
promotes, so such a checkpoint was hit on the device or promoted and demoted again) or a branch point (saved where
a prompt left a prefix an earlier one had read: two requests read its prefix, the popularity a hit shows), and not
shadowed (a turn end that a later turn of its chain went past has served what it was kept for). The victim is the
unpinned checkpoint due first (ties: the unproven one); within each queue that is the oldest demotion, so only the
two queues' heads are compared. (Why branch points: docs/cache.md, "Online rules measured"; what an offline-optimal
host order reaches behind the same device policy, and the online orders screened against this one: "The ceiling of
the tier as built" there.)

Worked example (host of 100 blocks, so `protection` = 100): `a` (proven) is demoted at clock 0, due at 100; then
`b` and `c` (unproven) at clock 10 and 20, due at 10 and 20. The host's eviction drops `b`, then `c`, then `a`
(unless something demoted after clock 100 is due earlier). With plain order of demotion `a` went first.

A host item is never touched (a hit promotes it out of the host), so recency inside the host adds nothing.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator

from hybridcache.cache.checkpoint import Checkpoint
from hybridcache.cache.request import SaveReason


def proven_at_demotion(ckpt: Checkpoint) -> bool:
    """Whether the host keeps device checkpoint `ckpt`, being demoted now, as a proven one (the module docstring):
    hit before or a branch point, and not shadowed. Read before the demotion clears `shadowed`."""
    return (ckpt.was_hit or ckpt.reason is SaveReason.BRANCH_POINT) and not ckpt.shadowed


class HostOrder:
    """The probation and proven queues of host checkpoints, each oldest demotion first, and the clock (host blocks
    allocated so far). `protection`: how many clock ticks later a proven checkpoint is due than an unproven one
    demoted at the same time."""

    def __init__(self, protection: int) -> None:
        self.protection = protection
        self.clock = 0
        self._probation: OrderedDict[int, Checkpoint] = OrderedDict()
        self._proven: OrderedDict[int, Checkpoint] = OrderedDict()
        self._due: dict[int, int] = {}

    def tick(self, num_blocks: int = 1) -> None:
        """`num_blocks` host blocks were allocated."""
        self.clock += num_blocks

    def add(self, ckpt: Checkpoint, proven: bool) -> None:
        """`ckpt` joins the host tier now (proven: see the module docstring)."""
        queue = self._proven if proven else self._probation
        queue[ckpt.ckpt_id] = ckpt
        self._due[ckpt.ckpt_id] = self.clock + (self.protection if proven else 0)

    def remove(self, ckpt: Checkpoint) -> None:
        """`ckpt` leaves the host tier (dropped, or promoted)."""
        del self._due[ckpt.ckpt_id]
        if self._probation.pop(ckpt.ckpt_id, None) is None:
            del self._proven[ckpt.ckpt_id]

    def victim(self) -> Checkpoint | None:
        """The unpinned host checkpoint due first (ties: the unproven one); None when every one is pinned."""
        heads = [c for c in (_first_unpinned(self._probation), _first_unpinned(self._proven)) if c is not None]
        return min(heads, key=lambda c: self._due[c.ckpt_id], default=None)

    def is_proven(self, ckpt: Checkpoint) -> bool:
        return ckpt.ckpt_id in self._proven

    def due(self, ckpt: Checkpoint) -> int:
        return self._due[ckpt.ckpt_id]

    def ids(self) -> Iterator[int]:
        """Every host checkpoint id it orders."""
        yield from self._probation
        yield from self._proven


def _first_unpinned(queue: OrderedDict[int, Checkpoint]) -> Checkpoint | None:
    return next((c for c in queue.values() if c.num_pins == 0), None)
