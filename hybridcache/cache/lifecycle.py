"""Checkpoint lifecycle (reserve -> publish -> pin/unpin -> release) and eviction under pressure.

`Lifecycle` owns the pools, the trie and every checkpoint; the facade (`PrefixCache`) owns the running
sequences and calls in here. Rules kept here:
- A reserved checkpoint holds a slot (and a frozen block when partial) and one save pin; it is invisible
  to matches and to eviction until published on its anchor.
- Nothing pinned is ever released or evicted; a checkpoint marked `release_when_unpinned` (an older
  decode checkpoint) is released by the unpin that brings its pins to zero.
- `make_room` first checks that enough could be reclaimed and only then evicts, so a failure changes
  nothing. Eviction order, one victim at a time:
    state pressure: unpinned published checkpoints, by policy;
    KV pressure:    1. dead leaves: leaves with no checkpoint and no holder but the trie (no checkpoint
                       at or below them can use their KV, so they are dead weight for a hybrid model);
                    2. frozen tails: unpinned partial checkpoints, by policy;
                    3. leaves by policy (no pinned checkpoint, no holder but the trie), releasing the
                       checkpoints hanging on them.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

from hybridcache.cache.block_pool import BlockPool
from hybridcache.cache.checkpoint import Checkpoint, CheckpointState
from hybridcache.cache.config import CacheConfig, CostModel
from hybridcache.cache.policy import make_policies
from hybridcache.cache.request import SaveReason
from hybridcache.cache.state_pool import StatePool
from hybridcache.cache.stats import StatsCounter
from hybridcache.cache.trie import HashFn, Node, Trie


class Lifecycle:
    def __init__(self, config: CacheConfig, cost: CostModel, hash_fn: HashFn) -> None:
        self.config = config
        self.block_size = config.block_size
        self.blocks = BlockPool(config.num_blocks)
        self.slots = StatePool(config.num_slots)
        self.trie = Trie(hash_fn)
        self.eviction, self.admission = make_policies(config, cost)
        self.stats = StatsCounter()
        self.checkpoints: dict[int, Checkpoint] = {}
        self.clock = 0
        self._next_ckpt_id = 0

    def tick(self) -> int:
        """Advance the logical clock (LRU time) and return it."""
        self.clock += 1
        return self.clock

    # ---- reserve / adopt / publish / release -------------------------------------------------------------

    def reserve(
        self, adapter: str | None, step: int, reason: SaveReason, routed_experts: Any, owner: Hashable,
    ) -> Checkpoint | None:
        """Take a slot (and a frozen block when `step % B != 0`), evicting under pressure; None if no room.

        The checkpoint starts RESERVED with one save pin (dropped by the caller once the save is queued).
        """
        partial = step % self.block_size != 0
        if not self.make_room(1 if partial else 0, 1):
            return None
        ckpt = self._new(adapter, step, reason, routed_experts, owner)
        ckpt.slot = self.slots.allocate(ckpt.slot_owner)
        ckpt.frozen_block = self.blocks.allocate() if partial else None
        ckpt.num_pins = 1
        return ckpt

    def adopt(
        self, adapter: str | None, step: int, reason: SaveReason, slot: int, frozen_block: int | None,
        routed_experts: Any, owner: Hashable,
    ) -> Checkpoint:
        """A RESERVED checkpoint that takes over a sequence's slot and partial block (no copy, no pin)."""
        ckpt = self._new(adapter, step, reason, routed_experts, owner)
        self.slots.transfer(slot, ckpt.slot_owner)
        ckpt.slot = slot
        ckpt.frozen_block = frozen_block
        return ckpt

    def _new(
        self, adapter: str | None, step: int, reason: SaveReason, routed_experts: Any, owner: Hashable,
    ) -> Checkpoint:
        ckpt_id = self._next_ckpt_id
        self._next_ckpt_id += 1
        ckpt = Checkpoint(ckpt_id, adapter, step, reason, -1, None, routed_experts, owner, self.tick())
        self.checkpoints[ckpt_id] = ckpt
        return ckpt

    def publish(self, ckpt: Checkpoint, anchor: Node, tail_ids: tuple[int, ...], tail_spans: tuple) -> bool:
        """Hang a reserved checkpoint on `anchor`, making it matchable.

        Returns False, and discards `ckpt` (its pins, slot and frozen block), when an identical checkpoint
        (same anchor, step, tail tokens and spans) is already published (that one is refreshed and learns
        the routed-expert history if it lacked it), or when the anchor is at its cap and every checkpoint
        on it is pinned. At the cap, the policy's victim among the anchor's unpinned checkpoints goes.
        """
        if anchor.depth != ckpt.step // self.block_size or len(tail_ids) != ckpt.step % self.block_size:
            raise AssertionError(f"{ckpt} does not fit anchor {anchor} with a tail of {len(tail_ids)}")
        tail_hash = self.trie.hash_fn(anchor.hash, tail_ids, tail_spans)
        key = (ckpt.step, tail_hash)
        for other in anchor.checkpoints.get(key, ()):
            if other.tail_ids == tail_ids and other.tail_spans == tail_spans:
                if other.routed_experts is None:
                    other.routed_experts = ckpt.routed_experts
                other.last_access = self.tick()
                self._discard(ckpt, "duplicate")
                return False
        if anchor.num_checkpoints() >= self.config.max_checkpoints_per_anchor:
            candidates = [c for c in anchor.iter_checkpoints() if c.num_pins == 0]
            if not candidates:
                self._discard(ckpt, "anchor_full")
                return False
            self.release(self.eviction.pick_checkpoint(candidates), "anchor_cap")
        ckpt.tail_ids, ckpt.tail_spans, ckpt.tail_hash = tail_ids, tail_spans, tail_hash
        ckpt.anchor = anchor
        ckpt.state = CheckpointState.PUBLISHED
        ckpt.last_access = self.tick()
        anchor.checkpoints.setdefault(key, []).append(ckpt)
        self.stats.saves_by_reason[ckpt.reason.value] += 1
        return True

    def _discard(self, ckpt: Checkpoint, cause: str) -> None:
        ckpt.num_pins = 0
        self.release(ckpt, None)
        self.stats.declined_saves[cause] += 1

    def cancel(self, ckpt: Checkpoint) -> None:
        """Undo a reservation that will not be published (its sequence was aborted before the forward)."""
        if ckpt.state is not CheckpointState.RESERVED:
            raise AssertionError(f"cancel of {ckpt}")
        ckpt.num_pins = 0
        self.release(ckpt, None)

    def release(self, ckpt: Checkpoint, kind: str | None) -> None:
        """Give back the slot and frozen block of an unpinned checkpoint; `kind` counts it as an eviction."""
        if ckpt.num_pins:
            raise AssertionError(f"release of pinned {ckpt}")
        if ckpt.state is CheckpointState.RELEASED:
            raise AssertionError(f"double release of {ckpt}")
        if ckpt.state is CheckpointState.PUBLISHED:
            anchor = ckpt.anchor
            key = (ckpt.step, ckpt.tail_hash)
            bucket = anchor.checkpoints[key]
            bucket.remove(ckpt)
            if not bucket:
                del anchor.checkpoints[key]
        self.slots.free(ckpt.slot)
        if ckpt.frozen_block is not None:
            self.blocks.decref(ckpt.frozen_block)
        ckpt.state = CheckpointState.RELEASED
        ckpt.anchor = None
        del self.checkpoints[ckpt.ckpt_id]
        if kind is not None:
            self.stats.evictions_by_kind[kind] += 1

    def pin(self, ckpt: Checkpoint) -> None:
        if not ckpt.is_usable:
            raise AssertionError(f"pin of unusable {ckpt}")
        ckpt.num_pins += 1

    def unpin(self, ckpt: Checkpoint) -> None:
        if ckpt.num_pins <= 0:
            raise AssertionError(f"unpin of unpinned {ckpt}")
        ckpt.num_pins -= 1
        if ckpt.num_pins == 0 and ckpt.release_when_unpinned:
            self.release(ckpt, "decode_replaced")

    def published(self) -> list[Checkpoint]:
        return [c for c in self.checkpoints.values() if c.state is CheckpointState.PUBLISHED]

    # ---- eviction ----------------------------------------------------------------------------------------

    def make_room(self, num_blocks: int, num_slots: int) -> bool:
        """Evict until `num_blocks` blocks and `num_slots` slots are free; False (no change) if impossible."""
        need_slots = num_slots - self.slots.num_free
        need_blocks = num_blocks - self.blocks.num_free
        if need_slots <= 0 and need_blocks <= 0:
            return True
        if need_slots > 0 and self.reclaimable_slots() < need_slots:
            return False
        if need_blocks > 0 and self.reclaimable_blocks(need_blocks) < need_blocks:
            return False
        while self.slots.num_free < num_slots:
            self._evict_for_slot()
        while self.blocks.num_free < num_blocks:
            self._evict_for_block()
        return True

    def reclaimable_slots(self) -> int:
        """Slots that evicting every unpinned checkpoint would free."""
        return sum(1 for c in self.published() if c.num_pins == 0)

    def reclaimable_blocks(self, enough: int | None = None) -> int:
        """Blocks that evicting every unpinned thing would free (stops counting early at `enough`)."""
        count = sum(1 for c in self.published() if c.num_pins == 0 and c.frozen_block is not None)
        if enough is not None and count >= enough:
            return count
        removable: dict[Node, bool] = {}
        for node in reversed(list(self.trie.iter_nodes())):
            if node.is_root:
                continue
            ok = (
                self.blocks.ref_counts[node.block_id] == 1
                and all(c.num_pins == 0 for c in node.iter_checkpoints())
                and all(removable[child] for bucket in node.children.values() for child in bucket)
            )
            removable[node] = ok
            count += ok
        return count

    def _evict_for_slot(self) -> None:
        candidates = [c for c in self.published() if c.num_pins == 0]
        self.release(self.eviction.pick_checkpoint(candidates), "checkpoint")

    def _evict_for_block(self) -> None:
        leaves = [n for n in self.trie.leaves if self.blocks.ref_counts[n.block_id] == 1]
        dead = [n for n in leaves if not n.checkpoints]
        if dead:
            self._remove_leaf(self.eviction.pick_leaf(dead), "dead_block")
            return
        tails = [c for c in self.published() if c.num_pins == 0 and c.frozen_block is not None]
        if tails:
            self.release(self.eviction.pick_checkpoint(tails), "frozen_tail")
            return
        live = [n for n in leaves if all(c.num_pins == 0 for c in n.iter_checkpoints())]
        if not live:
            raise AssertionError("make_room promised a block that cannot be reclaimed")
        victim = self.eviction.pick_leaf(live)
        for ckpt in list(victim.iter_checkpoints()):
            self.release(ckpt, "leaf_checkpoint")
        self._remove_leaf(victim, "leaf")

    def _remove_leaf(self, node: Node, kind: str | None) -> None:
        self.trie.remove_leaf(node)
        self.blocks.decref(node.block_id)
        if kind is not None:
            self.stats.evictions_by_kind[kind] += 1

    def clear(self) -> None:
        """Release every unpinned checkpoint and every trie node no sequence or pinned checkpoint needs."""
        for ckpt in self.published():
            if ckpt.num_pins == 0:
                self.release(ckpt, None)
        def removable(node: Node) -> bool:
            return self.blocks.ref_counts[node.block_id] == 1 and not node.checkpoints

        while True:
            victims = [n for n in self.trie.leaves if removable(n)]
            if not victims:
                break
            for node in victims:
                self._remove_leaf(node, None)
