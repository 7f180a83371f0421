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
Victims come from indexes kept in step with every change (eviction_index.py): checkpoints in recency order
and leaves in lazily invalidated heaps, so one eviction costs O(log n) instead of a scan of every leaf and
checkpoint; `reclaimable_blocks` counts cheap certainties (unpinned frozen tails, evictable leaves) first
and walks the trie only when they do not suffice. With `verify_picks` set (tests), every victim is also
computed by a full scan with the policy's list-based pick and the two must agree.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

from hybridcache.cache.block_pool import BlockPool
from hybridcache.cache.checkpoint import Checkpoint, CheckpointState
from hybridcache.cache.config import CacheConfig, CostModel
from hybridcache.cache.eviction_index import LeafHeap, RecencyOrder, leaf_recency
from hybridcache.cache.policy import FlopAwarePolicy, LruPolicy, make_policies
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
        flop = isinstance(self.eviction, FlopAwarePolicy)
        self._published = RecencyOrder(track_steps=flop)
        self._tails = RecencyOrder(track_steps=flop)
        self._dead_leaves = LeafHeap(dead=True)
        self._live_leaves = LeafHeap(dead=False)
        self.verify_picks = False

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
                self.touch_checkpoint(other, self.tick())
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
        self._published.add(ckpt)
        if ckpt.frozen_block is not None:
            self._tails.add(ckpt)
        self.leaf_changed(anchor)
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
            self._published.remove(ckpt)
            if ckpt.frozen_block is not None:
                self._tails.remove(ckpt)
            self.leaf_changed(anchor)
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

    @property
    def num_published(self) -> int:
        return len(self._published)

    # ---- recency bookkeeping (keeps the eviction indexes current) ----------------------------------------

    def touch_checkpoint(self, ckpt: Checkpoint, now: int) -> None:
        """A published checkpoint was used at `now` (the newest clock value)."""
        ckpt.last_access = now
        self._published.touch(ckpt)
        if ckpt.frozen_block is not None:
            self._tails.touch(ckpt)
        self.leaf_changed(ckpt.anchor)

    def leaf_changed(self, node: Node) -> None:
        """`node` may have become a leaf, or changed its recency or its checkpoints: index it afresh.
        Called for every such change (see eviction_index.py); a no-op for roots and inner nodes."""
        if node.children or node.parent is None or not node.attached:
            return
        heap = self._live_leaves if node.checkpoints else self._dead_leaves
        heap.push(node)
        if len(heap) > 4 * len(self.trie.leaves) + 1024:
            leaves = [n for n in self.trie.leaves if bool(n.checkpoints) != heap.dead]
            heap.reset(leaves)

    # ---- eviction ----------------------------------------------------------------------------------------

    def make_room(self, num_blocks: int, num_slots: int) -> bool:
        """Evict until `num_blocks` blocks and `num_slots` slots are free; False (no change) if impossible."""
        need_slots = num_slots - self.slots.num_free
        need_blocks = num_blocks - self.blocks.num_free
        if need_slots <= 0 and need_blocks <= 0:
            return True
        if need_slots > 0 and self.reclaimable_slots(need_slots) < need_slots:
            return False
        if need_blocks > 0:
            enough = self.reclaimable_blocks(need_blocks) >= need_blocks
            if self.verify_picks:
                _agree(enough, self.reclaimable_blocks() >= need_blocks, "reclaimable blocks suffice")
            if not enough:
                return False
        while self.slots.num_free < num_slots:
            self._evict_for_slot()
        while self.blocks.num_free < num_blocks:
            self._evict_for_block()
        return True

    def reclaimable_slots(self, enough: int | None = None) -> int:
        """Slots that evicting every unpinned checkpoint would free (stops counting early at `enough`)."""
        return self._published.count_unpinned(enough)

    def reclaimable_blocks(self, enough: int | None = None) -> int:
        """Blocks that evicting every unpinned thing would free (stops counting early at `enough`).

        Certain first: unpinned frozen tails, then from each leaf up the chain of nodes that only the trie
        holds, with no pinned checkpoint, and (above the leaf) a single child: removing the leaf makes the
        next one a removable leaf, so each counts once. Only when those fall short is the trie walked::

            root ── a ── b ── c (leaf)      c, b, a count (each has one child, only the trie holds it)
                         └── d (leaf, held by a sequence)   -> b has two children: the climb from c stops
        """
        count = self._tails.count_unpinned(enough)
        if enough is not None and count >= enough:
            return count
        refs = self.blocks.ref_counts
        if enough is not None:
            bound = count
            for leaf in self.trie.leaves:
                node = leaf
                while (
                    node.parent is not None and refs[node.block_id] == 1
                    and (node is leaf or len(node.children) == 1 and len(next(iter(node.children.values()))) == 1)
                    and all(c.num_pins == 0 for c in node.iter_checkpoints())
                ):
                    bound += 1
                    if bound >= enough:
                        return bound
                    node = node.parent
        removable: dict[Node, bool] = {}
        for node in reversed(list(self.trie.iter_nodes())):
            if node.is_root:
                continue
            ok = (
                refs[node.block_id] == 1
                and all(c.num_pins == 0 for c in node.iter_checkpoints())
                and all(removable[child] for bucket in node.children.values() for child in bucket)
            )
            removable[node] = ok
            count += ok
            if enough is not None and count >= enough:
                break
        return count

    def _pick_checkpoint(self, order: RecencyOrder) -> Checkpoint | None:
        """The policy's victim among the unpinned checkpoints of `order` (None: there is none)."""
        policy = self.eviction
        if isinstance(policy, LruPolicy):
            return order.first_unpinned()
        newest = next((c for c in order.newest_first() if c.num_pins == 0), None)
        if newest is None:
            return None
        if not policy.can_prune:
            return policy.pick_checkpoint([c for c in order.oldest_first() if c.num_pins == 0])
        top = max(
            policy.efficiency(c) for c in (order.max_step(True), order.max_step(False)) if c is not None
        )
        unpinned = (c for c in order.oldest_first() if c.num_pins == 0)
        return policy.pick_checkpoint_by_recency(unpinned, newest, top)

    def _evict_for_slot(self) -> None:
        victim = self._pick_checkpoint(self._published)
        if self.verify_picks:
            candidates = [c for c in self.published() if c.num_pins == 0]
            _agree(victim, self.eviction.pick_checkpoint(candidates) if candidates else None, "slot victim")
        if victim is None:
            raise AssertionError("make_room promised a slot that cannot be reclaimed")
        self.release(victim, "checkpoint")

    def _evict_for_block(self) -> None:
        refs = self.blocks.ref_counts
        dead = self._dead_leaves.pick(lambda n: refs[n.block_id] == 1)
        if self.verify_picks:
            leaves = [n for n in self.trie.leaves if refs[n.block_id] == 1]
            expected = [n for n in leaves if not n.checkpoints]
            want = self.eviction.pick_leaf(expected) if expected else None
            if isinstance(self.eviction, FlopAwarePolicy) and want is not None and dead is not None:
                # FLOP-aware ranks dead leaves by recency alone; equal recencies tie arbitrarily
                _agree(leaf_recency(dead), leaf_recency(want), "dead leaf recency")
            else:
                _agree(dead, want, "dead leaf")
        if dead is not None:
            self._remove_leaf(dead, "dead_block")
            return
        tail = self._pick_checkpoint(self._tails)
        if self.verify_picks:
            tails = [c for c in self.published() if c.num_pins == 0 and c.frozen_block is not None]
            _agree(tail, self.eviction.pick_checkpoint(tails) if tails else None, "frozen tail")
        if tail is not None:
            self.release(tail, "frozen_tail")
            return

        def unpinned(node: Node) -> bool:
            return refs[node.block_id] == 1 and all(c.num_pins == 0 for c in node.iter_checkpoints())

        if isinstance(self.eviction, LruPolicy):
            victim = self._live_leaves.pick(unpinned)
            if self.verify_picks:
                live = [n for n in self.trie.leaves if unpinned(n)]
                _agree(victim, self.eviction.pick_leaf(live) if live else None, "live leaf")
        else:
            live = [n for n in self.trie.leaves if unpinned(n)]
            victim = self.eviction.pick_leaf(live) if live else None
        if victim is None:
            raise AssertionError("make_room promised a block that cannot be reclaimed")
        for ckpt in list(victim.iter_checkpoints()):
            self.release(ckpt, "leaf_checkpoint")
        self._remove_leaf(victim, "leaf")

    def _remove_leaf(self, node: Node, kind: str | None) -> None:
        parent = node.parent
        self.trie.remove_leaf(node)
        self.blocks.decref(node.block_id)
        self.leaf_changed(parent)
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


def _agree(fast: object, full: object, what: str) -> None:
    if fast is not full and fast != full:
        raise AssertionError(f"indexed {what} {fast!r} differs from the full scan's {full!r}")
