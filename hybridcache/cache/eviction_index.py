"""Indexes that hand `Evictor` its victims without walking the trie or every checkpoint.

Two structures, both kept in step with the trie and the checkpoints by `Evictor` (told of every change by `Lifecycle`):

- `RecencyOrder`: published checkpoints in increasing `last_access`. Every write of `last_access` sets it
  to the newest clock value, so "move to the end on touch" keeps the order sorted. The LRU victim is the
  first unpinned entry (pinned checkpoints are few: the restores and saves of the step being planned).
  `max_step` gives the deepest unpinned entry of the frozen or the plain group, which is what the
  FLOP-aware policy needs to normalise efficiencies (efficiency is monotone in the step within a group).

- `LeafHeap`: trie leaves of one kind (dead: no checkpoint; live: with checkpoints) in a heap keyed by
  `(leaf recency, depth, block_id)`, lazily invalidated. An entry is valid while its node is an attached
  leaf of that kind with that recency; every event that can change one of those (a node becomes a leaf,
  a node or one of its checkpoints is touched, a checkpoint is published on or released from it) pushes a
  fresh entry, and stale entries are dropped when they reach the top. Entries whose node is valid but
  momentarily not evictable (held by a sequence, or a pinned checkpoint) are skipped and pushed back.

      heap top -> (5, 3, 17, .., n17)  stale: n17 got a child      -> dropped
                  (6, 2, 40, .., n40)  held by a running sequence  -> skipped, pushed back
                  (8, 4, 12, .., n12)  valid and evictable         -> the victim
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Iterator
from itertools import count

from hybridcache.cache.checkpoint import Checkpoint, CheckpointState
from hybridcache.cache.trie import Node


def leaf_recency(node: Node) -> int:
    """The last access of a leaf: its own or that of any checkpoint hanging on it, whichever is newer."""
    recency = node.last_access
    for bucket in node.checkpoints.values():
        for ckpt in bucket:
            if ckpt.last_access > recency:
                recency = ckpt.last_access
    return recency


class RecencyOrder:
    """Published checkpoints (all of them, or only those holding a frozen block) oldest first."""

    def __init__(self, track_steps: bool) -> None:
        self._order: OrderedDict[int, Checkpoint] = OrderedDict()
        self._track_steps = track_steps
        # per group (frozen block or not): heap of (-step, ckpt_id, ckpt); released entries dropped lazily
        self._steps: dict[bool, list[tuple[int, int, Checkpoint]]] = {True: [], False: []}

    def __len__(self) -> int:
        return len(self._order)

    def add(self, ckpt: Checkpoint) -> None:
        self._order[ckpt.ckpt_id] = ckpt
        if self._track_steps:
            heapq.heappush(self._steps[ckpt.frozen_block is not None], (-ckpt.step, ckpt.ckpt_id, ckpt))

    def insert(self, ckpt: Checkpoint) -> None:
        """Add `ckpt` at its place by (last_access, ckpt_id), which `add` assumes is the newest: an existing
        checkpoint joining an index (e.g. becoming shadowed). The entries used after it move behind it."""
        key = (ckpt.last_access, ckpt.ckpt_id)
        newer = []
        for other in reversed(self._order.values()):
            if (other.last_access, other.ckpt_id) < key:
                break
            newer.append(other.ckpt_id)
        self.add(ckpt)
        for ckpt_id in reversed(newer):
            self._order.move_to_end(ckpt_id)

    def touch(self, ckpt: Checkpoint) -> None:
        self._order.move_to_end(ckpt.ckpt_id)

    def remove(self, ckpt: Checkpoint) -> None:
        """Drop `ckpt`; the step heaps are rebuilt from the entries left once their dropped entries outnumber
        them (an entry below the deepest live step never reaches the top to be dropped lazily: over a server's
        life they held every checkpoint ever published)."""
        del self._order[ckpt.ckpt_id]
        if self._track_steps and sum(map(len, self._steps.values())) > 2 * len(self._order) + 64:
            self._steps = {True: [], False: []}
            for kept in self._order.values():
                self._steps[kept.frozen_block is not None].append((-kept.step, kept.ckpt_id, kept))
            for heap in self._steps.values():
                heapq.heapify(heap)

    def oldest_first(self) -> Iterator[Checkpoint]:
        return iter(self._order.values())

    def newest_first(self) -> Iterator[Checkpoint]:
        return reversed(self._order.values())

    def first_unpinned(self) -> Checkpoint | None:
        for ckpt in self._order.values():
            if ckpt.num_pins == 0:
                return ckpt
        return None

    def count_unpinned(self, enough: int | None = None) -> int:
        """Unpinned entries, counting stops at `enough`."""
        num = 0
        for ckpt in self._order.values():
            if ckpt.num_pins == 0:
                num += 1
                if enough is not None and num >= enough:
                    break
        return num

    def max_step(self, frozen: bool) -> Checkpoint | None:
        """The unpinned entry of the group with the largest step (ties: the lowest id), None if none."""
        heap = self._steps[frozen]
        skipped = []
        found = None
        while heap:
            entry = heap[0]
            ckpt = entry[2]
            if ckpt.state is not CheckpointState.PUBLISHED or ckpt.ckpt_id not in self._order:
                heapq.heappop(heap)
                continue
            if ckpt.num_pins == 0:
                found = ckpt
                break
            skipped.append(heapq.heappop(heap))
        for entry in skipped:
            heapq.heappush(heap, entry)
        return found


class LeafHeap:
    """Leaves with (`dead=False`) or without (`dead=True`) checkpoints, oldest first (see module docstring)."""

    def __init__(self, dead: bool) -> None:
        self.dead = dead
        self._heap: list[tuple[int, int, int, int, Node]] = []
        self._tiebreak = count()

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, node: Node) -> None:
        heapq.heappush(self._heap, (leaf_recency(node), node.depth, node.block_id, next(self._tiebreak), node))

    def reset(self, nodes: list[Node]) -> None:
        """Drop every entry and index `nodes` afresh (compaction)."""
        tiebreak = self._tiebreak
        self._heap = [(leaf_recency(n), n.depth, n.block_id, next(tiebreak), n) for n in nodes]
        heapq.heapify(self._heap)

    def _is_current(self, entry: tuple[int, int, int, int, Node]) -> bool:
        node = entry[4]
        return (
            node.attached and not node.children and (not node.checkpoints) == self.dead
            and entry[0] == leaf_recency(node)
        )

    def pick(self, evictable: Callable[[Node], bool]) -> Node | None:
        """The oldest current leaf for which `evictable` holds (its entry stays until it goes stale)."""
        heap = self._heap
        skipped = []
        victim = None
        while heap:
            entry = heap[0]
            if not self._is_current(entry):
                heapq.heappop(heap)
                continue
            if evictable(entry[4]):
                victim = entry[4]
                break
            skipped.append(heapq.heappop(heap))
        for entry in skipped:
            heapq.heappush(heap, entry)
        return victim
