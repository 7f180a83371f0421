"""Test oracle for eviction: an `Evictor` whose every answer is checked against a plain full scan.

The production evictor answers from indexes (recency orders, lazily invalidated leaf heaps, a pruned
FLOP-aware pick, a lower bound on reclaimable blocks). `CheckedEvictor` gives the same answers and, for
each, recomputes it from scratch (every published checkpoint, every trie leaf, the policy's list-based
`pick_checkpoint` / `pick_leaf`, the exact reclaimable count) and raises when the two differ.
Install it on a fresh cache with `check_picks(cache)`.
"""

from __future__ import annotations

from hybridcache.cache import PrefixCache
from hybridcache.cache.checkpoint import Checkpoint
from hybridcache.cache.eviction_index import leaf_recency
from hybridcache.cache.evictor import Evictor, Victim
from hybridcache.cache.lifecycle import Lifecycle
from hybridcache.cache.policy import FlopAwarePolicy, LruPolicy
from hybridcache.cache.trie import Node


def check_picks(cache: PrefixCache) -> PrefixCache:
    """Make every eviction pick of a fresh (empty) `cache` be checked against a full scan."""
    life = cache._life
    if life.checkpoints or life.trie.num_nodes:
        raise ValueError("install the checked evictor before the cache holds anything")
    life.evictor = CheckedEvictor(life)
    return cache


class CheckedEvictor(Evictor):
    def __init__(self, life: Lifecycle) -> None:
        plain = life.evictor
        super().__init__(plain.policy, plain.trie, plain.blocks)
        self._life = life

    def can_free_blocks(self, num_blocks: int) -> bool:
        enough = super().can_free_blocks(num_blocks)
        _agree(enough, self.reclaimable_blocks() >= num_blocks, "reclaimable blocks suffice")
        return enough

    def can_free_bytes(self, num_bytes: float, block_bytes: float, state_bytes: float) -> bool:
        enough = super().can_free_bytes(num_bytes, block_bytes, state_bytes)
        slots = sum(1 for c in self._life.published() if c.num_pins == 0)
        exact = slots * state_bytes + self.reclaimable_blocks() * block_bytes >= num_bytes
        _agree(enough, exact, "reclaimable bytes suffice")
        return enough

    def slot_victim(self) -> Victim | None:
        victim = super().slot_victim()
        candidates = [c for c in self._life.published() if c.num_pins == 0]
        shadowed = [c for c in candidates if c.shadowed] if self.shadowed_first else []
        want = self.policy.pick_checkpoint(shadowed or candidates) if candidates else None
        _agree(None if victim is None else victim.target, want, "slot victim")
        return victim

    def shadowed_victim(self, frozen: bool = False) -> Checkpoint | None:
        victim = super().shadowed_victim(frozen)
        shadowed = [c for c in self._life.published() if c.num_pins == 0 and c.shadowed
                    and (c.frozen_block is not None or not frozen)]
        want = self.policy.pick_checkpoint(shadowed) if shadowed and self.shadowed_first else None
        _agree(victim, want, "shadowed victim")
        return victim

    def dead_leaf(self) -> Node | None:
        dead = super().dead_leaf()
        refs = self.blocks.ref_counts
        expected = [n for n in self.trie.leaves if refs[n.block_id] == 1 and not n.checkpoints]
        want = self.policy.pick_leaf(expected) if expected else None
        if isinstance(self.policy, FlopAwarePolicy) and want is not None and dead is not None:
            # FLOP-aware ranks dead leaves by recency alone; equal recencies tie arbitrarily
            _agree(leaf_recency(dead), leaf_recency(want), "dead leaf recency")
        else:
            _agree(dead, want, "dead leaf")
        return dead

    def frozen_tail(self) -> Checkpoint | None:
        tail = super().frozen_tail()
        tails = [c for c in self._life.published() if c.num_pins == 0 and c.frozen_block is not None]
        _agree(tail, self.policy.pick_checkpoint(tails) if tails else None, "frozen tail")
        return tail

    def live_leaf(self) -> Node | None:
        victim = super().live_leaf()
        if isinstance(self.policy, LruPolicy):  # other policies pick by the full scan already
            live = [n for n in self.trie.leaves if self.is_evictable_leaf(n)]
            _agree(victim, self.policy.pick_leaf(live) if live else None, "live leaf")
        return victim


def _agree(fast: object, full: object, what: str) -> None:
    if fast is not full and fast != full:
        raise AssertionError(f"indexed {what} {fast!r} differs from the full scan's {full!r}")
