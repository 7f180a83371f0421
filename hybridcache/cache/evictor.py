"""`Evictor`: chooses what to evict, and never releases anything itself (`Lifecycle.evict` does).

Order, one victim at a time (`Lifecycle.make_room` asks again after each release, since a release can
make a new leaf evictable):

    state pressure (`slot_victim`): 1. a shadowed checkpoint (`Checkpoint.shadowed`), by policy -> SHADOWED
                                    2. an unpinned published checkpoint, by policy       -> CHECKPOINT
    KV pressure (`block_victim`):   1. a dead leaf: no checkpoint, no holder but the trie -> DEAD_BLOCK
                                       (nothing at or below it can use its KV: dead weight for a hybrid model)
                                    2. a shadowed checkpoint holding a frozen block, by policy -> SHADOWED
                                    3. a leaf by policy (no pinned checkpoint, no holder but the trie) -> LEAF
                                       (its checkpoints are released with it, each a LEAF_CHECKPOINT)
                                    4. a frozen tail: an unpinned partial checkpoint, by policy -> FROZEN_TAIL
                                       (only when no leaf can go: a state saves more per byte than a block)
    anchor cap (`anchor_victim`):   an unpinned checkpoint of a full anchor, by policy    -> ANCHOR_CAP
    one budget (`byte_victim`: KV and states in one pool of blocks, paged, `CacheConfig.state_pages`):
                                    1. a dead leaf -> DEAD_BLOCK; 2. a shadowed checkpoint -> SHADOWED;
                                    3. a leaf by policy -> LEAF; 4. a checkpoint by policy (slot + frozen
                                    block) -> CHECKPOINT
    (A policy that orders kinds itself, `orders_kinds` / `prefer_checkpoint`, the bounded oracle's, skips the
    shadowed steps.)

Victims come from indexes kept in step with every change (eviction_index.py; `Lifecycle` reports each
change through `on_publish`, `on_unpublish`, `on_touch`, `on_shadow` and `leaf_changed`): checkpoints (all,
those with a frozen block, the shadowed ones and the shadowed ones with a frozen block) in recency order
and leaves in lazily invalidated heaps, so one pick costs O(log n) instead of a scan. `reclaimable_blocks`
counts cheap certainties first and walks the trie only when they do not suffice. Each pick has a plain
list-based meaning (`policy.pick_checkpoint` / `policy.pick_leaf` over every candidate); the tests wrap
this class (tests/cache/checked_evictor.py) to check every pick against that full scan.

Where a policy plugs in: an eviction policy is an `EvictionPolicy` strategy (policy.py) with
`pick_checkpoint(candidates)` and `pick_leaf(candidates)`, registered by name. LRU and FLOP-aware override its
fast paths over these indexes (`pick_from_order`, `pick_live_leaf`); any other policy gets the full-scan pick,
correct and slower, until it earns a fast path. The evictor never asks which policy it holds.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridcache.cache.block_pool import BlockPool
from hybridcache.cache.checkpoint import Checkpoint
from hybridcache.cache.eviction_index import LeafHeap, RecencyOrder
from hybridcache.cache.policy import EvictionPolicy
from hybridcache.cache.stats import EvictionKind
from hybridcache.cache.trie import Node, Trie


@dataclass(frozen=True)
class Victim:
    """One eviction choice. `target` is a `Checkpoint` (CHECKPOINT, FROZEN_TAIL, ANCHOR_CAP: release it)
    or a leaf `Node` (DEAD_BLOCK, LEAF: release its checkpoints, then remove it and drop its block)."""

    kind: EvictionKind
    target: Checkpoint | Node


class Evictor:
    """Eviction indexes plus the policy's picks over them; reads the trie and the block counts."""

    def __init__(self, policy: EvictionPolicy, trie: Trie, blocks: BlockPool) -> None:
        self.policy = policy
        self.trie = trie
        self.blocks = blocks
        flop = policy.track_steps
        self._published = RecencyOrder(track_steps=flop)
        self._tails = RecencyOrder(track_steps=flop)  # published checkpoints that hold a frozen block
        self._shadowed = RecencyOrder(track_steps=flop)  # published shadowed checkpoints (`Checkpoint.shadowed`)
        self._shadowed_tails = RecencyOrder(track_steps=flop)  # those of them that hold a frozen block
        self._dead_leaves = LeafHeap(dead=True)
        self._live_leaves = LeafHeap(dead=False)

    # ---- index upkeep: Lifecycle reports every change ----------------------------------------------------

    def on_publish(self, ckpt: Checkpoint) -> None:
        """`ckpt` was just hung on its anchor."""
        self._published.add(ckpt)
        if ckpt.frozen_block is not None:
            self._tails.add(ckpt)
        self.leaf_changed(ckpt.anchor)

    def on_unpublish(self, ckpt: Checkpoint, anchor: Node) -> None:
        """`ckpt` was just taken off `anchor` (it is being released)."""
        self._published.remove(ckpt)
        if ckpt.frozen_block is not None:
            self._tails.remove(ckpt)
        if ckpt.shadowed:
            self._shadow_index(ckpt, False)
        self.leaf_changed(anchor)

    def on_touch(self, ckpt: Checkpoint) -> None:
        """A published checkpoint's `last_access` was just set to the newest clock value."""
        self._published.touch(ckpt)
        if ckpt.frozen_block is not None:
            self._tails.touch(ckpt)
        if ckpt.shadowed:
            self._shadowed.touch(ckpt)
            if ckpt.frozen_block is not None:
                self._shadowed_tails.touch(ckpt)
        self.leaf_changed(ckpt.anchor)

    def on_shadow(self, ckpt: Checkpoint, shadowed: bool) -> None:
        """A published checkpoint's `shadowed` flag was just set to `shadowed` (it changed)."""
        self._shadow_index(ckpt, shadowed)

    def _shadow_index(self, ckpt: Checkpoint, add: bool) -> None:
        orders = (self._shadowed, self._shadowed_tails) if ckpt.frozen_block is not None else (self._shadowed,)
        for order in orders:
            if add:
                order.insert(ckpt)  # shadowed long after its last use: not the newest of the order
            else:
                order.remove(ckpt)

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

    @property
    def num_published(self) -> int:
        return len(self._published)

    # ---- how much could be freed -------------------------------------------------------------------------

    def can_free_slots(self, num_slots: int) -> bool:
        """Whether evicting could free `num_slots` slots."""
        return self.reclaimable_slots(num_slots) >= num_slots

    def can_free_blocks(self, num_blocks: int) -> bool:
        """Whether evicting could free `num_blocks` blocks."""
        return self.reclaimable_blocks(num_blocks) >= num_blocks

    def can_free_bytes(self, num_bytes: float, block_bytes: float, state_bytes: float) -> bool:
        """Whether evicting could free `num_bytes` (every unpinned checkpoint frees a slot, every block counted
        by `reclaimable_blocks` a block; the two counts are disjoint)."""
        slots = self.reclaimable_slots(int(-(-num_bytes // state_bytes)) if state_bytes > 0 else None)
        rest = num_bytes - slots * state_bytes
        if rest <= 0:
            return True
        return block_bytes > 0 and self.reclaimable_blocks(int(-(-rest // block_bytes))) * block_bytes >= rest

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
        if enough is not None:
            bound = self._chain_bound(count, enough)
            if bound >= enough:
                return bound
        refs = self.blocks.ref_counts
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

    def _chain_bound(self, count: int, enough: int) -> int:
        """`count` plus the single-child chains above evictable leaves, stopping once `enough` is reached."""
        refs = self.blocks.ref_counts
        for leaf in self.trie.leaves:
            node = leaf
            while (
                node.parent is not None and refs[node.block_id] == 1
                and (node is leaf or len(node.children) == 1 and len(next(iter(node.children.values()))) == 1)
                and all(c.num_pins == 0 for c in node.iter_checkpoints())
            ):
                count += 1
                if count >= enough:
                    return count
                node = node.parent
        return count

    # ---- picks -------------------------------------------------------------------------------------------

    def is_evictable_leaf(self, node: Node) -> bool:
        """Only the trie holds its block and no checkpoint on it is pinned."""
        return self.blocks.ref_counts[node.block_id] == 1 and all(c.num_pins == 0 for c in node.iter_checkpoints())

    @property
    def shadowed_first(self) -> bool:
        """Whether shadowed checkpoints go first (every policy but one that orders kinds itself, the bounded
        oracle's `prefer_checkpoint`)."""
        return not self.policy.orders_kinds

    def shadowed_victim(self, frozen: bool = False) -> Checkpoint | None:
        """The policy's victim among the unpinned shadowed checkpoints (`frozen`: those with a frozen block)."""
        if not self.shadowed_first:
            return None
        return self._pick_checkpoint(self._shadowed_tails if frozen else self._shadowed)

    def slot_victim(self) -> Victim | None:
        """What to evict for a state slot: a shadowed checkpoint, else the policy's; None when every published
        checkpoint is pinned."""
        shadowed = self.shadowed_victim()
        if shadowed is not None:
            return Victim(EvictionKind.SHADOWED, shadowed)
        victim = self._pick_checkpoint(self._published)
        return None if victim is None else Victim(EvictionKind.CHECKPOINT, victim)

    def block_victim(self) -> Victim | None:
        """What to evict for a KV block, in the order of the module docstring; None when nothing can go."""
        dead = self.dead_leaf()
        if dead is not None:
            return Victim(EvictionKind.DEAD_BLOCK, dead)
        shadowed = self.shadowed_victim(frozen=True)
        if shadowed is not None:
            return Victim(EvictionKind.SHADOWED, shadowed)
        leaf = self.live_leaf()
        if leaf is not None:
            return Victim(EvictionKind.LEAF, leaf)
        tail = self.frozen_tail()
        return None if tail is None else Victim(EvictionKind.FROZEN_TAIL, tail)

    def byte_victim(self) -> Victim | None:
        """What to evict for blocks when KV and states share them (paged, `CacheConfig.state_pages`): a dead
        leaf, else the policy's leaf (with its checkpoints), else the policy's checkpoint; None when nothing
        can go. A policy may order the last two itself (`prefer_checkpoint(ckpt, leaf)`, the bounded oracle).

        Why leaves before checkpoints: per byte, a state saves far more than a block. A block saves the FLOPs
        of its B tokens; a state saves those of its whole prefix (the built-in model: a 4,800-token prefix
        from 114 KiB of state, against 64 tokens per 64 KiB block), and a checkpoint whose path is evicted
        goes with its leaf anyway. Within each kind the policy's order holds (LRU: the oldest first)."""
        dead = self.dead_leaf()
        if dead is not None:
            return Victim(EvictionKind.DEAD_BLOCK, dead)
        shadowed = self.shadowed_victim()
        if shadowed is not None:
            return Victim(EvictionKind.SHADOWED, shadowed)
        leaf = self.live_leaf()
        if leaf is not None and not self.policy.orders_kinds:
            return Victim(EvictionKind.LEAF, leaf)
        slot = self.slot_victim()
        if leaf is None or (slot is not None and self.policy.prefer_checkpoint(slot.target, leaf)):
            return slot
        return Victim(EvictionKind.LEAF, leaf)

    def anchor_victim(self, anchor: Node) -> Victim | None:
        """Which checkpoint of `anchor` (at its cap) makes way for a new one; None when all are pinned."""
        candidates = [c for c in anchor.iter_checkpoints() if c.num_pins == 0]
        if not candidates:
            return None
        return Victim(EvictionKind.ANCHOR_CAP, self.policy.pick_checkpoint(candidates))

    def dead_leaf(self) -> Node | None:
        """The oldest leaf with no checkpoint that only the trie holds."""
        refs = self.blocks.ref_counts
        return self._dead_leaves.pick(lambda n: refs[n.block_id] == 1)

    def frozen_tail(self) -> Checkpoint | None:
        """The policy's victim among the unpinned published checkpoints holding a frozen block."""
        return self._pick_checkpoint(self._tails)

    def live_leaf(self) -> Node | None:
        """The policy's victim among the evictable leaves (LRU: from the heap; otherwise a full scan)."""
        return self.policy.pick_live_leaf(self._live_leaves, self.trie.leaves, self.is_evictable_leaf)

    def _pick_checkpoint(self, order: RecencyOrder) -> Checkpoint | None:
        """The policy's victim among the unpinned checkpoints of `order` (None: there is none)."""
        return self.policy.pick_from_order(order)
