"""`Lifecycle`: the pools, the checkpoints' states, trie insertion and removal, and eviction under pressure.

The facade (`PrefixCache`) owns the running sequences and asks in here for slots, blocks, trie nodes and
checkpoints; it reads the trie (to match) but changes it only through this class, which keeps the
`Evictor`'s indexes in step with every change. Rules kept here:
- A checkpoint goes RESERVED -> PUBLISHED -> RELEASED (checkpoint.py). A reserved checkpoint holds a slot
  (and a frozen block when partial) and one save pin; it is invisible to matches and to eviction until
  published on its anchor.
- Nothing pinned is ever released or evicted; a checkpoint marked `release_when_unpinned` (an older
  decode checkpoint) is released by the unpin that brings its pins to zero.
- `make_room` first asks the evictor whether enough could be reclaimed and only then evicts, so a failure
  changes nothing. The evictor picks each victim (evictor.py); `evict` releases it.
- Paged (`CacheConfig.state_pages` = k): a checkpoint's state takes k blocks (its pages) instead of a slot;
  slots are runtime slots only and are never evicted for. Blocks are the one budget: `make_room` evicts in
  `Evictor.byte_victim`'s order (a checkpoint frees k pages and its frozen block). A sequence that finishes
  (`adopt`) gets pages and a copy of its runtime slot into them, which the facade queues for the next plan.
- Host tier (`CacheConfig.host_blocks`, host_tier.py): `evict` demotes instead of releasing: a checkpoint
  (its pages and frozen block) to hang off the same anchor in the host tier, a leaf to a `HostNode` with its
  checkpoints (a leaf with nothing at or below it that a checkpoint could use is dropped, as before). When the
  host cannot make room, or for a checkpoint whose state is not written yet (`Checkpoint.unwritten`), or one a
  newer decode checkpoint replaced, it is released as before. `promote` brings a host checkpoint and its chain
  back. A device insert or publish absorbs its host twin (identity is unique across the tiers).
- A tier behind the host (`attach_behind`, host_tier.py's `TierBehind`: the disk tier) keeps what the host's own
  eviction drops; `adopt_stored` hangs a checkpoint it gives back in the host tier once its bytes are written
  there; `clear` clears it too.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

from hybridcache.cache.block_pool import BlockPool
from hybridcache.cache.checkpoint import Checkpoint, CheckpointState
from hybridcache.cache.config import CacheConfig, CostModel
from hybridcache.cache.events import CacheEvent, CacheEventLog, EventKind
from hybridcache.cache.evictor import Evictor, Victim
from hybridcache.cache.host_order import proven_at_demotion
from hybridcache.cache.host_tier import HostNode, HostTier, StoredCheckpoint, TierBehind
from hybridcache.cache.policy import make_eviction_policy
from hybridcache.cache.request import SaveReason
from hybridcache.cache.state_pool import StatePool
from hybridcache.cache.stats import DeclineCause, EvictionKind, StatsCounter
from hybridcache.cache.trie import Node, RootKey, Trie

ROOTS_SWEEP_AT = 64  # roots (adapters x cache salts) below which `Lifecycle.prune_roots` does not sweep


class Lifecycle:
    """Pools (`blocks`, `slots`), every checkpoint (`checkpoints`: id -> RESERVED or PUBLISHED checkpoint),
    the logical clock, and the `evictor`. Shares `trie` and `stats` with the facade."""

    def __init__(self, config: CacheConfig, cost: CostModel, trie: Trie, stats: StatsCounter) -> None:
        self.config = config
        self.block_size = config.block_size
        self.blocks = BlockPool(config.num_blocks)
        self.slots = StatePool(config.num_slots)
        self.trie = trie
        self.stats = stats
        self.evictor = Evictor(make_eviction_policy(config, cost), trie, self.blocks)
        self.block_bytes = config.block_size * cost.kv_bytes_per_token
        self.paged = config.paged
        self.state_pages = config.state_pages or 0
        self.state_bytes = self.state_pages * self.block_bytes if self.paged else cost.state_bytes
        self.checkpoints: dict[int, Checkpoint] = {}
        self.on_waste: Callable[[Checkpoint], None] | None = None  # a published checkpoint released unhit
        self.events: CacheEventLog | None = None  # where trie and checkpoint changes are told (events.py)
        self.host = HostTier(config.host_blocks, trie) if config.host_blocks else None
        if self.host is not None:
            self.blocks.on_free = self.host.cancel_load
            self.host.on_waste = lambda ckpt: self.on_waste(ckpt) if self.on_waste is not None else None
        self.clock = 0
        self._next_ckpt_id = 0
        self._roots_swept_at = ROOTS_SWEEP_AT  # sweep the roots when they grow past this (`prune_roots`)

    def tick(self) -> int:
        """Advance the logical clock (LRU time) and return it."""
        self.clock += 1
        return self.clock

    # ---- what running sequences hold (the caller made room first) ----------------------------------------

    def take_slot(self, owner: Hashable) -> int:
        return self.slots.allocate(owner)

    def free_slot(self, slot: int) -> None:
        self.slots.free(slot)

    def take_blocks(self, num_blocks: int) -> list[int]:
        """`num_blocks` private blocks (count 1 each)."""
        return [self.blocks.allocate() for _ in range(num_blocks)]

    def drop_blocks(self, block_ids: list[int]) -> None:
        """Drop one reference on each block (a block with no holder left is free again)."""
        for block_id in block_ids:
            self.blocks.decref(block_id)

    def share_path(self, nodes: list[Node], ckpt: Checkpoint, now: int) -> None:
        """A sequence starts from `ckpt`, whose anchor ends `nodes`: hold their blocks, mark all used at `now`."""
        for node in nodes:
            self.blocks.incref(node.block_id)
            node.last_access = now
        ckpt.anchor.last_access = now
        self.touch_checkpoint(ckpt, now)

    def insert_block(
        self, parent: Node, node_hash: int, token_ids: tuple[int, ...], spans: tuple, own_block: int, now: int,
    ) -> Node:
        """The node under `parent` for a sequence's full block `own_block` holding `token_ids`.

        New: the node takes a reference on `own_block`. Deduplicated (an identical node exists): the
        sequence's reference moves from `own_block` (freed when private) to the node's block, which the
        caller puts in its block list instead. Either way the node is marked used at `now`; the caller calls
        `leaf_changed` on the deepest node it inserted.
        """
        node = self.trie.find_child(parent, node_hash, token_ids, spans)
        if node is None:
            node = self.trie.add_child(parent, node_hash, token_ids, spans, own_block, now)
            self.blocks.incref(own_block)
            if self.events is not None:
                self.events.emit(CacheEvent(EventKind.BLOCK_STORED, block_hash=node_hash, parent_hash=parent.hash,
                                            depth=node.depth, adapter=node.adapter))
            if self.host is not None:
                self.host.inserted(node)
                self.host.absorb_twin(parent, node)
        else:
            self.blocks.incref(node.block_id)
            self.blocks.decref(own_block)
            self.stats.num_deduplicated_blocks += 1
        node.last_access = now
        return node

    # ---- reserve / adopt / publish / release -------------------------------------------------------------

    def reserve(
        self, root_key: RootKey, step: int, reason: SaveReason, routed_experts: Any, owner: Hashable,
    ) -> Checkpoint | None:
        """Take a slot or (paged) k pages, and a frozen block when `step % B != 0`, evicting under pressure;
        None if no room. `root_key`: the saving request's root (adapter and cache salt).

        The checkpoint starts RESERVED with one save pin (dropped by the caller once the save is queued).
        """
        partial = step % self.block_size != 0
        if not (self.make_room(partial + self.state_pages, 0) if self.paged else self.make_room(partial, 1)):
            return None
        ckpt_id = self._new_id()
        slot = None if self.paged else self.slots.allocate(Checkpoint.slot_owner_of(ckpt_id))
        pages = tuple(self.take_blocks(self.state_pages)) if self.paged else ()
        frozen_block = self.blocks.allocate() if partial else None
        ckpt = self._register(ckpt_id, root_key, step, reason, slot, frozen_block, routed_experts, owner, pages)
        ckpt.num_pins = 1
        return ckpt

    def adopt(
        self, root_key: RootKey, step: int, reason: SaveReason, slot: int, frozen_block: int | None,
        routed_experts: Any, owner: Hashable,
    ) -> Checkpoint:
        """A RESERVED checkpoint that takes over a sequence's partial block and its slot (no copy, no pin).

        Paged: the slot stays the sequence's (the caller frees it once the copy of its state into the new
        checkpoint's pages is queued); the pages are taken here, evicting under pressure, and None is returned
        (nothing changed) when there is no room. The caller keeps holding the sequence's blocks meanwhile, so
        the eviction cannot take the anchor the checkpoint will hang on."""
        if self.paged and not self.make_room(self.state_pages, 0):
            return None
        ckpt_id = self._new_id()
        if self.paged:
            pages = tuple(self.take_blocks(self.state_pages))
            return self._register(ckpt_id, root_key, step, reason, None, frozen_block, routed_experts, owner, pages)
        self.slots.transfer(slot, Checkpoint.slot_owner_of(ckpt_id))
        return self._register(ckpt_id, root_key, step, reason, slot, frozen_block, routed_experts, owner)

    def _new_id(self) -> int:
        ckpt_id = self._next_ckpt_id
        self._next_ckpt_id += 1
        return ckpt_id

    def _register(
        self, ckpt_id: int, root_key: RootKey, step: int, reason: SaveReason, slot: int | None,
        frozen_block: int | None, routed_experts: Any, owner: Hashable, pages: tuple[int, ...] = (),
    ) -> Checkpoint:
        ckpt = Checkpoint(
            ckpt_id=ckpt_id, adapter=root_key.adapter, step=step, reason=reason, slot=slot, frozen_block=frozen_block,
            routed_experts=routed_experts, owner=owner, last_access=self.tick(), pages=pages, salt=root_key.salt,
        )
        self.checkpoints[ckpt_id] = ckpt
        return ckpt

    def publish(self, ckpt: Checkpoint, anchor: Node, tail_ids: tuple[int, ...], tail_spans: tuple) -> bool:
        """Hang a reserved checkpoint on `anchor`, making it matchable.

        Returns False, and discards `ckpt` (its pins, slot and frozen block), when an identical checkpoint
        (same anchor, step, tail tokens and spans) is already published (that one is refreshed and learns
        the routed-expert history if it lacked it), or when the anchor is at its cap and every checkpoint
        on it is pinned. At the cap, the evictor's victim among the anchor's unpinned checkpoints goes.
        """
        if anchor.depth != ckpt.step // self.block_size or len(tail_ids) != ckpt.step % self.block_size:
            raise AssertionError(f"{ckpt} does not fit anchor {anchor} with a tail of {len(tail_ids)}")
        key = self.checkpoint_key(anchor, ckpt.step, tail_ids, tail_spans)
        if self.absorb_duplicate(anchor, key, tail_ids, tail_spans, ckpt.routed_experts):
            self._discard(ckpt, DeclineCause.DUPLICATE)
            return False
        twin = None if self.host is None else self.host.checkpoint_twin(anchor, key, tail_ids, tail_spans)
        if twin is not None:  # the host copy is being promoted: keep it; else the fresh device copy wins
            if twin.num_pins:
                self._discard(ckpt, DeclineCause.DUPLICATE)
                return False
            self.host.drop_checkpoint(twin, wasted=False)
        if anchor.num_checkpoints() >= self.config.max_checkpoints_per_anchor:
            victim = self.evictor.anchor_victim(anchor)
            if victim is None:
                self._discard(ckpt, DeclineCause.ANCHOR_FULL)
                return False
            self.evict(victim)
        ckpt.tail_ids, ckpt.tail_spans, ckpt.tail_hash = tail_ids, tail_spans, key[1]
        ckpt.anchor = anchor
        ckpt.state = CheckpointState.PUBLISHED
        ckpt.last_access = self.tick()
        anchor.checkpoints.setdefault(key, []).append(ckpt)
        self.evictor.on_publish(ckpt)
        self.stats.saves_by_reason[ckpt.reason.value] += 1
        if self.events is not None:
            self.events.emit(checkpoint_event(EventKind.CHECKPOINT_STORED, ckpt))
        return True

    def checkpoint_key(self, anchor: Node, step: int, tail_ids: tuple[int, ...], tail_spans: tuple) -> tuple:
        """The index key of a checkpoint at `step` on `anchor` with this tail: (step, tail hash)."""
        return step, self.trie.hash_fn(anchor.hash, tail_ids, tail_spans)

    def absorb_duplicate(
        self, anchor: Node, key: tuple, tail_ids: tuple[int, ...], tail_spans: tuple, routed_experts: Any,
    ) -> bool:
        """Whether a published checkpoint on `anchor` has index `key` (`checkpoint_key`) and exactly this tail;
        if so it is touched and takes `routed_experts` when it had none (a new save there would duplicate it)."""
        for other in anchor.checkpoints.get(key, ()):
            if other.tail_ids == tail_ids and other.tail_spans == tail_spans:
                if other.routed_experts is None:
                    other.routed_experts = routed_experts
                self.touch_checkpoint(other, self.tick())
                return True
        return False

    def _discard(self, ckpt: Checkpoint, cause: DeclineCause) -> None:
        ckpt.num_pins = 0
        self.release(ckpt, None)
        self.stats.declined(cause)

    def cancel(self, ckpt: Checkpoint) -> None:
        """Undo a reservation that will not be published (its sequence was aborted before the forward)."""
        if ckpt.state is not CheckpointState.RESERVED:
            raise AssertionError(f"cancel of {ckpt}")
        ckpt.num_pins = 0
        self.release(ckpt, None)

    def release(self, ckpt: Checkpoint, kind: EvictionKind | None) -> None:
        """Give back the slot or pages and the frozen block of an unpinned checkpoint; `kind` counts it as an
        eviction."""
        if ckpt.num_pins:
            raise AssertionError(f"release of pinned {ckpt}")
        if ckpt.state is CheckpointState.RELEASED:
            raise AssertionError(f"double release of {ckpt}")
        if ckpt.on_host:  # demoted since (e.g. an older decode checkpoint): it goes from the host tier
            self.host.drop_checkpoint(ckpt)
            if kind is not None:
                self.stats.evicted(kind)
            return
        if ckpt.state is CheckpointState.PUBLISHED:
            self._unpublish(ckpt)
            if not ckpt.was_hit and self.on_waste is not None:
                self.on_waste(ckpt)
        if ckpt.slot is not None:
            self.slots.free(ckpt.slot)
        self.drop_blocks(list(ckpt.pages))
        if ckpt.frozen_block is not None:
            self.blocks.decref(ckpt.frozen_block)
        ckpt.state = CheckpointState.RELEASED
        ckpt.anchor = None
        del self.checkpoints[ckpt.ckpt_id]
        if kind is not None:
            self.stats.evicted(kind)

    def _unpublish(self, ckpt: Checkpoint) -> None:
        """Take a published device checkpoint off its anchor and out of the evictor's indexes."""
        anchor = ckpt.anchor
        key = (ckpt.step, ckpt.tail_hash)
        bucket = anchor.checkpoints[key]
        bucket.remove(ckpt)
        if not bucket:
            del anchor.checkpoints[key]
        self.evictor.on_unpublish(ckpt, anchor)
        if self.events is not None:  # events tell the device tier: a demotion is a removal there
            self.events.emit(checkpoint_event(EventKind.CHECKPOINT_REMOVED, ckpt))

    def replace_decode_checkpoint(self, old: Checkpoint) -> None:
        """A newer decode-interval checkpoint of the same sequence was published: `old` goes now, or by
        the unpin that frees it when it is pinned."""
        if old.state is not CheckpointState.PUBLISHED:
            return
        if old.num_pins:
            old.release_when_unpinned = True
        else:
            self.release(old, EvictionKind.DECODE_REPLACED)

    def set_shadowed(self, ckpt: Checkpoint, shadowed: bool) -> None:
        """Mark a published device checkpoint shadowed (a deeper one of its chain exists) or not (it was hit);
        a host checkpoint is never shadowed (the host tier has its own order)."""
        if ckpt.state is CheckpointState.PUBLISHED and not ckpt.on_host and ckpt.shadowed != shadowed:
            ckpt.shadowed = shadowed
            self.evictor.on_shadow(ckpt, shadowed)

    def pin(self, ckpt: Checkpoint) -> None:
        if not ckpt.is_usable:
            raise AssertionError(f"pin of unusable {ckpt}")
        ckpt.num_pins += 1

    def unpin(self, ckpt: Checkpoint) -> None:
        if ckpt.num_pins <= 0:
            raise AssertionError(f"unpin of unpinned {ckpt}")
        ckpt.num_pins -= 1
        if ckpt.num_pins == 0 and ckpt.release_when_unpinned:
            self.release(ckpt, EvictionKind.DECODE_REPLACED)

    def published(self) -> list[Checkpoint]:
        return [c for c in self.checkpoints.values() if c.state is CheckpointState.PUBLISHED]

    def bytes_held(self) -> float:
        """What the blocks and slots in use hold, priced by the cost model (paged: the blocks, pages included;
        runtime slots are outside the budget)."""
        if self.paged:
            return self.blocks.num_used * self.block_bytes
        return self.blocks.num_used * self.block_bytes + self.slots.num_used * self.state_bytes

    def usage(self) -> dict[str, int]:
        """The pool and checkpoint sizes `CacheStats` reports."""
        host = self.host
        return {
            "num_blocks_used": self.blocks.num_used,
            "num_slots_used": self.slots.num_used,
            "num_checkpoints": self.evictor.num_published,
            "num_host_blocks_used": 0 if host is None else host.num_used,
            "num_host_checkpoints": 0 if host is None else len(host.order),
            "num_host_nodes": 0 if host is None else host.num_nodes,
        }

    # ---- recency bookkeeping (keeps the evictor's indexes current) ---------------------------------------

    def touch_checkpoint(self, ckpt: Checkpoint, now: int) -> None:
        """A published checkpoint was used at `now` (the newest clock value)."""
        ckpt.last_access = now
        self.evictor.on_touch(ckpt)

    def leaf_changed(self, node: Node) -> None:
        """`node` may have become a leaf or changed its recency: see `Evictor.leaf_changed`."""
        self.evictor.leaf_changed(node)

    # ---- eviction ----------------------------------------------------------------------------------------

    def make_room(self, num_blocks: int, num_slots: int) -> bool:
        """Evict until `num_blocks` blocks and `num_slots` slots are free; False (no change) if impossible."""
        if self.paged:
            return self._make_room_paged(num_blocks, num_slots)
        need_slots = num_slots - self.slots.num_free
        need_blocks = num_blocks - self.blocks.num_free
        if need_slots <= 0 and need_blocks <= 0:
            return True
        evictor = self.evictor
        if need_slots > 0 and not evictor.can_free_slots(need_slots):
            return False
        if need_blocks > 0 and not evictor.can_free_blocks(need_blocks):
            return False
        while self.slots.num_free < num_slots:
            self.evict(_promised(evictor.slot_victim(), "slot"))
        while self.blocks.num_free < num_blocks:
            self.evict(_promised(evictor.block_victim(), "block"))
        return True

    def _make_room_paged(self, num_blocks: int, num_slots: int) -> bool:
        """`make_room` when blocks are the one budget: runtime slots are never evicted for (False when too few
        are free); blocks are freed in `Evictor.byte_victim`'s order (a checkpoint frees its pages)."""
        if num_slots > self.slots.num_free:
            return False
        need = num_blocks - self.blocks.num_free
        if need <= 0:
            return True
        if not self.evictor.can_free_bytes(need * self.block_bytes, self.block_bytes, self.state_bytes):
            return False
        while self.blocks.num_free < num_blocks:
            self.evict(_promised(self.evictor.byte_victim(), "block"))
        return True

    def evict(self, victim: Victim) -> None:
        """Release what the evictor picked: a checkpoint, or a leaf with the checkpoints hanging on it; with a
        host tier, demote it there instead when it can."""
        target = victim.target
        if isinstance(target, Checkpoint):
            if self._demotable(target) and self.host.make_room(_num_blocks(target)):
                self._demote_checkpoint(target, target.anchor)
                self.stats.evicted(victim.kind)
            else:
                self.release(target, victim.kind)
            return
        if self.host is not None and self._demote_leaf(target, victim.kind):
            return
        for ckpt in list(target.iter_checkpoints()):
            self.release(ckpt, EvictionKind.LEAF_CHECKPOINT)
        self._remove_leaf(target, victim.kind)

    # ---- the host tier -----------------------------------------------------------------------------------

    def _demotable(self, ckpt: Checkpoint) -> bool:
        """Whether an evicted checkpoint goes to the host tier (else it is released)."""
        return (self.host is not None and ckpt.state is CheckpointState.PUBLISHED and not ckpt.num_pins
                and not ckpt.release_when_unpinned)

    def _demote_checkpoint(self, ckpt: Checkpoint, owner: Node | HostNode) -> None:
        """Move a published, unpinned, written device checkpoint to hang off `owner` in the host tier (the
        caller made host room for its blocks): HOST_SAVE copies are queued, its device blocks freed. An unwritten
        checkpoint's pages get host blocks with no copy: the facade's next plan writes them from the runtime slot
        (HOST_FINISH instead of STATE_FINISH)."""
        host = self.host
        self._unpublish(ckpt)
        proven = proven_at_demotion(ckpt)  # the host keeps it longer (host_order.py)
        ckpt.shadowed = False  # the host tier has its own order; a promotion comes with a hit, which clears it
        device_ids = [*ckpt.pages, *(() if ckpt.frozen_block is None else (ckpt.frozen_block,))]
        host_ids = [host.allocate() if ckpt.unwritten and i < len(ckpt.pages) else host.save(block_id)
                    for i, block_id in enumerate(device_ids)]
        self.drop_blocks(device_ids)
        ckpt.pages = tuple(host_ids[:len(ckpt.pages)])
        ckpt.frozen_block = None if ckpt.frozen_block is None else host_ids[-1]
        del self.checkpoints[ckpt.ckpt_id]
        host.hang_checkpoint(ckpt, owner, proven)
        self.stats.num_demoted_checkpoints += 1

    def _demote_leaf(self, node: Node, kind: EvictionKind) -> bool:
        """Demote evictable leaf `node` and its demotable checkpoints to the host tier; False (nothing changed)
        when nothing at or below it could be used (no checkpoint on it, nothing hanging off it in the host) or
        the host cannot make room."""
        host = self.host
        ckpts = [c for c in node.iter_checkpoints() if self._demotable(c)]
        if not ckpts and node not in host.under:
            return False
        if not host.make_room(1 + sum(_num_blocks(c) for c in ckpts)):
            return False
        if not ckpts and node not in host.under:  # making room dropped what hung off it
            return False
        for ckpt in list(node.iter_checkpoints()):
            if ckpt not in ckpts:
                self.release(ckpt, EvictionKind.LEAF_CHECKPOINT)
        hnode = host.demote_node(node, host.save(node.block_id))
        for ckpt in ckpts:
            self._demote_checkpoint(ckpt, hnode)
            self.stats.evicted(EvictionKind.LEAF_CHECKPOINT)
        self.stats.num_demoted_blocks += 1
        self._remove_leaf(node, kind)
        return True

    def promote_need(self, ckpt: Checkpoint) -> int:
        """Device blocks a promotion of host checkpoint `ckpt` takes: its host chain's nodes and its blocks."""
        return len(self.host.chain(ckpt)[1]) + _num_blocks(ckpt)

    def can_promote(self, ckpt: Checkpoint) -> bool:
        """Whether host checkpoint `ckpt` could join its device anchor (an anchor at its cap with every
        checkpoint pinned cannot take one more)."""
        frontier, chain = self.host.chain(ckpt)
        return bool(chain) or frontier.num_checkpoints() < self.config.max_checkpoints_per_anchor or (
            self.evictor.anchor_victim(frontier) is not None)

    def promote(self, ckpt: Checkpoint, now: int) -> None:
        """Bring pinned host checkpoint `ckpt` and the host chain it hangs on back to the device (the caller made
        room for `promote_need` blocks and checked `can_promote`): each host node becomes a device node (parent
        first) and `ckpt` is published on its device anchor again; HOST_LOAD copies are queued."""
        host = self.host
        parent, chain = host.chain(ckpt)
        for hnode in chain:
            node = self.trie.add_child(parent, hnode.hash, hnode.token_ids, hnode.spans, self.blocks.allocate(), now)
            host.promote_node(hnode, node)
            if self.events is not None:
                self.events.emit(CacheEvent(EventKind.BLOCK_STORED, block_hash=node.hash, parent_hash=parent.hash,
                                            depth=node.depth, adapter=node.adapter))
            parent = node
        anchor = parent
        self.evictor.leaf_changed(anchor)
        self.stats.num_promoted_blocks += len(chain)
        if anchor.num_checkpoints() >= self.config.max_checkpoints_per_anchor:
            self.evict(_promised(self.evictor.anchor_victim(anchor), "checkpoint on the anchor"))
        host.unhang_checkpoint(ckpt)
        device_ids = self.take_blocks(_num_blocks(ckpt))
        for host_id, device_id in zip((*ckpt.pages, *(() if ckpt.frozen_block is None else (ckpt.frozen_block,))),
                                      device_ids):
            host.load(host_id, device_id)
        ckpt.pages = tuple(device_ids[:len(ckpt.pages)])
        ckpt.frozen_block = None if ckpt.frozen_block is None else device_ids[-1]
        ckpt.anchor = anchor
        anchor.checkpoints.setdefault((ckpt.step, ckpt.tail_hash), []).append(ckpt)
        self.checkpoints[ckpt.ckpt_id] = ckpt
        self.evictor.on_publish(ckpt)
        if self.events is not None:
            self.events.emit(checkpoint_event(EventKind.CHECKPOINT_STORED, ckpt))
        self.stats.num_promoted_checkpoints += 1

    # ---- a tier behind the host (the disk tier) ----------------------------------------------------------

    def attach_behind(self, tier: TierBehind) -> None:
        """`tier` keeps what the host tier's own eviction drops and is asked on a match (host_tier.py,
        `TierBehind`). Needs a host tier."""
        if self.host is None:
            raise ValueError("a tier behind the host tier needs a host tier (CacheConfig.host_blocks)")
        self.host.on_fall_out = tier.keep
        self.host.behind = tier
        self.host.adopt = self.adopt_stored
        self.trie.root(None)  # a match walks from the base model's unsalted root: the first one asks the tier behind

    def adopt_stored(
        self, stored: StoredCheckpoint, read: Callable[[tuple[int, ...]], bool],
        write: Callable[[dict[int, int], tuple[int, ...]], None],
    ) -> bool:
        """Hang `stored` in the host tier, with the host nodes of its chain that neither tier holds, so that a match
        finds it there and promotes it as any host hit. Host room is made first (the host's own eviction), then
        `read(missing)` is asked for the bytes of the chain's blocks at indices `missing` (and of the state): False
        stops here. Then host blocks are taken and `write({chain index: host block}, the state's host blocks: k
        pages then the frozen tail)` fills them (before the next plan runs); only then are the nodes and the
        checkpoint hung, so that an exception from `write` frees the blocks, hangs nothing and goes to the caller
        (a checkpoint hung before its bytes were written would be served from whatever the blocks held). False,
        with no item added, when it is held already, the host cannot make room, or `read` failed."""
        host = self.host
        state_blocks = stored.num_pages + stored.has_frozen
        while True:
            walk = self._walk_stored(stored)
            if walk is None:
                return False
            owner, missing = walk
            need = len(missing) + state_blocks
            if host.num_free >= need:
                break
            if not host.make_room(need):
                return False
        if not read(missing):
            return False
        placed = {i: host.allocate() for i in missing}
        state_ids = tuple(host.allocate() for _ in range(state_blocks))
        try:
            write(placed, state_ids)
        except BaseException:
            for host_block in (*placed.values(), *state_ids):
                host.release(host_block)
            raise
        for i in missing:
            node_hash, token_ids = stored.chain[i]
            owner = host.add_node(owner, node_hash, token_ids, placed[i])
        ckpt = Checkpoint(ckpt_id=self._next_ckpt_id, adapter=None, step=stored.step,
                          reason=SaveReason(stored.reason), slot=None,
                          frozen_block=state_ids[-1] if stored.has_frozen else None, routed_experts=None,
                          owner=("stored", self._next_ckpt_id), last_access=self.tick(),
                          pages=state_ids[:stored.num_pages])
        self._next_ckpt_id += 1
        ckpt.tail_ids, ckpt.tail_hash = stored.tail_ids, self.checkpoint_key(owner, stored.step, stored.tail_ids, ())[1]
        ckpt.state = CheckpointState.PUBLISHED
        host.hang_checkpoint(ckpt, owner)
        return True

    def _walk_stored(self, stored: StoredCheckpoint) -> tuple[Node | HostNode, tuple[int, ...]] | None:
        """(the deepest node of `stored`'s chain either tier holds, the chain indices below it); None when the
        checkpoint itself is held (in either tier)."""
        owner: Node | HostNode = self.trie.root(None)
        held = 0
        for node_hash, token_ids in stored.chain:
            child = (self.trie.find_child(owner, node_hash, token_ids, ()) if isinstance(owner, Node) else None) \
                or self.host.find_child(owner, node_hash, token_ids, ())
            if child is None:
                break
            owner, held = child, held + 1
        if held == len(stored.chain):
            key = self.checkpoint_key(owner, stored.step, stored.tail_ids, ())
            hanging = self.host.hanging(owner)
            held_here = [*(owner.checkpoints.get(key, ()) if isinstance(owner, Node) else ()),
                         *(() if hanging is None else hanging.checkpoints.get(key, ()))]
            if any(c.tail_ids == stored.tail_ids and not c.tail_spans for c in held_here):
                return None
        return owner, tuple(range(held, len(stored.chain)))

    def _remove_leaf(self, node: Node, kind: EvictionKind | None) -> None:
        if self.host is not None:
            self.host.drop_under(node)  # a leaf removed without a host copy takes what hung off it
        parent = node.parent
        self.trie.remove_leaf(node)
        self.blocks.decref(node.block_id)
        if self.events is not None:
            self.events.emit(CacheEvent(EventKind.BLOCK_REMOVED, block_hash=node.hash))
        self.evictor.leaf_changed(parent)
        if kind is not None:
            self.stats.evicted(kind)

    def clear(self) -> None:
        """Release every unpinned checkpoint and every trie node no sequence or pinned checkpoint needs (the host
        tier's too), and drop what a tier behind the host keeps (`TierBehind.clear`: the disk tier's files)."""
        if self.host is not None:
            self.host.clear()
            if self.host.behind is not None:
                self.host.behind.clear()
        for ckpt in self.published():
            if ckpt.num_pins == 0:
                self.release(ckpt, None)

        def removable(node: Node) -> bool:
            return (self.blocks.ref_counts[node.block_id] == 1 and not node.checkpoints
                    and (self.host is None or node not in self.host.under))

        while True:
            victims = [n for n in self.trie.leaves if removable(n)]
            if not victims:
                break
            for node in victims:
                self._remove_leaf(node, None)
        self.prune_roots(force=True)

    def prune_roots(self, force: bool = False) -> None:
        """Forget the roots that hold nothing (no child, no checkpoint, nothing in the host tier), but the base
        model's unsalted one: each adapter and cache salt gets a root on first insert, and a client may send a new
        salt with every request, so emptied roots would pile up for the process's life. `Trie.root` makes one
        again on the next insert; a match finds none and misses, as it would on an empty root. Amortized: a sweep
        runs when the roots have doubled since the last one (`force`: now)."""
        roots = self.trie.roots
        if not force and len(roots) <= self._roots_swept_at:
            return
        for key, root in list(roots.items()):
            if key != RootKey() and not root.children and not root.checkpoints and (
                    self.host is None or root not in self.host.under):
                del roots[key]
        self._roots_swept_at = max(ROOTS_SWEEP_AT, 2 * len(roots))


def _num_blocks(ckpt: Checkpoint) -> int:
    """Blocks a paged checkpoint holds: its pages and its frozen block."""
    return len(ckpt.pages) + (ckpt.frozen_block is not None)


def checkpoint_event(kind: EventKind, ckpt: Checkpoint) -> CacheEvent:
    """The event of a published checkpoint (its anchor set): stored or removed."""
    return CacheEvent(kind, anchor_hash=ckpt.anchor.hash, step=ckpt.step, tail_hash=ckpt.tail_hash,
                      adapter=ckpt.adapter)


def _promised(victim: Victim | None, what: str) -> Victim:
    if victim is None:
        raise AssertionError(f"make_room promised a {what} that cannot be reclaimed")
    return victim
