"""A fake device and a tiny driver for cache tests: executes copy plans and "forwards" on ids.

The fake device stores, for every KV position and every state slot, the identity of what a real model
would hold there: KV at position p depends on the whole prefix [0, p] (root: adapter and cache salt; tokens,
spans), and the state at step s is the prefix [0, s). A cache salt changes nothing a real model computes; it is
part of the identity here so that a request served another salt's KV or state is caught as holding wrong
content. Executing the plan exactly as the engine would (restore copies, forward writes into the blocks the
scheduler planned with, save copies) and then checking every running sequence, checkpoint and trie node against
those identities catches wrong ids, wrong order, a block freed too early or a restore from the wrong place.
With a host tier (`CacheConfig.host_blocks`) it also keeps host memory: HOST_SAVE and HOST_LOAD copy whole
blocks between the two, and every host node and host checkpoint is checked like the device's (items whose copy
the next plan carries are read where their bytes still are). `FakeDisk` is a tier behind the host tier on it (the
engine's disk tier as the cache sees it): it reads what it keeps as memory holds it at that moment, as the
engine's does, and checks it against the fall-out's records.
"""

from __future__ import annotations

import copy
from collections.abc import Hashable, Sequence

from hybridcache.cache import CacheRequest, CopyKind, CopyPlan, PrefixCache
from hybridcache.cache.host_tier import StoredCheckpoint


def prefix_id(request: CacheRequest, token_ids: Sequence[int], end: int) -> tuple:
    """Identity of the prefix [0, end) of a sequence (what KV at end-1 / state at end depend on)."""
    return ((request.adapter, request.cache_salt), tuple(token_ids[:end]), request.spans_in(0, end))


def node_prefix(node) -> tuple[int, ...]:
    parts = []
    while not node.is_root:
        parts.append(node.token_ids)
        node = node.parent
    return tuple(t for block in reversed(parts) for t in block)


class FakeDevice:
    def __init__(self, cache: PrefixCache) -> None:
        self.cache = cache
        size = cache.block_size
        self.kv: list[list] = [[None] * size for _ in range(cache.config.num_blocks)]
        self.state: list = [None] * cache.config.num_slots
        self.draft_state: dict[int, object] = {}  # speculative: draft state id -> the state it holds
        self.k = cache.config.state_pages  # paged: a checkpoint's state is k pages, each a KV block filled
        # with ("state", identity, j): a forward or KV copy writing into it, or a state page read as KV, shows
        self.host: list[list] = [[None] * size for _ in range(cache.config.host_blocks)]

    def run_step(self, fed: dict[Hashable, Sequence[int]]) -> CopyPlan:
        """commit_step + execute: restores, forward writes (into the pre-commit block lists), saves."""
        cache = self.cache
        planned = {rid: (list(cache.block_ids(rid)), cache.slot(rid), cache.num_computed(rid)) for rid in fed}
        copies = cache.commit_step(fed)
        self.execute(copies, planned, fed)
        return copies

    def execute_step(self, output) -> None:
        """Execute a `SchedulerOutput` (already committed by `Scheduler.schedule`) as the engine would, and
        check that each zero-prefill sample's slot holds its whole prompt's state (its last hidden state)."""
        planned = {c.seq.seq_id: (c.block_ids, c.slot, c.start) for c in output.chunks}
        drafts = {c.seq.seq_id: c.num_drafts for c in output.chunks if c.num_drafts}
        self.execute(output.copies, planned, {c.seq.seq_id: c.token_ids for c in output.chunks}, drafts)
        for sample in output.samples:
            seq = self.cache._seqs[sample.seq.seq_id]
            assert seq.num_computed == seq.request.prompt_len
            assert self.state[sample.slot] == prefix_id(seq.request, seq.token_ids, seq.num_computed), "sample"

    def execute(self, copies: CopyPlan, planned: dict, fed: dict[Hashable, Sequence[int]],
                drafts: dict[Hashable, int] | None = None) -> None:
        """Restores, forward writes into the pre-commit block lists `planned[rid] = (block_ids, slot, start)`,
        saves; `commit_step(fed)` has run."""
        cache, size = self.cache, self.cache.block_size
        for chunk, dst in copies.pairs(CopyKind.HOST_FINISH):  # a demoted finish checkpoint's state, from its slot
            slot, j = divmod(chunk, self.k)
            self.host[dst] = [("state", self.state[slot], j)] * size
        for src, dst in copies.pairs(CopyKind.HOST_SAVE):  # device -> host, before anything writes the device
            self.host[dst] = list(self.kv[src])
        for src, dst in copies.pairs(CopyKind.HOST_LOAD):
            self.kv[dst] = list(self.host[src])
        self._save_states(copies.pairs(CopyKind.STATE_FINISH))
        for src, dst in copies.pairs(CopyKind.KV_RESTORE):
            self.kv[dst] = list(self.kv[src])
        if self.k is None:
            for src, dst in copies.pairs(CopyKind.STATE_RESTORE):
                self.state[dst] = self.state[src]
        else:
            self._restore_states(copies.pairs(CopyKind.STATE_RESTORE))
        for rid, tokens in fed.items():
            block_ids, slot, start = planned[rid]
            seq = cache._seqs[rid]
            request = seq.request
            # the cache's tokens, extended by commit (pending ones filled in since), then the fed drafts
            num_drafts = (drafts or {}).get(rid, 0)
            known = start + len(tokens) - num_drafts
            all_tokens = list(seq.token_ids[:known]) + list(tokens[len(tokens) - num_drafts:])
            for j in range(num_drafts):  # a verify row keeps the state after each of its first n positions
                self.draft_state[slot * cache.config.num_speculative_tokens + j] = prefix_id(
                    request, all_tokens, start + j + 1)
            if start > 0:
                assert self.state[slot] == prefix_id(request, all_tokens, start), f"{rid}: bad state at {start}"
                for pos in range(start):
                    got = self.kv[block_ids[pos // size]][pos % size]
                    assert got == prefix_id(request, all_tokens, pos + 1), f"{rid}: bad KV at {pos}"
            for pos in range(start, start + len(tokens)):
                self.kv[block_ids[pos // size]][pos % size] = prefix_id(request, all_tokens, pos + 1)
            self.state[slot] = prefix_id(request, all_tokens, start + len(tokens))
        for src, dst in copies.pairs(CopyKind.KV_SAVE):
            self.kv[dst] = list(self.kv[src])
        if self.k is None:
            for src, dst in copies.pairs(CopyKind.STATE_SAVE):
                self.state[dst] = self.state[src]
        else:
            self._save_states(copies.pairs(CopyKind.STATE_SAVE))

    def execute_rollback(self, copies: CopyPlan) -> None:
        """Speculative: `accept`'s STATE_ROLLBACK copies (draft state -> runtime slot)."""
        assert all(op.kind is CopyKind.STATE_ROLLBACK for op in copies.ops), copies
        for src, dst in copies.pairs(CopyKind.STATE_ROLLBACK):
            self.state[dst] = self.draft_state[src]

    def _save_states(self, pairs: list[tuple[int, int]]) -> None:
        """Paged: runtime chunk `slot * k + j` -> page (the whole block holds the chunk's identity)."""
        for chunk, page in pairs:
            slot, j = divmod(chunk, self.k)
            self.kv[page] = [("state", self.state[slot], j)] * self.cache.block_size

    def _page_state(self, page: int, j: int, entries: list | None = None):
        """The state identity page `page` holds as chunk `j` (or `entries`, a block's content); fails when the
        page holds anything else."""
        entries = self.kv[page] if entries is None else entries
        head = entries[0]
        assert isinstance(head, tuple) and head[0] == "state" and head[2] == j, f"page {page}: not chunk {j}"
        assert all(e == head for e in entries), f"page {page}: a state page was partly overwritten"
        return head[1]

    def _restore_states(self, pairs: list[tuple[int, int]]) -> None:
        """Paged: page -> runtime chunk; the k chunks of a slot come together and hold one identity."""
        parts: dict[int, list] = {}
        for page, chunk in pairs:
            slot, j = divmod(chunk, self.k)
            parts.setdefault(slot, []).append((j, self._page_state(page, j)))
        for slot, got in parts.items():
            assert [j for j, _ in got] == list(range(self.k)), f"slot {slot}: chunks {got}"
            assert len({ident for _, ident in got}) == 1, f"slot {slot}: chunks of different states"
            self.state[slot] = got[0][1]

    def cache_pending_finish(self) -> dict:
        """Paged: checkpoint -> runtime slot, of the STATE_FINISH copies the next plan carries (their pages are
        not written yet; the freed slot still holds the state)."""
        return {ckpt: slot for ckpt, slot in self.cache._finish_saves}

    def _device_block(self, block: int) -> list:
        """What device block `block` holds once the next plan's host loads ran (a promotion not run yet: its
        host block)."""
        host = self.cache._life.host
        source = None if host is None else host._loads.get(block)
        return self.kv[block] if source is None else self._host_block(source)

    def _host_block(self, block: int) -> list:
        """What host block `block` holds once the next plan's host saves ran (a demotion not run yet: its
        device block, which nothing writes before that save)."""
        source = self.cache._life.host._saves.get(block)
        return self.host[block] if source is None else self.kv[source]

    def check(self) -> None:
        """Every running sequence, published checkpoint and trie node (device and host) holds what its ids say."""
        cache, size = self.cache, self.cache.block_size
        for rid, seq in cache._seqs.items():
            if seq.restore is not None:
                continue  # restore copies not executed yet
            n = seq.num_computed
            if n:
                assert self.state[seq.slot] == prefix_id(seq.request, seq.token_ids, n), f"{rid}: state"
            for pos in range(n):
                got = self.kv[seq.block_ids[pos // size]][pos % size]
                assert got == prefix_id(seq.request, seq.token_ids, pos + 1), f"{rid}: KV at {pos}"
        for ckpt in cache._life.published():
            prefix = node_prefix(ckpt.anchor) + ckpt.tail_ids
            spans = _spans_of(ckpt)
            if self.k is None:
                assert self.state[ckpt.slot] == ((ckpt.adapter, ckpt.salt), prefix, spans), f"{ckpt}: state"
            else:  # a finish whose STATE_FINISH the next plan carries: still in the freed runtime slot
                slot = self.cache_pending_finish().get(ckpt)
                self._check_checkpoint(ckpt, prefix, spans, self._device_block, slot)
        for node in cache._life.trie.iter_nodes():
            if not node.is_root:
                self._check_node(node, self._device_block(node.block_id))
        host = cache._life.host
        if host is not None:
            pending = self.cache_pending_finish()
            for ckpt in host.order.values():
                prefix = node_prefix(ckpt.anchor) + ckpt.tail_ids
                # demoted before its state was copied (HOST_FINISH in the next plan): still in the runtime slot
                self._check_checkpoint(ckpt, prefix, _spans_of(ckpt), self._host_block, pending.get(ckpt))
            for hnode in host.iter_nodes():
                self._check_node(hnode, self._host_block(hnode.host_block))

    def _check_checkpoint(self, ckpt, prefix: tuple, spans: tuple, read, slot: int | None = None) -> None:
        """A paged checkpoint's pages (or, while its state copy is pending, runtime slot `slot`) and frozen tail,
        read through `read(block) -> content`."""
        size = self.cache.block_size
        if slot is not None:
            assert self.state[slot] == ((ckpt.adapter, ckpt.salt), prefix, spans), f"{ckpt}: finished state"
        for j, page in enumerate(ckpt.pages if slot is None else ()):
            got = self._page_state(page, j, read(page))
            assert got == ((ckpt.adapter, ckpt.salt), prefix, spans), f"{ckpt}: state page {j}"
        base = ckpt.anchor.depth * size
        for pos in range(base, ckpt.step):
            entry = read(ckpt.frozen_block)[pos - base]
            assert entry[0] == (ckpt.adapter, ckpt.salt) and entry[1] == prefix[: pos + 1], f"{ckpt}: tail KV"

    def _check_node(self, node, entries: list) -> None:
        """A trie node (device or host) whose block holds `entries`: the KV of its prefix."""
        _check_kv(entries, (node.root_key.adapter, node.root_key.salt), node_prefix(node),
                  (node.depth - 1) * self.cache.block_size, self.cache.block_size, node)

    def check_stored(self, stored: StoredCheckpoint, blocks: list, state: list) -> None:
        """`blocks` (the contents of `stored`'s chain blocks) and `state` (of its pages, then its frozen tail) hold
        what `stored` claims: the KV of the chain's prefixes, the state of its prefix and tail (the base model's
        unsalted root: what goes behind the host tier)."""
        size, root = self.cache.block_size, (None, None)
        prefix = tuple(t for _, tokens in stored.chain for t in tokens)
        for i, entries in enumerate(blocks):
            _check_kv(entries, root, prefix[:(i + 1) * size], i * size, size, f"{stored} block {i}")
        full = prefix + stored.tail_ids
        for j, entries in enumerate(state[:stored.num_pages]):
            got = self._page_state(None, j, entries)
            assert got[0] == root and got[1] == full, f"{stored}: state page {j}"
        if stored.has_frozen:
            _check_kv(state[-1], root, full, len(prefix), len(stored.tail_ids), f"{stored} frozen tail")


def _check_kv(entries: list, root: tuple, prefix: tuple, base: int, count: int, what) -> None:
    """`entries` (a block's content) hold the KV of `prefix` at positions base .. base + count - 1."""
    for pos in range(base, base + count):
        got = entries[pos - base]
        assert got is not None and got[0] == root and got[1] == prefix[: pos + 1], f"{what}: KV at {pos}"


class FakeDisk:
    """A `TierBehind` on the fake device (as the engine's disk tier is one; `attach` it to the cache's device):
    `keep` records each fall-out with its bytes read as memory holds them at that moment, as the engine's keeper
    reads them (host blocks from host memory, device blocks from the device; a copy in the plan being built has not
    run), and checks them against the fall-out's records (`FakeDevice.check_stored`), so a fall-out that points at
    bytes not written yet fails there; `find` offers the recorded checkpoints a prompt can use, deepest first;
    `placed` writes one's bytes into host memory (raising `fail_placed` once when set); `clear` forgets all."""

    def __init__(self, kept: list | None = None) -> None:
        self.kept = kept if kept is not None else []
        self.device: FakeDevice | None = None  # the fake device of the cache this is given to
        self.asked: list[tuple] = []
        self.num_not_kept = 0
        self.fail_placed: BaseException | None = None

    def attach(self, device: FakeDevice) -> FakeDisk:
        self.device = device
        return self

    def keep(self, fall_out) -> None:
        if fall_out is None:
            self.num_not_kept += 1
            return
        device = self.device

        def read(block_id: int, on_host: bool) -> list:
            # copies: the fake device's blocks are lists that later forwards change in place, as a disk file is not
            return copy.deepcopy(device.host[block_id] if on_host else device.kv[block_id])

        blocks = [read(b.block_id, b.on_host) for b in fall_out.blocks]
        stored = StoredCheckpoint(chain=tuple((b.hash, b.token_ids) for b in fall_out.blocks), step=fall_out.step,
                                  tail_ids=fall_out.tail_ids, reason=fall_out.reason, num_pages=fall_out.num_pages,
                                  has_frozen=len(fall_out.state_host_ids) > fall_out.num_pages)
        state = [read(h, fall_out.state_on_host) for h in fall_out.state_host_ids]
        device.check_stored(stored, blocks, state)
        self.kept.append((stored, blocks, state))

    def find(self, request, block_size, max_step) -> list[StoredCheckpoint]:
        usable = dict.fromkeys(stored for stored, _, _ in self.kept if stored.step <= max_step
                               and request.prompt_ids[:stored.step] == tuple(t for _, tokens in stored.chain
                                                                             for t in tokens) + stored.tail_ids)
        return sorted(usable, key=lambda stored: -stored.step)

    def read(self, stored, missing) -> bool:
        self.asked.append(missing)
        return True

    def placed(self, stored, block_ids, state_ids) -> None:
        if self.fail_placed is not None:
            error, self.fail_placed = self.fail_placed, None
            raise error
        _, blocks, state = next(item for item in self.kept if item[0] == stored)
        assert sorted(block_ids) == list(self.asked[-1])
        for i, host_block in block_ids.items():
            self.device.host[host_block] = list(blocks[i])
        for host_block, data in zip(state_ids, state, strict=True):
            self.device.host[host_block] = list(data)

    def clear(self) -> None:
        self.kept.clear()


def _spans_of(ckpt) -> tuple:
    spans: list = []
    node = ckpt.anchor
    while not node.is_root:
        spans.extend(node.spans)
        node = node.parent
    spans.extend(ckpt.tail_spans)
    return tuple(sorted(set(spans)))


def fingerprint(cache: PrefixCache) -> tuple:
    """Everything an exact rollback must restore: counts, free lists, pins, LRU times, stats."""
    life = cache._life
    nodes = sorted((n.hash, n.depth, n.block_id, n.last_access) for n in life.trie.iter_nodes() if not n.is_root)
    ckpts = sorted(
        (c.ckpt_id, c.state.value, c.num_pins, c.last_access, c.slot, c.pages, c.frozen_block)
        for c in life.checkpoints.values()
    )
    seqs = sorted((repr(r), tuple(s.block_ids), s.slot, s.num_computed) for r, s in cache._seqs.items())
    host = life.host
    host_state = () if host is None else (
        tuple(host.pool.ref_counts), tuple(sorted(host.pool.free_ids())), tuple(host.order),
        tuple(sorted((c.ckpt_id, c.num_pins, c.pages, c.frozen_block) for c in host.order.values())),
        tuple(sorted((n.hash, n.depth, n.host_block) for n in host.iter_nodes())),
        tuple(sorted(host._saves.items())), tuple(sorted(host._loads.items())),
    )
    return (
        tuple(life.blocks.ref_counts), tuple(sorted(life.blocks.free_ids())), tuple(life.slots.owners),
        tuple(nodes), tuple(ckpts), tuple(seqs), cache.stats, len(cache._matches), host_state,
    )


class Driver:
    """Runs whole requests through a cache and a fake device (prefill in chunks, decode, finish)."""

    def __init__(self, cache: PrefixCache) -> None:
        self.cache = cache
        self.device = FakeDevice(cache)

    def admit(self, request: CacheRequest):
        match = self.cache.match(request)
        admitted = self.cache.admit(match)
        assert admitted is not None, "no room"
        return match

    def step(self, rid: Hashable, tokens: Sequence[int], saves: Sequence[tuple] = ()) -> CopyPlan:
        cache = self.cache
        end = cache.num_computed(rid) + len(tokens)
        assert cache.ensure_capacity(rid, end)
        for reason, *rest in saves:
            cache.reserve_save(rid, end, reason, *rest)
        copies = self.device.run_step({rid: list(tokens)})
        self.device.check()
        cache.check_integrity()
        return copies

    def run(
        self, request: CacheRequest, decode: Sequence[int] = (), chunk: int | None = None,
        branch: bool = False, finish: bool = True,
    ):
        """Admit, prefill (chunked; a chunk ends at the branch point when `branch`), decode, finish."""
        cache = self.cache
        match = self.admit(request)
        rid = request.request_id
        prompt = request.prompt_ids
        pos = cache.num_computed(rid)
        while pos < len(prompt):
            end = len(prompt) if chunk is None else min(len(prompt), pos + chunk)
            saves = []
            if branch and pos < match.divergence_len < end:
                end = match.divergence_len
                saves.append(("branch_point",))
            else:
                saves.append(("prefill_end",) if end == len(prompt) else ("chunk_end",))
            self.step(rid, prompt[pos:end], saves)
            pos = end
        for token in decode:
            self.step(rid, [token])
        if finish:
            cache.finish(rid)
            self.device.check()
            cache.check_integrity()
        return match
