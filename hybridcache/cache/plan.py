"""The copy plan of one forward: typed copy ops per pool, and their builder.

A `CopyPlan` is a tuple of `CopyOp`s, at most one per `CopyKind`, in execution order (every op that runs
before the forward first). Each op copies `src_ids[i] -> dst_ids[i]` within one pool:

    kind            pool    phase            pairs
    KV_RESTORE      KV      BEFORE_FORWARD   (frozen_block, request_block)
    STATE_RESTORE   STATE   BEFORE_FORWARD   (checkpoint_slot, request_slot)
    KV_SAVE         KV      AFTER_FORWARD    (request_block, frozen_block)
    STATE_SAVE      STATE   AFTER_FORWARD    (request_slot, checkpoint_slot)

KV ids are scheduler block ids, state ids are slot ids (one slot covers every recurrent layer's state).
Within an op destinations are unique and no destination is also a source; sources may repeat (one
checkpoint restored into several requests). A new tier (device <-> pinned host) is a new `Pool` member and
new kinds, not a new field.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Pool(enum.Enum):
    KV = "kv"
    STATE = "state"


class Phase(enum.Enum):
    BEFORE_FORWARD = "before_forward"
    AFTER_FORWARD = "after_forward"


class CopyKind(enum.Enum):
    """What a copy op does; its value is (pool, phase). Declaration order is execution order."""

    KV_RESTORE = (Pool.KV, Phase.BEFORE_FORWARD)
    STATE_RESTORE = (Pool.STATE, Phase.BEFORE_FORWARD)
    KV_SAVE = (Pool.KV, Phase.AFTER_FORWARD)
    STATE_SAVE = (Pool.STATE, Phase.AFTER_FORWARD)

    @property
    def pool(self) -> Pool:
        return self.value[0]

    @property
    def phase(self) -> Phase:
        return self.value[1]


@dataclass(frozen=True)
class CopyOp:
    """`src_ids[i] -> dst_ids[i]` for every i, in `kind.pool`; both tuples have the same length >= 1."""

    kind: CopyKind
    src_ids: tuple[int, ...]
    dst_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        dsts = set(self.dst_ids)
        if len(self.src_ids) != len(self.dst_ids) or not self.dst_ids:
            raise AssertionError(f"{self.kind.name}: {len(self.src_ids)} sources for {len(self.dst_ids)} destinations")
        if len(dsts) != len(self.dst_ids):
            raise AssertionError(f"{self.kind.name}: repeated destination in {self.dst_ids}")
        both = sorted(dsts & set(self.src_ids))
        if both:
            raise AssertionError(f"{self.kind.name}: {both} are both source and destination")

    @property
    def pairs(self) -> list[tuple[int, int]]:
        return list(zip(self.src_ids, self.dst_ids))


@dataclass(frozen=True)
class CopyPlan:
    """The copies of one forward (see the module docstring); `ops` in execution order, one per kind at most."""

    ops: tuple[CopyOp, ...] = ()

    def pairs(self, kind: CopyKind) -> list[tuple[int, int]]:
        """The (src, dst) pairs of one kind; [] when the plan has none."""
        return next((op.pairs for op in self.ops if op.kind is kind), [])

    def phase(self, phase: Phase) -> tuple[CopyOp, ...]:
        return tuple(op for op in self.ops if op.kind.phase is phase)

    @property
    def is_empty(self) -> bool:
        return not self.ops


class PlanBuilder:
    """Collects the copies of one step; `build` validates and returns them and starts a new plan."""

    def __init__(self) -> None:
        self._pairs: dict[CopyKind, list[tuple[int, int]]] = {kind: [] for kind in CopyKind}

    def add(self, kind: CopyKind, src: int, dst: int) -> None:
        self._pairs[kind].append((src, dst))

    def build(self) -> CopyPlan:
        ops = []
        for kind, pairs in self._pairs.items():
            if pairs:
                src_ids, dst_ids = zip(*pairs)
                ops.append(CopyOp(kind, src_ids, dst_ids))
                pairs.clear()
        return CopyPlan(tuple(ops))
