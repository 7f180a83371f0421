"""The copy plan of one forward: `CheckpointCopies` and its builder.

    kv_restore    [(frozen_block, request_block), ...]     executed before the forward
    state_restore [(checkpoint_slot, request_slot), ...]   executed before the forward
    kv_save       [(request_block, frozen_block), ...]     executed after the forward
    state_save    [(request_slot, checkpoint_slot), ...]   executed after the forward

KV pairs are scheduler block ids, state pairs are slot ids. Within each list destinations are unique and
no destination is also a source; sources may repeat (one checkpoint restored into several requests).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class CheckpointCopies:
    kv_restore: list[tuple[int, int]] = field(default_factory=list)
    state_restore: list[tuple[int, int]] = field(default_factory=list)
    kv_save: list[tuple[int, int]] = field(default_factory=list)
    state_save: list[tuple[int, int]] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not (self.kv_restore or self.state_restore or self.kv_save or self.state_save)


def check_pairs(name: str, pairs: list[tuple[int, int]]) -> None:
    """Raise when a destination repeats or is also a source."""
    dsts = [d for _, d in pairs]
    if len(set(dsts)) != len(dsts):
        raise AssertionError(f"{name}: repeated destination in {pairs}")
    overlap = set(dsts) & {s for s, _ in pairs}
    if overlap:
        raise AssertionError(f"{name}: {sorted(overlap)} are both source and destination")


class PlanBuilder:
    """Collects the copies of one step; `build` validates and returns them and starts a new plan."""

    def __init__(self) -> None:
        self._lists: dict[str, list[tuple[int, int]]] = {}
        self._reset()

    def _reset(self) -> None:
        self._lists = {"kv_restore": [], "state_restore": [], "kv_save": [], "state_save": []}

    def add(self, kind: str, src: int, dst: int) -> None:
        self._lists[kind].append((src, dst))

    def build(self) -> CheckpointCopies:
        for name, pairs in self._lists.items():
            check_pairs(name, pairs)
        copies = CheckpointCopies(**self._lists)
        self._reset()
        return copies
