"""`ReplicaIndex`: one replica's prefix cache as its events describe it, and the hit a prompt would get there.

Built only from hashes (cache/events.py): the blocks of the trie (`block_hash` -> depth) and the published
checkpoints on each anchor (`anchor_hash` -> {(step, tail_hash): count}). A prompt is matched as the cache
matches it, with hashes in place of tokens::

    hashes = prompt_block_hashes(prompt)           h_i = chain_hash(h_{i-1}, prompt[i*B:(i+1)*B])
    kv_len = B * (number of leading h_i in blocks)       h_{-1} = root_hash(adapter, salt)
    for depth q from deepest to 0, anchor = h_{q-1} (root_hash(adapter, salt) for q = 0):
        for each (step, tail_hash) stored on anchor with step <= max_step, deepest first:
            hit when chain_hash(anchor, prompt[q*B:step]) == tail_hash      -> cached_len = step

`chain_len` is how deep the stored content goes below the prompt's last matched block (the deepest block under
it, walked through the blocks' parent hashes), which tells a later turn of the conversation stored there (its KV is
most of the chain) from a sibling that shares a prefix with a longer one (router/policy.py).

A request's cache salt (vLLM's `cache_salt`, cache.md "Cache salts") is part of its root: the events never carry
it, so a salted prompt is predicted from the hashes chained from its salted root (`salt`), which only a router that
read the salt from the request can compute, and it finds nothing another salt (or no salt) stored.

The cache compares tokens exactly after a hash match; the index cannot, so a hash collision (2^-64 per
probe) would make it predict a hit the replica does not give. Multimodal spans are not modelled: a prompt
with images is predicted as text (a miss where its blocks hold images).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

from hybridcache.cache.events import CacheEvent, EventKind
from hybridcache.cache.request import Probe
from hybridcache.cache.trie import chain_hash, root_hash

MAX_CHAIN_NODES = 4096  # blocks a chain_len walk visits at most (then it answers its depth limit)


class ReplicaIndex:
    """What one replica's cache holds (hashes only); `apply` its events in order, `predict` a prompt's hit."""

    def __init__(self, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.blocks: dict[int, int] = {}  # block hash -> depth
        self.parents: dict[int, int] = {}  # block hash -> parent hash
        # parent hash -> its block's hash, or the set of them when it has several: most blocks have one child, and an
        # int, unlike a set, is nothing the garbage collector walks (a snapshot of 300,000 blocks made 300,000 sets,
        # and each full collection while they were built stalled the router's streams for 100 ms or more)
        self.children: dict[int, int | set[int]] = {}
        self.checkpoints: dict[int, Counter] = {}  # anchor hash -> {(step, tail hash): count}
        self.num_checkpoints = 0

    def clear(self) -> None:
        self.blocks.clear()
        self.parents.clear()
        self.children.clear()
        self.checkpoints.clear()
        self.num_checkpoints = 0

    def apply(self, events: Iterable[CacheEvent]) -> None:
        """Apply events in the order the replica emitted them. A removal of something unknown (an index
        started mid-stream) is ignored."""
        for event in events:
            kind = event.kind
            if kind is EventKind.BLOCK_STORED:
                self.blocks[event.block_hash] = event.depth
                self.parents[event.block_hash] = event.parent_hash
                self._add_child(event.parent_hash, event.block_hash)
            elif kind is EventKind.BLOCK_REMOVED:
                self.blocks.pop(event.block_hash, None)
                parent = self.parents.pop(event.block_hash, None)
                if parent is not None:
                    self._remove_child(parent, event.block_hash)
            elif kind is EventKind.CHECKPOINT_STORED:
                self.checkpoints.setdefault(event.anchor_hash, Counter())[(event.step, event.tail_hash)] += 1
                self.num_checkpoints += 1
            elif kind is EventKind.CHECKPOINT_REMOVED:
                on_anchor = self.checkpoints.get(event.anchor_hash)
                key = (event.step, event.tail_hash)
                if on_anchor is None or not on_anchor[key]:
                    continue
                on_anchor[key] -= 1
                self.num_checkpoints -= 1
                if not on_anchor[key]:
                    del on_anchor[key]
                    if not on_anchor:
                        del self.checkpoints[event.anchor_hash]

    def _add_child(self, parent: int, child: int) -> None:
        siblings = self.children.get(parent)
        if siblings is None:
            self.children[parent] = child
        elif isinstance(siblings, set):
            siblings.add(child)
        elif siblings != child:
            self.children[parent] = {siblings, child}

    def _remove_child(self, parent: int, child: int) -> None:
        siblings = self.children.get(parent)
        if isinstance(siblings, set):
            siblings.discard(child)
            if len(siblings) == 1:
                self.children[parent] = siblings.pop()
            elif not siblings:
                del self.children[parent]
        elif siblings == child:
            del self.children[parent]

    def predict(self, prompt_ids: Sequence[int], max_step: int | None = None, adapter: str | None = None,
                block_hashes: Sequence[int] | None = None, salt: str | None = None) -> Probe:
        """The (kv_len, cached_len) the replica's `PrefixCache.probe` would return for this text prompt now
        (`max_step`: default prompt_len - 1, as an engine without full-prompt hits; `salt`: the request's cache
        salt). `block_hashes`: the prompt's chained block hashes when the caller has them (`prompt_hashes`, with
        the same adapter and salt), else computed here."""
        size = self.block_size
        prompt = tuple(prompt_ids)
        max_step = len(prompt) - 1 if max_step is None else max_step
        hashes = prompt_hashes(prompt, size, adapter, salt) if block_hashes is None else block_hashes
        depth = 0
        while depth < len(hashes) and hashes[depth] in self.blocks:
            depth += 1
        root = root_hash(adapter, salt)
        for q in range(depth, -1, -1):
            anchor = hashes[q - 1] if q else root
            on_anchor = self.checkpoints.get(anchor)
            if not on_anchor:
                continue
            base = q * size
            for step in sorted({s for s, _ in on_anchor if s <= max_step}, reverse=True):
                if (step, chain_hash(anchor, prompt[base:step], ())) in on_anchor:
                    return Probe(kv_len=depth * size, cached_len=step)
        return Probe(kv_len=depth * size, cached_len=0)


    def chain_len(self, prompt_ids: Sequence[int], limit: int, adapter: str | None = None,
                  block_hashes: Sequence[int] | None = None, salt: str | None = None) -> int:
        """Tokens from the start to the deepest stored block under the prompt's last matched full block (0 when
        no block matches), up to `limit` tokens: the walk stops at the first block deeper than that, or after
        `MAX_CHAIN_NODES` blocks (then it answers `limit`)."""
        size = self.block_size
        hashes = prompt_hashes(tuple(prompt_ids), size, adapter, salt) if block_hashes is None else block_hashes
        depth = 0
        while depth < len(hashes) and hashes[depth] in self.blocks:
            depth += 1
        if not depth:
            return 0
        deepest, stack, visited = depth, [hashes[depth - 1]], 0
        while stack:
            visited += 1
            if deepest * size > limit or visited > MAX_CHAIN_NODES:
                return limit
            children = self.children.get(stack.pop(), ())
            for child in (children,) if isinstance(children, int) else children:
                deepest = max(deepest, self.blocks.get(child, 0))
                stack.append(child)
        return min(deepest * size, limit)


def prompt_hashes(prompt_ids: Sequence[int], block_size: int, adapter: str | None = None,
                  salt: str | None = None) -> list[int]:
    """The chained hashes of the prompt's full blocks, as the trie computes them for a text prompt of this adapter
    and cache salt."""
    parent = root_hash(adapter, salt)
    hashes = []
    prompt = tuple(prompt_ids)
    for i in range(len(prompt) // block_size):
        parent = chain_hash(parent, prompt[i * block_size:(i + 1) * block_size], ())
        hashes.append(parent)
    return hashes
