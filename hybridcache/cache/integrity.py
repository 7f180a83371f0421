"""`check_integrity`: recompute every count of a prefix cache from scratch and compare.

It inspects the parts (the `Lifecycle`, the running sequences, the pending matches' checkpoints), not
the facade, so the facade imports it and nothing here imports the facade.

Checked: block reference counts equal their holders (trie nodes, running sequences, checkpoints' frozen tails,
paged checkpoints' pages) and the free list is exactly the blocks with count 0; every slot has exactly the
owner the pool records; trie hashes, depths, parent links, children index and leaf set; checkpoint geometry,
index keys, anchors and pins (pins == live matches + pending restores + pending saves); partial blocks are
private; sequences' trie nodes hold their blocks; a sequence's unjudged drafts (speculative decoding) lie in its
private blocks. With a host tier (host_tier.py): every host block is held
by exactly one host node or host checkpoint (or is read by a load of this step), every checkpoint is in one tier,
host nodes chain their hashes to their parents, carry a checkpoint at or below them, and have no device twin,
and each pending host hit holds the block of the deepest device node above its checkpoint.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Iterable, Mapping

from hybridcache.cache.checkpoint import Checkpoint, CheckpointState
from hybridcache.cache.host_tier import Hanging, HostNode
from hybridcache.cache.lifecycle import Lifecycle
from hybridcache.cache.sequence import PENDING_TOKEN, RunningSeq
from hybridcache.cache.trie import Node, root_hash


class IntegrityError(AssertionError):
    """A count or a link of the cache disagrees with what its holders say."""


def _fail(message: str) -> None:
    raise IntegrityError(message)


def check_integrity(
    life: Lifecycle, seqs: Mapping[Hashable, RunningSeq], matched: Iterable[Checkpoint | None],
    host_holds: Iterable[Node] = (),
) -> None:
    """Raise `IntegrityError` on the first disagreement. `seqs`: the running sequences by request id;
    `matched`: the checkpoint each pending match pinned (None for a miss); `host_holds`: the device node whose
    block each pending host hit holds.

    Each section below adds the holders it sees (of blocks: `holders`, of slots: `slot_owners`); the
    pools are checked last against those totals."""
    matched = list(matched)
    holders: Counter[int] = Counter()
    _check_trie(life, holders)
    slot_owners: dict[int, object] = {}
    pins = _expected_pins(seqs, matched)
    _check_checkpoints(life, pins, holders, slot_owners)
    _check_sequences(life, seqs, holders, slot_owners)
    if life.host is not None:
        _check_host(life, pins)
        frontiers = [life.host.chain(c)[0] for c in matched if c is not None and c.on_host]
        if sorted(id(n) for n in frontiers if not n.is_root) != sorted(id(n) for n in host_holds):
            _fail(f"host hits hold {list(host_holds)}, their checkpoints' frontiers are {frontiers}")
    for node in host_holds:
        holders[node.block_id] += 1
    _check_pools(life, holders, slot_owners)


def _check_trie(life: Lifecycle, holders: Counter[int]) -> None:
    """Hashes, depths, parent links, children and first-token indexes, node count, leaf set."""
    size, trie = life.block_size, life.trie
    num_nodes = 0
    leaves = set()
    for node in trie.iter_nodes():
        if not node.attached:
            _fail(f"{node} reachable but detached")
        if node.is_root:  # the salt stays out of the messages (it guards a tenant's prompts)
            if trie.roots.get(node.root_key) is not node:
                _fail(f"root of {node.adapter!r} (salted: {node.root_key.salt is not None}) is not registered")
            if node.hash != root_hash(*node.root_key):
                _fail(f"root of {node.adapter!r} hash {node.hash} != its root hash")
        else:
            if node.root_key != node.parent.root_key:
                _fail(f"{node} is under another root (adapter or cache salt) than its parent {node.parent}")
            num_nodes += 1
            holders[node.block_id] += 1
            if len(node.token_ids) != size:
                _fail(f"{node} holds {len(node.token_ids)} tokens, not {size}")
            if node.depth != node.parent.depth + 1:
                _fail(f"{node} depth {node.depth} under parent depth {node.parent.depth}")
            expected = trie.hash_fn(node.parent.hash, node.token_ids, node.spans)
            if node.hash != expected:
                _fail(f"{node} hash {node.hash} != recomputed {expected}")
            if node not in node.parent.children.get(node.hash, ()):
                _fail(f"{node} missing from its parent's children index")
            if not node.children:
                leaves.add(node)
        for key, bucket in node.children.items():
            if not bucket:
                _fail(f"{node} has an empty children bucket {key}")
            for child in bucket:
                if child.parent is not node or child.hash != key:
                    _fail(f"{child} indexed under {node} with key {key}")
        if node.by_first is not None:
            by_first = {t: sorted(id(c) for c in group) for t, group in node.by_first.items()}
            expected_first: dict[int, list[int]] = {}
            for bucket in node.children.values():
                for child in bucket:
                    expected_first.setdefault(child.token_ids[0], []).append(id(child))
            if by_first != {t: sorted(ids) for t, ids in expected_first.items()}:
                _fail(f"{node} first-token index differs from its children")
    if num_nodes != trie.num_nodes:
        _fail(f"trie counts {trie.num_nodes} nodes, found {num_nodes}")
    if leaves != trie.leaves:
        _fail(f"leaf set differs: extra {trie.leaves - leaves}, missing {leaves - trie.leaves}")



def _expected_pins(seqs: Mapping[Hashable, RunningSeq], matched: Iterable[Checkpoint | None]) -> Counter[int]:
    """Pins each checkpoint should have: one per pending match, pending restore and pending save."""
    pins: Counter[int] = Counter()
    for ckpt in matched:
        if ckpt is not None:
            pins[ckpt.ckpt_id] += 1
    for seq in seqs.values():
        if seq.restore is not None:
            pins[seq.restore.ckpt_id] += 1
        for ckpt in seq.saves:
            pins[ckpt.ckpt_id] += 1
    return pins


def _check_checkpoints(
    life: Lifecycle, pins: Counter[int], holders: Counter[int], slot_owners: dict[int, object],
) -> None:
    """Index keys, anchors, geometry, frozen blocks, pins and slots of every registered checkpoint."""
    size, trie = life.block_size, life.trie
    indexed = 0
    for node in trie.iter_nodes():
        if node.num_checkpoints() > life.config.max_checkpoints_per_anchor:
            _fail(f"{node} carries {node.num_checkpoints()} checkpoints, over the cap")
        for key, bucket in node.checkpoints.items():
            if not bucket:
                _fail(f"{node} has an empty checkpoint bucket {key}")
            for ckpt in bucket:
                indexed += 1
                if ckpt.anchor is not node or ckpt.state is not CheckpointState.PUBLISHED:
                    _fail(f"{ckpt} indexed on {node} but anchored on {ckpt.anchor}")
                if key != (ckpt.step, ckpt.tail_hash):
                    _fail(f"{ckpt} indexed under {key}")
                if ckpt.tail_hash != trie.hash_fn(node.hash, ckpt.tail_ids, ckpt.tail_spans):
                    _fail(f"{ckpt} tail hash does not match its tail")
    for ckpt_id, ckpt in life.checkpoints.items():
        if ckpt.ckpt_id != ckpt_id or ckpt.state is CheckpointState.RELEASED:
            _fail(f"{ckpt} registered under {ckpt_id}")
        q, r = divmod(ckpt.step, size)
        if ckpt.state is CheckpointState.PUBLISHED:
            indexed -= 1
            if ckpt.anchor is None or ckpt.anchor.depth != q or len(ckpt.tail_ids) != r:
                _fail(f"{ckpt} geometry: anchor {ckpt.anchor}, tail {len(ckpt.tail_ids)}, step {ckpt.step}")
            if ckpt.anchor.root_key != ckpt.root_key:
                _fail(f"{ckpt} of adapter {ckpt.adapter!r} on a node of {ckpt.anchor.adapter!r}, or of another salt")
        if ckpt.shadowed and ckpt.state is not CheckpointState.PUBLISHED:
            _fail(f"{ckpt} is shadowed before it is published")
        if ckpt.shadowed and not ckpt.reason.is_turn_end:
            _fail(f"{ckpt} is shadowed but is no turn end")
        if (ckpt.frozen_block is not None) != (r != 0):
            _fail(f"{ckpt} frozen block {ckpt.frozen_block} with tail length {r}")
        if ckpt.frozen_block is not None:
            holders[ckpt.frozen_block] += 1
        if ckpt.num_pins != pins[ckpt_id]:
            _fail(f"{ckpt} has {ckpt.num_pins} pins, holders say {pins[ckpt_id]}")
        if life.paged != (ckpt.slot is None) or len(ckpt.pages) != life.state_pages:
            _fail(f"{ckpt} holds slot {ckpt.slot} and pages {ckpt.pages} (paged: {life.paged})")
        for page in ckpt.pages:  # paged: its state's blocks, held by it alone
            holders[page] += 1
        if ckpt.slot is None:
            continue
        if ckpt.slot in slot_owners:
            _fail(f"slot {ckpt.slot} held by {ckpt} and {slot_owners[ckpt.slot]}")
        slot_owners[ckpt.slot] = ckpt.slot_owner
    if indexed != 0:
        _fail(f"{indexed} more checkpoints indexed on nodes than registered as published")
    host_ids = life.host.order if life.host is not None else {}
    for ckpt_id in pins:
        if ckpt_id not in life.checkpoints and ckpt_id not in host_ids:
            _fail(f"a pin is held on released checkpoint {ckpt_id}")
        if ckpt_id in life.checkpoints and ckpt_id in host_ids:
            _fail(f"checkpoint {ckpt_id} is in both tiers")


def _check_sequences(
    life: Lifecycle, seqs: Mapping[Hashable, RunningSeq], holders: Counter[int], slot_owners: dict[int, object],
) -> None:
    """Each running sequence's slot, trie nodes and blocks; its blocks past the trie are private."""
    size = life.block_size
    for rid, seq in seqs.items():
        if seq.slot in slot_owners:
            _fail(f"slot {seq.slot} of {rid!r} also held by {slot_owners[seq.slot]}")
        slot_owners[seq.slot] = seq.slot_owner
        if len(seq.nodes) != (seq.num_trie_blocks(size) if life.config.keeps_blocks else 0):
            _fail(f"{rid!r} has {len(seq.nodes)} trie nodes for {seq.num_computed} computed tokens")
        if len(seq.block_ids) * size < seq.num_computed:
            _fail(f"{rid!r} has {len(seq.block_ids)} blocks for {seq.num_computed} computed tokens")
        for i, node in enumerate(seq.nodes):
            if node.block_id != seq.block_ids[i] or node.depth != i + 1 or not node.attached:
                _fail(f"{rid!r} block {i} ({seq.block_ids[i]}) is not its trie node {node}")
            if node.token_ids != tuple(seq.token_ids[i * size:(i + 1) * size]):
                _fail(f"{rid!r} token list differs from its trie node {node} (a token changed after it was taken)")
        known = seq.num_computed - seq.pending
        if len(seq.token_ids) < seq.num_computed or PENDING_TOKEN in seq.token_ids[:known]:
            _fail(f"{rid!r} token list ({len(seq.token_ids)} tokens) does not hold its {known} known computed tokens")
        for block_id in seq.block_ids:
            holders[block_id] += 1
    for rid, seq in seqs.items():
        for block_id in seq.block_ids[len(seq.nodes):]:
            if holders[block_id] != 1:
                _fail(f"private block {block_id} of {rid!r} has {holders[block_id]} holders")
        if seq.num_drafts:  # speculative KV: only in blocks of its own, past its trie nodes
            first, end = seq.num_computed // size, -(-(seq.num_computed + seq.num_drafts) // size)
            if end > len(seq.block_ids) or first < len(seq.nodes):
                _fail(f"{rid!r} drafts at [{seq.num_computed}, {seq.num_computed + seq.num_drafts}) fall outside "
                      f"its private blocks (blocks {len(seq.nodes)}..{len(seq.block_ids) - 1})")


def _check_pools(life: Lifecycle, holders: Counter[int], slot_owners: dict[int, object]) -> None:
    """Reference counts equal holders; free lists are exactly the blocks and slots nobody holds."""
    blocks, slots = life.blocks, life.slots
    for block_id in range(blocks.num_blocks):
        if blocks.ref_counts[block_id] != holders[block_id]:
            _fail(f"block {block_id} ref count {blocks.ref_counts[block_id]} != {holders[block_id]} holders")
    free_blocks = blocks.free_ids()
    if sorted(free_blocks) != [b for b in range(blocks.num_blocks) if holders[b] == 0]:
        _fail(f"free block list {sorted(free_blocks)} is not the set of blocks without holders")
    for slot in range(slots.num_slots):
        if slots.owners[slot] != slot_owners.get(slot):
            _fail(f"slot {slot} owner {slots.owners[slot]} != holder {slot_owners.get(slot)}")
    free_slots = slots.free_ids()
    if sorted(free_slots) != [s for s in range(slots.num_slots) if s not in slot_owners]:
        _fail(f"free slot list {sorted(free_slots)} is not the set of slots without holders")


def _check_host(life: Lifecycle, pins: Counter[int]) -> None:
    """The host tier (host_tier.py's rules): host nodes, host checkpoints, the host pool and the order."""
    host, trie, size = life.host, life.trie, life.block_size
    holders: Counter[int] = Counter(host.loading())
    seen: set[int] = set()
    num_nodes = 0

    def check_hanging(owner: Node | HostNode, hanging: Hanging) -> None:
        for key, bucket in hanging.children.items():
            for child in bucket:
                if child.parent is not owner or child.hash != key or not child.attached:
                    _fail(f"{child} hangs off {owner} under {key} but names parent {child.parent}")
        for key, bucket in hanging.checkpoints.items():
            if not bucket:
                _fail(f"{owner} has an empty host checkpoint bucket {key}")
            for ckpt in bucket:
                seen.add(ckpt.ckpt_id)
                q, r = divmod(ckpt.step, size)
                if ckpt.anchor is not owner or not ckpt.on_host or ckpt.state is not CheckpointState.PUBLISHED:
                    _fail(f"host {ckpt} hangs off {owner} but is anchored on {ckpt.anchor} (on_host {ckpt.on_host})")
                if ckpt.root_key != owner.root_key:
                    _fail(f"host {ckpt} hangs off {owner}, under another root (adapter or cache salt)")
                if key != (ckpt.step, ckpt.tail_hash) or owner.depth != q or len(ckpt.tail_ids) != r:
                    _fail(f"host {ckpt} geometry: key {key}, anchor depth {owner.depth}, tail {len(ckpt.tail_ids)}")
                if ckpt.tail_hash != trie.hash_fn(owner.hash, ckpt.tail_ids, ckpt.tail_spans):
                    _fail(f"host {ckpt} tail hash does not match its tail")
                if len(ckpt.pages) != life.state_pages or (ckpt.frozen_block is not None) != (r != 0):
                    _fail(f"host {ckpt} holds pages {ckpt.pages} and frozen block {ckpt.frozen_block}")
                if ckpt.num_pins != pins[ckpt.ckpt_id]:
                    _fail(f"host {ckpt} has {ckpt.num_pins} pins, holders say {pins[ckpt.ckpt_id]}")
                if host.order.get(ckpt.ckpt_id) is not ckpt:
                    _fail(f"host {ckpt} is not in the host eviction order")
                twins = owner.checkpoints.get(key, ()) if isinstance(owner, Node) else ()
                if any(c.tail_ids == ckpt.tail_ids and c.tail_spans == ckpt.tail_spans for c in twins):
                    _fail(f"host {ckpt} has a device twin on {owner}")
                for block in (*ckpt.pages, *(() if ckpt.frozen_block is None else (ckpt.frozen_block,))):
                    holders[block] += 1

    for owner, hanging in host.under.items():
        if not isinstance(owner, Node) or not owner.attached or hanging.is_empty:
            _fail(f"host tier hangs {'nothing' if hanging.is_empty else 'something'} off {owner}")
        check_hanging(owner, hanging)
        for child in hanging.iter_children():
            if trie.find_child(owner, child.hash, child.token_ids, child.spans) is not None:
                _fail(f"{child} has a device twin under {owner}")
    for hnode in host.iter_nodes():
        num_nodes += 1
        holders[hnode.host_block] += 1
        parent = hnode.parent
        if hnode.depth != parent.depth + 1 or hnode.hash != trie.hash_fn(parent.hash, hnode.token_ids, hnode.spans):
            _fail(f"{hnode} depth or hash does not chain from {parent}")
        if hnode.root_key != parent.root_key:
            _fail(f"{hnode} is under another root (adapter or cache salt) than its parent {parent}")
        if hnode.is_empty:
            _fail(f"{hnode} is a host leaf without a checkpoint (dead weight)")
        check_hanging(hnode, hnode)
    if num_nodes != host.num_nodes:
        _fail(f"host tier counts {host.num_nodes} nodes, found {num_nodes}")
    if seen != set(host.order):
        _fail(f"host order lists {sorted(set(host.order) - seen)} not hanging anywhere")
    queued = list(host.queues.ids())
    if len(queued) != len(seen) or set(queued) != seen:
        _fail(f"the host eviction queues hold {sorted(queued)}, the host tier {sorted(seen)}")
    overlap = seen & set(life.checkpoints)
    if overlap:
        _fail(f"checkpoints {sorted(overlap)} are in both tiers")
    dead = [device for device in host.loading_into() if life.blocks.ref_counts[device] == 0]
    if dead:
        _fail(f"host loads into free device blocks {sorted(dead)}")
    pool = host.pool
    for block in range(pool.num_blocks):
        if pool.ref_counts[block] != holders[block]:
            _fail(f"host block {block} ref count {pool.ref_counts[block]} != {holders[block]} holders")
    if sorted(pool.free_ids()) != [b for b in range(pool.num_blocks) if holders[b] == 0]:
        _fail("host free list is not the set of host blocks without holders")
