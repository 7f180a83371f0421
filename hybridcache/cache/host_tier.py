"""The host tier: what device eviction demotes to host memory, and where a hit promotes it back from.

Host memory is `CacheConfig.host_blocks` blocks, each the size of a device block (the KV of B tokens, or one
page of a checkpoint's state). `Lifecycle` decides what moves; this class keeps the host side: the host blocks,
the host part of the trie, the host checkpoints, the host's eviction order and the copies a step must run.

The host part of the trie hangs off device nodes (`Hanging`: host children by hash, host checkpoints by key)::

    device:  root ── a ── b                     b: a device leaf (its device children were demoted)
             │            └╌╌ c' ╌╌ d'          c', d': HostNodes (their KV in host blocks); d' carries a
             │                                  host checkpoint, c' may carry some too
             └╌╌ ckpt@37'                       a host checkpoint on a device anchor (the root): demoted
                                                alone, under state pressure, while its anchor stayed

Rules (each checked by `integrity.check_host`):
- A host node's parent is a device node or a host node, and its children are host nodes: a demotion takes a
  device leaf, a promotion brings a chain back parent first.
- Identity is unique across the tiers: a device node and a host node never share parent, tokens and spans (a
  device insert absorbs its host twin: the twin's children and checkpoints move under the device node, its bytes
  are dropped), and a checkpoint key is on an anchor in one tier only.
- Every host leaf carries a checkpoint: KV with no checkpoint at or below it cannot be used by a hybrid model,
  so dropping a checkpoint also drops the host nodes it leaves dead.
- Every host block is held by exactly one host node (its KV) or one host checkpoint (a page of its state or its
  frozen tail), or is the source of a promotion of this step (reused from the next step on).
- Eviction (`make_room`, host_order.py): the unpinned host checkpoint due first, a checkpoint being due when it
  was demoted, or one host capacity of demotions later when it is proven (hit before or a branch point, not
  shadowed); what falls out is gone.

Behind it (the disk tier, `engine/disk_tier.py`): `on_fall_out` hears of every checkpoint `make_room` drops before
its blocks are freed (`fall_out`: its chain and state as a tier behind needs them; at shutdown `hand_behind` tells
it of every checkpoint the cache holds, the device pool's too), and `Lifecycle.adopt_stored` hangs a
`StoredCheckpoint` from there back in this tier, with the host nodes of its chain that neither tier holds, once its
bytes are in host blocks (`_fault_in`: the deepest one the host tier has room for).

Copies: a demotion queues `HOST_SAVE (device block -> host block)` and a promotion `HOST_LOAD (host block ->
device block)`; `end_step` hands them to the step's plan, saves first (plan.py says why that order is safe).
A device block promoted into and demoted again before the plan is built goes back to the host block it came
from, with no copy either way.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

from hybridcache.cache.block_pool import BlockPool
from hybridcache.cache.checkpoint import Checkpoint, CheckpointState
from hybridcache.cache.host_order import HostOrder
from hybridcache.cache.matching import Below, Divergence, below_node, divergence_at, find_deepest
from hybridcache.cache.request import CacheRequest
from hybridcache.cache.trie import Node, RootKey, Trie, path_to, prompt_block_hashes


@dataclass(frozen=True)
class FallOutBlock:
    """One full block of a fall-out's chain: its chained hash, its parent's, its tokens, and where its bytes are
    now (`on_host`: host block `block_id`, else device block `block_id`)."""

    hash: int
    parent_hash: int
    token_ids: tuple[int, ...]
    on_host: bool
    block_id: int


@dataclass(frozen=True)
class FallOut:
    """A checkpoint as a tier behind the host one needs it (`HostTier.fall_out`): one the host tier's own eviction
    is dropping, or at shutdown any the cache holds: the blocks from the root to its anchor (root's child first;
    the base model's unsalted trie, no spans), its step, tail and tail hash (chained from `anchor_hash`), why it was
    saved (`SaveReason` value), and the blocks of its k pages then its frozen tail (when the step is not
    block-aligned): host blocks, or device blocks when `state_on_host` is False (a checkpoint still in the device
    pool)."""

    blocks: tuple[FallOutBlock, ...]
    anchor_hash: int
    step: int
    tail_ids: tuple[int, ...]
    tail_hash: int
    reason: str
    num_pages: int
    state_host_ids: tuple[int, ...]
    state_on_host: bool = True


@dataclass(frozen=True)
class StoredCheckpoint:
    """A checkpoint a tier behind the host keeps (the disk tier), as the cache takes it back (`Lifecycle.
    adopt_stored`): its chain of (hash, tokens) blocks from the root's child to its anchor (the base model's unsalted
    trie, no spans), its step, tail, why it was saved (`SaveReason` value), its k pages and whether it has a frozen
    tail."""

    chain: tuple[tuple[int, tuple[int, ...]], ...]
    step: int
    tail_ids: tuple[int, ...]
    reason: str
    num_pages: int
    has_frozen: bool


class TierBehind(Protocol):
    """A tier behind the host one (the engine's disk tier, `engine/disk_keeper.py`), given to `PrefixCache`. The
    host tier tells it what its own eviction drops (`keep`), and asks it on a match (`find`) for checkpoints
    deeper than both tiers hold; the deepest one the host tier has room for is hung there (`Lifecycle.
    adopt_stored`) once `read` has fetched its bytes and `placed` has put them in the host blocks it was given
    (before the plan that promotes it runs; nothing is hung when either fails). `clear` drops what it keeps (the
    cache was cleared: `PrefixCache.clear`)."""

    def keep(self, fall_out: FallOut | None) -> None:
        """A host checkpoint is being dropped (its blocks are readable during the call); None: not keepable."""

    def find(self, request: CacheRequest, block_size: int, max_step: int) -> Iterable[StoredCheckpoint]:
        """The checkpoints it holds that `request` can use (step <= `max_step`), deepest first (the host tier takes
        the deepest it has room for, and stops there). Asked only for requests under the base model's unsalted root
        (no adapter, no cache salt): what it keeps is theirs."""

    def read(self, stored: StoredCheckpoint, missing: tuple[int, ...]) -> bool:
        """Fetch and check the bytes of `stored` (one `find` gave) of its state and of its chain's blocks at indices
        `missing`; False: not served (a miss)."""

    def placed(self, stored: StoredCheckpoint, block_ids: dict[int, int], state_ids: tuple[int, ...]) -> None:
        """Write what `read` fetched: chain block i into host block `block_ids[i]`, the state into `state_ids`. An
        exception leaves the host tier as it was (the blocks are freed, nothing is hung) and goes to the caller."""

    def clear(self) -> None:
        """Drop everything it keeps."""


class Hanging:
    """What hangs in the host tier off one owner: host child nodes (hash -> list) and host checkpoints
    ((step, tail hash) -> list), as on a trie node."""

    __slots__ = ("children", "checkpoints")

    def __init__(self) -> None:
        self.children: dict[int, list[HostNode]] = {}
        self.checkpoints: dict[tuple[int, int], list[Checkpoint]] = {}

    @property
    def is_empty(self) -> bool:
        return not self.children and not self.checkpoints

    def iter_checkpoints(self) -> Iterator[Checkpoint]:
        for bucket in self.checkpoints.values():
            yield from bucket

    def iter_children(self) -> Iterator[HostNode]:
        for bucket in self.children.values():
            yield from bucket

    def num_checkpoints(self) -> int:
        return sum(len(b) for b in self.checkpoints.values())


class HostNode(Hanging):
    """A trie node whose block's KV lives in host block `host_block`; `parent` is a device `Node` or a HostNode."""

    __slots__ = ("root_key", "parent", "hash", "token_ids", "spans", "host_block", "depth", "attached")

    def __init__(
        self, parent: Node | HostNode, *, node_hash: int, token_ids: tuple[int, ...], spans: tuple, host_block: int,
    ) -> None:
        super().__init__()
        self.root_key = parent.root_key
        self.parent = parent
        self.hash = node_hash
        self.token_ids = token_ids
        self.spans = spans
        self.host_block = host_block
        self.depth = parent.depth + 1
        self.attached = True

    is_root = False

    @property
    def adapter(self) -> str | None:
        return self.root_key.adapter

    def __repr__(self) -> str:
        return f"HostNode(adapter={self.adapter!r}, depth={self.depth}, host_block={self.host_block})"


Owner = Node | HostNode


class _View:
    """A device node seen through its host checkpoints (what `find_deepest` reads: `hash`, `checkpoints`)."""

    __slots__ = ("hash", "checkpoints")

    def __init__(self, node_hash: int, checkpoints: dict) -> None:
        self.hash = node_hash
        self.checkpoints = checkpoints


class HostTier:
    """Host blocks, the host part of the trie, host checkpoints, their eviction order and pending copies."""

    def __init__(self, num_blocks: int, trie: Trie) -> None:
        self.pool = BlockPool(num_blocks)
        self.trie = trie
        self.under: dict[Node, Hanging] = {}  # device node -> what hangs off it in the host tier
        self.order: OrderedDict[int, Checkpoint] = OrderedDict()  # host checkpoints, oldest demotion first
        self.queues = HostOrder(num_blocks)  # the host's own eviction order (host_order.py)
        self.num_nodes = 0
        self.num_dropped = 0  # host checkpoints dropped (what falls out of the host tier is gone)
        self.on_waste: Callable[[Checkpoint], None] | None = None  # a checkpoint dropped that was never hit
        # what the host's own eviction drops, told before its blocks are freed (None: it cannot be kept behind)
        self.on_fall_out: Callable[[FallOut | None], None] | None = None
        self.behind: TierBehind | None = None  # asked on a match (`find`); set with `adopt` by the lifecycle
        self.adopt: Callable[..., bool] | None = None  # `Lifecycle.adopt_stored`
        self._saves: dict[int, int] = {}  # host block -> device block it is saved from (this step)
        self._loads: dict[int, int] = {}  # device block -> host block it is loaded from (this step)
        self._finishes: set[int] = set()  # host blocks the plan being built writes by HOST_FINISH
        self._fresh: set[Node] = set()  # device nodes inserted since the last plan: their KV is not computed yet

    # ---- blocks and copies -------------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return self.pool.num_free

    @property
    def num_used(self) -> int:
        return self.pool.num_used

    def save(self, device_block: int) -> int:
        """The host block that will hold `device_block`'s bytes: a new one with a HOST_SAVE queued, or, when the
        device block is being loaded in this step, the host block it is loaded from (the load is cancelled)."""
        host_block = self._loads.pop(device_block, None)
        if host_block is not None:
            return host_block
        host_block = self.allocate()
        self._saves[host_block] = device_block
        return host_block

    def allocate(self) -> int:
        """A free host block (the caller made room), counted by the eviction order's clock."""
        self.queues.tick()
        return self.pool.allocate()

    def load(self, host_block: int, device_block: int) -> None:
        """Queue HOST_LOAD host_block -> device_block; the host block is freed once the step's plan is built."""
        if device_block in self._loads:
            raise RuntimeError(f"device block {device_block} is being loaded already (it was not freed since)")
        self._loads[device_block] = host_block

    def cancel_load(self, device_block: int) -> None:
        """`device_block` was freed: a load queued into it has no reader left, so it is dropped with its host block
        (a promoted item released in the step that promoted it; else the block, allocated again, would be written
        by a stale load, or loaded twice, losing the first host block)."""
        host_block = self._loads.pop(device_block, None)
        if host_block is not None:
            self.pool.decref(host_block)

    def finishing(self, host_block: int) -> None:
        """`host_block` is written by a HOST_FINISH of the plan being built: until then its bytes are not the
        checkpoint's, so a fall-out reading it is refused (`fall_out`)."""
        self._finishes.add(host_block)

    def release(self, host_block: int) -> None:
        """Free a host block whose item was dropped (a save into it queued in this step is dropped too)."""
        self._saves.pop(host_block, None)
        self.pool.decref(host_block)

    def end_step(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """This step's (device, host) saves and (host, device) loads, each in host block order (the device copies
        one run of consecutive host blocks at once: a chain promoted with its checkpoint was demoted at several
        times, so in promotion order its host blocks are many short runs); the loads' host blocks are free after."""
        saves = sorted(((device, host) for host, device in self._saves.items()), key=lambda pair: pair[1])
        loads = sorted((host, device) for device, host in self._loads.items())
        for host, _device in loads:
            self.pool.decref(host)
        self._saves, self._loads = {}, {}
        self._finishes.clear()
        self._fresh.clear()
        return saves, loads

    def inserted(self, node: Node) -> None:
        """Device node `node` was just inserted: its KV is computed by the forward of the plan being built (a
        fall-out until then cannot read it)."""
        self._fresh.add(node)

    def loading(self) -> list[int]:
        """Host blocks read by this step's loads (held by no host item, freed at `end_step`)."""
        return list(self._loads.values())

    def loading_into(self) -> list[int]:
        """Device blocks written by this step's loads (each held by what it was loaded for)."""
        return list(self._loads)

    def make_room(self, num_blocks: int) -> bool:
        """Drop unpinned host checkpoints, each the one due first (`HostOrder.victim`), until `num_blocks` host
        blocks are free; False (nothing dropped) when even dropping every unpinned one would not free enough."""
        if self.pool.num_free >= num_blocks:
            return True
        reclaimable = self.pool.num_free  # counted in any order, up to what is needed
        for ckpt in self.order.values():
            if ckpt.num_pins == 0:
                reclaimable += _num_blocks(ckpt) + _num_pruned(ckpt)
                if reclaimable >= num_blocks:
                    break
        if reclaimable < num_blocks:
            return False
        while self.pool.num_free < num_blocks:
            victim = self.queues.victim()
            if self.on_fall_out is not None:
                self.on_fall_out(self.fall_out(victim))
            self.drop_checkpoint(victim)
        return True

    def hand_behind(
        self, device_checkpoints: list[Checkpoint], progress: Callable[[int, int], None] | None = None,
    ) -> int:
        """Tell `on_fall_out` of every host checkpoint, then of each of `device_checkpoints` (the published ones
        still in the device pool), as if each fell out, while all stay where they are: at shutdown, so that a tier
        behind keeps across a restart what the cache holds. `progress(done, total)` after each. Returns how many
        were handed (0 with no tier behind)."""
        if self.on_fall_out is None:
            return 0
        handed = [*self.order.values(), *device_checkpoints]
        for done, ckpt in enumerate(handed, 1):
            self.on_fall_out(self.fall_out(ckpt))
            if progress is not None:
                progress(done, len(handed))
        return len(handed)

    def fall_out(self, ckpt: Checkpoint) -> FallOut | None:
        """What a tier behind this one needs to keep checkpoint `ckpt`, a host one (its bytes are read before the
        drop frees its blocks) or, at shutdown, a published device one: the chain of blocks from the root to its
        anchor, in either tier, and its state's blocks. None when it cannot be kept: an adapter's, a cache salt's
        or multimodal content (not kept behind the host), a state not written yet (`unwritten`, or its HOST_FINISH
        in the plan being built), a host state whose save is still in the plan being built, a device state being
        loaded by it, a device node inserted since the last plan (its KV is computed by that plan's forward), or one
        promoted since the last plan from a host block whose own save is in that plan too (demoted and promoted
        again in one scheduling pass: the host block holds nothing of it until the plan runs).

        Read at once (the tier behind reads the blocks during `on_fall_out`), so a block whose copy is in the plan
        being built is read where its bytes are now: a device node promoted since the last plan from the host
        block it is loaded from, a host node demoted since then from the device block its HOST_SAVE reads (the
        plan's first copies, so nothing writes that block before the save; allocated again since, it is written
        by that plan only)."""
        frontier, host_nodes = self.chain(ckpt)
        device_nodes = path_to(frontier)
        nodes = [*device_nodes, *host_nodes]
        state_ids = (*ckpt.pages, *(() if ckpt.frozen_block is None else (ckpt.frozen_block,)))
        if (ckpt.root_key != RootKey() or ckpt.unwritten or ckpt.tail_spans or any(n.spans for n in nodes)
                or (ckpt.on_host and any(h in self._saves or h in self._finishes for h in state_ids))
                or any(n.host_block in self._finishes for n in host_nodes)
                or any(n in self._fresh or self._loads.get(n.block_id) in self._saves for n in device_nodes)
                or (not ckpt.on_host and any(b in self._loads for b in state_ids))):
            return None
        # a host node demoted since the last plan: its bytes are still in the device block its save reads
        blocks = tuple(FallOutBlock(n.hash, n.parent.hash, n.token_ids, n.host_block not in self._saves,
                                    self._saves.get(n.host_block, n.host_block)) for n in host_nodes)
        # a device node promoted since the last plan: its bytes are still in the host block it is loaded from
        blocks = tuple(FallOutBlock(n.hash, n.parent.hash, n.token_ids, n.block_id in self._loads,
                                    self._loads.get(n.block_id, n.block_id)) for n in device_nodes) + blocks
        return FallOut(blocks=blocks, anchor_hash=ckpt.anchor.hash, step=ckpt.step, tail_ids=ckpt.tail_ids,
                       tail_hash=ckpt.tail_hash, reason=ckpt.reason.value, num_pages=len(ckpt.pages),
                       state_host_ids=state_ids, state_on_host=ckpt.on_host)

    # ---- the host trie -----------------------------------------------------------------------------------

    def hanging(self, owner: Owner, create: bool = False) -> Hanging | None:
        """What hangs off `owner` (a HostNode is its own); None for a device node with nothing (unless `create`)."""
        if isinstance(owner, HostNode):
            return owner
        hanging = self.under.get(owner)
        if hanging is None and create:
            hanging = self.under[owner] = Hanging()
        return hanging

    def demote_node(self, node: Node, host_block: int) -> HostNode:
        """A host copy of device leaf `node` (the caller removes the device node): it hangs off the node's
        parent and takes over what hung off the node."""
        hnode = HostNode(node.parent, node_hash=node.hash, token_ids=node.token_ids, spans=node.spans,
                         host_block=host_block)
        moved = self.under.pop(node, None)
        if moved is not None:
            self._adopt(hnode, moved)
        self.hanging(node.parent, create=True).children.setdefault(hnode.hash, []).append(hnode)
        self.num_nodes += 1
        return hnode

    def add_node(self, parent: Owner, node_hash: int, token_ids: tuple[int, ...], host_block: int) -> HostNode:
        """A new host node under `parent` (no twin in either tier: the caller checked) whose KV is `host_block`;
        the caller hangs a checkpoint at or below it (every host leaf carries one)."""
        hnode = HostNode(parent, node_hash=node_hash, token_ids=token_ids, spans=(), host_block=host_block)
        self.hanging(parent, create=True).children.setdefault(node_hash, []).append(hnode)
        self.num_nodes += 1
        return hnode

    def find_child(self, owner: Owner, node_hash: int, token_ids: tuple[int, ...], spans: tuple) -> HostNode | None:
        """The host child of `owner` with exactly these tokens and spans, if any."""
        hanging = self.hanging(owner)
        return None if hanging is None else _find(hanging, node_hash, token_ids, spans)

    def hang_checkpoint(self, ckpt: Checkpoint, owner: Owner, proven: bool = False) -> None:
        """`ckpt` (its pages and frozen block already host blocks) now hangs off `owner` in the host tier;
        `proven`: hit before or a branch point (`proven_at_demotion`), so the host keeps it longer."""
        self.hanging(owner, create=True).checkpoints.setdefault((ckpt.step, ckpt.tail_hash), []).append(ckpt)
        ckpt.anchor = owner
        ckpt.on_host = True
        self.order[ckpt.ckpt_id] = ckpt
        self.queues.add(ckpt, proven)

    def unhang_checkpoint(self, ckpt: Checkpoint) -> Owner:
        """Take `ckpt` out of the host tier (its blocks are the caller's now); returns the owner it hung off.
        Host nodes it leaves dead are dropped."""
        owner = ckpt.anchor
        hanging = self.hanging(owner)
        key = (ckpt.step, ckpt.tail_hash)
        bucket = hanging.checkpoints[key]
        bucket.remove(ckpt)
        if not bucket:
            del hanging.checkpoints[key]
        del self.order[ckpt.ckpt_id]
        self.queues.remove(ckpt)
        ckpt.on_host = False
        self._prune(owner)
        return owner

    def drop_checkpoint(self, ckpt: Checkpoint, wasted: bool = True) -> None:
        """Drop an unpinned host checkpoint and its host blocks (and the host nodes it leaves dead); `wasted`:
        tell `on_waste` when it was never hit (not when a device copy superseded it)."""
        if ckpt.num_pins:
            raise AssertionError(f"drop of pinned host {ckpt}")
        self.unhang_checkpoint(ckpt)
        for host_block in (*ckpt.pages, *(() if ckpt.frozen_block is None else (ckpt.frozen_block,))):
            self.release(host_block)
        ckpt.state = CheckpointState.RELEASED
        ckpt.anchor = None
        self.num_dropped += 1
        if wasted and not ckpt.was_hit and self.on_waste is not None:
            self.on_waste(ckpt)

    def drop_under(self, node: Node) -> None:
        """`node` leaves the device trie without a host copy: drop everything that hangs off it."""
        hanging = self.under.get(node)
        if hanging is None:
            return
        stack: list[Hanging] = [hanging]
        while stack:
            item = stack.pop()
            for ckpt in list(item.iter_checkpoints()):
                self.drop_checkpoint(ckpt)  # prunes dead host nodes on the way up
            stack.extend(item.iter_children())
        self.under.pop(node, None)

    def promote_node(self, hnode: HostNode, node: Node) -> None:
        """Host node `hnode` is now device node `node` (same identity, under the device parent `hnode` hung
        off): what hung off `hnode` hangs off `node`, and its host block is loaded into `node.block_id`."""
        self._remove_child(self.hanging(hnode.parent), hnode)
        self._forget_if_empty(hnode.parent)
        self.load(hnode.host_block, node.block_id)
        self._adopt(node, hnode)
        self._detach(hnode)

    def absorb_twin(self, parent: Node, node: Node) -> bool:
        """Device node `node` was just inserted under `parent`: when a host node with its identity hangs off
        `parent`, what hangs off that twin moves under `node` and the twin's bytes are dropped. Returns whether
        there was one."""
        hanging = self.under.get(parent)
        twin = None if hanging is None else _find(hanging, node.hash, node.token_ids, node.spans)
        if twin is None:
            return False
        self._remove_child(hanging, twin)
        self._forget_if_empty(parent)
        self._adopt(node, twin)
        self.release(twin.host_block)
        self._detach(twin)
        return True

    def checkpoint_twin(
        self, anchor: Node, key: tuple[int, int], tail_ids: tuple, tail_spans: tuple,
    ) -> Checkpoint | None:
        """The host checkpoint on device node `anchor` with index `key` and exactly this tail, if any."""
        hanging = self.under.get(anchor)
        if hanging is None:
            return None
        return next((c for c in hanging.checkpoints.get(key, ()) if c.tail_ids == tail_ids
                     and c.tail_spans == tail_spans), None)

    def chain(self, ckpt: Checkpoint) -> tuple[Node, list[HostNode]]:
        """(the deepest device node above host checkpoint `ckpt`, the host nodes from below it down to the
        checkpoint's anchor); the list is empty when the anchor is a device node."""
        owner = ckpt.anchor
        nodes = []
        while isinstance(owner, HostNode):
            nodes.append(owner)
            owner = owner.parent
        nodes.reverse()
        return owner, nodes

    def continuation(self, path: list[Node], request: CacheRequest, block_size: int) -> list[HostNode]:
        """The host nodes that continue the device path `path` with the prompt's next full blocks (exact tokens
        and spans, as `walk_prompt` on the device), parent first; [] when none does."""
        owner: Hanging | None = self.under.get(path[-1]) if path else None
        if owner is None:
            return []
        prompt = request.prompt_ids
        hashes = prompt_block_hashes(request, block_size, self.trie.hash_fn)
        depth = len(path) - 1
        nodes: list[HostNode] = []
        while owner.children and depth < len(hashes):
            tokens = prompt[depth * block_size:(depth + 1) * block_size]
            owner = _find(owner, hashes[depth], tokens, request.spans_in(depth * block_size, (depth + 1) * block_size))
            if owner is None:
                break
            nodes.append(owner)
            depth += 1
        return nodes

    def find(
        self, path: list[Node], hosts: list[HostNode], request: CacheRequest, block_size: int, max_step: int,
    ) -> Checkpoint | None:
        """The deepest usable host checkpoint for `request`: on the device path's nodes, or on `hosts`, the host
        nodes that continue it (`continuation`). With a tier behind (`behind`), one it holds deeper than either
        tier's is first brought into this tier (`_fault_in`; only for the base model's unsalted root, the one root
        whose checkpoints go behind: `fall_out`)."""
        if (self.behind is not None and path and request.root_key == RootKey()
                and self._fault_in(path, hosts, request, block_size, max_step)):
            hosts = self.continuation(path, request, block_size)
        return self._find(path, hosts, request, block_size, max_step)

    def _find(
        self, path: list[Node], hosts: list[HostNode], request: CacheRequest, block_size: int, max_step: int,
    ) -> Checkpoint | None:
        if not self.order or not path:
            return None
        views: list[Any] = []
        empty: dict = {}
        for node in path:
            hanging = self.under.get(node)
            views.append(_View(node.hash, hanging.checkpoints if hanging is not None else empty))
        return find_deepest(self.trie, [*views, *hosts], request, block_size, max_step)

    def _fault_in(
        self, path: list[Node], hosts: list[HostNode], request: CacheRequest, block_size: int, max_step: int,
    ) -> bool:
        """Hang in this tier the deepest checkpoint the tier behind holds for `request` that is deeper than what the
        device path and this tier hold, that agrees with the prompt (`_agrees`) and that this tier has room for
        (a deeper one whose chain and state do not fit, or whose read fails, gives way to the next); whether it
        did. An exception from the tier behind's `placed` goes to the caller with nothing hung."""
        held = None
        for stored in self.behind.find(request, block_size, max_step):
            if held is None:  # what the device path and this tier hold (asked once there is a candidate)
                held = max((c.step for c in (find_deepest(self.trie, path, request, block_size, max_step),
                                             self._find(path, hosts, request, block_size, max_step))
                            if c is not None), default=0)
            if stored.step <= held:
                return False
            if not _agrees(stored, request, block_size, self.trie.hash_fn):
                continue
            if self.adopt(stored, partial(self.behind.read, stored), partial(self.behind.placed, stored)):
                return True
        return False

    def divergence(
        self, path: list[Node], hosts: list[HostNode], request: CacheRequest, block_size: int, max_step: int,
    ) -> Divergence:
        """How far the prompt agrees with cached content below the device path's last node, the host tier's part
        included, as `matching.divergence` on the device: the host nodes that continue the path, then the longest
        common prefix with a child block or a checkpoint tail of the deepest of them, or, when none continues it,
        of the path's last node in both tiers (its device children and tails and the host ones hanging off it:
        one trie position, so a tail in one tier on the way of a continuation in the other is counted with it);
        and how many of those leave the prompt there. A prompt that shares a demoted prefix thus still finds its
        branch point there, and what was demoted still counts towards its worth."""
        if hosts:
            owners = [_below_host(hosts[-1])]
        elif path:
            hanging = self.under.get(path[-1])
            owners = [below_node(self.trie, path[-1])] + ([_below_host(hanging)] if hanging is not None else [])
        else:
            return Divergence(0, 0)
        return divergence_at(request, (len(path) - 1 + len(hosts)) * block_size, block_size, owners, max_step)

    def clear(self) -> None:
        """Drop every unpinned host checkpoint (and the host nodes left dead)."""
        for ckpt in list(self.order.values()):
            if ckpt.num_pins == 0:
                self.drop_checkpoint(ckpt)

    def iter_nodes(self) -> Iterator[HostNode]:
        """Every host node, parents before children."""
        stack = [child for hanging in self.under.values() for child in hanging.iter_children()]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.iter_children())

    # ---- internals ---------------------------------------------------------------------------------------

    def _adopt(self, owner: Owner, source: Hanging) -> None:
        """Move `source`'s children and checkpoints to hang off `owner`."""
        target = self.hanging(owner, create=True)
        for child in source.iter_children():
            child.parent = owner
            target.children.setdefault(child.hash, []).append(child)
        for ckpt in source.iter_checkpoints():
            ckpt.anchor = owner
            target.checkpoints.setdefault((ckpt.step, ckpt.tail_hash), []).append(ckpt)
        source.children, source.checkpoints = {}, {}
        self._forget_if_empty(owner)

    def _forget_if_empty(self, owner: Owner) -> None:
        """A device node with nothing hanging off it has no entry in `under`."""
        if not isinstance(owner, HostNode) and owner in self.under and self.under[owner].is_empty:
            del self.under[owner]

    def _remove_child(self, hanging: Hanging, child: HostNode) -> None:
        bucket = hanging.children[child.hash]
        bucket.remove(child)
        if not bucket:
            del hanging.children[child.hash]

    def _detach(self, hnode: HostNode) -> None:
        hnode.attached = False
        hnode.children, hnode.checkpoints = {}, {}
        self.num_nodes -= 1

    def _prune(self, owner: Owner) -> None:
        """Drop host nodes from `owner` up that carry nothing (dead weight); forget an empty device hanging."""
        while isinstance(owner, HostNode) and owner.is_empty:
            parent = owner.parent
            self._remove_child(self.hanging(parent), owner)
            self.release(owner.host_block)
            self._detach(owner)
            owner = parent
        self._forget_if_empty(owner)


def _agrees(stored: StoredCheckpoint, request: CacheRequest, block_size: int, hash_fn: Callable) -> bool:
    """Whether `stored` is a checkpoint of `request`'s prompt: its chain's blocks are the prompt's full blocks, hash
    and tokens, its tail the prompt's next tokens (as the device trie verifies tokens after a hash match: what a
    tier behind answers is checked, not trusted)."""
    depth = len(stored.chain)
    if depth != stored.step // block_size or len(stored.tail_ids) != stored.step % block_size:
        return False
    prompt = request.prompt_ids
    hashes = prompt_block_hashes(request, block_size, hash_fn)
    return (len(hashes) >= depth and prompt[depth * block_size:stored.step] == stored.tail_ids
            and all(node_hash == hashes[i] and token_ids == prompt[i * block_size:(i + 1) * block_size]
                    for i, (node_hash, token_ids) in enumerate(stored.chain)))


def _below_host(owner: Hanging) -> Below:
    """What hangs off `owner` in the host tier (its children have no first-token index: filtered)."""
    return Below(owner, lambda token: [c for c in owner.iter_children() if c.token_ids[0] == token])


def _find(hanging: Hanging, node_hash: int, token_ids: tuple[int, ...], spans: tuple) -> HostNode | None:
    for child in hanging.children.get(node_hash, ()):
        if child.token_ids == token_ids and child.spans == spans:
            return child
    return None


def _num_pruned(ckpt: Checkpoint) -> int:
    """Host nodes that dropping `ckpt` alone would leave dead: its anchor when it carries nothing else, and the
    chain above it while each node carries only that one child (chains of different checkpoints are disjoint)."""
    owner = ckpt.anchor
    if not isinstance(owner, HostNode) or owner.num_checkpoints() != 1 or owner.children:
        return 0
    count = 1
    parent = owner.parent
    while isinstance(parent, HostNode) and not parent.checkpoints and sum(map(len, parent.children.values())) == 1:
        count += 1
        parent = parent.parent
    return count


def _num_blocks(ckpt: Checkpoint) -> int:
    return len(ckpt.pages) + (ckpt.frozen_block is not None)
