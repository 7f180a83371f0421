"""The copy plan of one forward: typed copy ops per pool, and their builder.

A `CopyPlan` is a tuple of `CopyOp`s, at most one per `CopyKind`, in execution order (every op that runs
before the forward first). Each op copies `src_ids[i] -> dst_ids[i]`:

    kind            pool    phase            pairs
    HOST_FINISH     HOST    BEFORE_FORWARD   (request_chunk, host_block)    host tier: a finish checkpoint demoted
                                                                            before its STATE_FINISH ran
    HOST_SAVE       HOST    BEFORE_FORWARD   (device_block, host_block)     host tier: demote (device -> host)
    HOST_LOAD       HOST    BEFORE_FORWARD   (host_block, device_block)     host tier: promote (host -> device)
    STATE_FINISH    STATE   BEFORE_FORWARD   (request_chunk, page)          paged states only
    KV_RESTORE      KV      BEFORE_FORWARD   (frozen_block, request_block)
    STATE_RESTORE   STATE   BEFORE_FORWARD   (checkpoint_slot, request_slot)  or paged: (page, request_chunk)
    KV_SAVE         KV      AFTER_FORWARD    (request_block, frozen_block)
    STATE_SAVE      STATE   AFTER_FORWARD    (request_slot, checkpoint_slot)  or paged: (request_chunk, page)
    STATE_ROLLBACK  STATE   AFTER_VERIFY     (draft_state, request_slot)    speculative decoding only

KV ids are scheduler block ids. State ids depend on where checkpoints keep their states
(`CacheConfig.state_pages`):
- two pools (`state_pages` None): slot ids; one slot covers every recurrent layer's state.
- paged (`state_pages` = k): a checkpoint's state lives in k blocks of the KV pool, its **pages**; a running
  sequence's state stays in its runtime slot, seen as k **chunks** `slot * k + j` (j = 0 .. k-1: the slot's
  state bytes, zero-padded to k pages, cut into k page-sized pieces). A save or restore lists the k chunks of
  one slot together, j in order. `STATE_FINISH` saves the runtime slot of a sequence that finished (or was
  preempted) after the forward that last wrote it was queued: it runs before every other copy of the next
  step, so a slot or page reused by that step is read first. Example (k = 2): a restore of the checkpoint in
  pages (40, 41) into runtime slot 3 is `STATE_RESTORE [(40, 6), (41, 7)]`.

Host ops (`CacheConfig.host_blocks`) copy whole blocks of the device pool (KV, or pages of a state) to and
from host blocks of the same size (HOST_FINISH: a runtime slot's chunks straight into the host pages of a
finish or preempt checkpoint demoted before its STATE_FINISH ran). They come first, saves before loads: a
device block freed by a demotion may be the destination of a promotion in the same plan, so it is read before
it is written. A host block read by a load is reused only after the plan is built, and one dropped from the
host takes its pending save with it (host_tier.py), so no host block is written twice or after it is read.
`STATE_ROLLBACK` is the plan of `PrefixCache.accept`, run once the drafts of a verify step are judged
(never part of a step's plan). A verify forward over `1 + n` tokens of a sequence keeps the recurrent state after
each of its first n positions in **draft states** (whole-slot rows beside the runtime slots, id
`slot * num_speculative_tokens + j` for the state after verify position j) and the state after all of them in the
slot. Accepting a < n drafts makes the slot's state the one after position a: `(slot * k + a, slot)`. Draft
states and slots are two id spaces (like chunks and pages), and the op is never paged: a whole slot is copied.

Within an op destinations are unique; where sources and destinations are ids of one space (KV blocks, state
slots), no destination is also a source. Sources may repeat (one checkpoint restored into several requests).
`Pool`, `Phase` and `CopyKind` live in `hybridcache.copy_kinds` (a pure-Python leaf that the kernels' side,
`hybridcache.forward_batch`, reads too) and are re-exported here.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridcache.copy_kinds import CopyKind, Phase, Pool

__all__ = ["CopyKind", "CopyOp", "CopyPlan", "Phase", "PlanBuilder", "Pool"]


@dataclass(frozen=True)
class CopyOp:
    """`src_ids[i] -> dst_ids[i]` for every i, in `kind.pool`; both tuples have the same length >= 1.
    `paged`: a state op between runtime chunks and pages (two id spaces; see the module docstring)."""

    kind: CopyKind
    src_ids: tuple[int, ...]
    dst_ids: tuple[int, ...]
    paged: bool = False

    def __post_init__(self) -> None:
        dsts = set(self.dst_ids)
        if len(self.src_ids) != len(self.dst_ids) or not self.dst_ids:
            raise AssertionError(f"{self.kind.name}: {len(self.src_ids)} sources for {len(self.dst_ids)} destinations")
        if len(dsts) != len(self.dst_ids):
            raise AssertionError(f"{self.kind.name}: repeated destination in {self.dst_ids}")
        if (self.paged and not self.kind.pageable) or (self.kind is CopyKind.STATE_FINISH and not self.paged):
            raise AssertionError(f"{self.kind.name}: paged={self.paged} (only state ops other than rollbacks are "
                                 "paged; finish ops are)")
        both = [] if self.paged or self.kind.two_spaces else sorted(dsts & set(self.src_ids))
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

    def __init__(self, paged_states: bool = False) -> None:
        self._pairs: dict[CopyKind, list[tuple[int, int]]] = {kind: [] for kind in CopyKind}
        self._paged = paged_states

    def add(self, kind: CopyKind, src: int, dst: int) -> None:
        self._pairs[kind].append((src, dst))

    def build(self) -> CopyPlan:
        ops = []
        for kind, pairs in self._pairs.items():
            if pairs:
                src_ids, dst_ids = zip(*pairs)
                ops.append(CopyOp(kind, src_ids, dst_ids, paged=self._paged and kind.pageable))
                pairs.clear()
        return CopyPlan(tuple(ops))
