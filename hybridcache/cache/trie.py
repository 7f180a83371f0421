"""The trie of full blocks: one root per (adapter, cache salt), chained xxhash identities, exact verification.

A node is one full block of B tokens. Its identity is its parent, its tokens and the multimodal spans that
overlap it (absolute offsets + content hash); the hash chains all three:

    hash(node) = xxh64(hash(parent) | tokens | spans)          hash(root) = xxh64(adapter name [, salt])

    root('lora-a') ── n1 [t0..t63] ── n2 [t64..t127] ── n3 [t128..t191]
                                  └── n2' [t64..t127 with another image]
    root('lora-a', salt 's1') ── n1' [t0..t63]       same tokens, another root: shares nothing with n1

A root is a `RootKey`: the LoRA adapter (None: the base model) and the request's cache salt (vLLM's `cache_salt`,
None: unsalted). Requests share blocks and checkpoints only under the same root, so a salt keeps one tenant's
prompts from hitting (or timing) another's; the unsalted root's hash is the adapter's alone, as before salts.

Children are indexed by hash; a hash match is always followed by an exact comparison of tokens and spans,
so a collision only costs a comparison (`hash_fn` can be replaced to force collisions in tests).
A node holds one reference on its block; a leaf whose block has no other holder can be evicted.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import xxhash

HashFn = Callable[[int, tuple[int, ...], tuple], int]


def chain_hash(parent_hash: int, token_ids: tuple[int, ...], spans: tuple) -> int:
    """The chained identity of `token_ids` (with the spans overlapping them) after `parent_hash`."""
    h = xxhash.xxh64(parent_hash.to_bytes(8, "little"))
    h.update(array("q", token_ids).tobytes())
    if spans:
        h.update(repr(spans).encode())
    return h.intdigest()


def prompt_block_hashes(request: Any, block_size: int, hash_fn: HashFn) -> list[int]:
    """`hash_fn`-chained identities of every full block of `request.prompt_ids`, computed once per request,
    block size and hash function and kept on the request (`CacheRequest.memo`): the simulator's policies
    and repeated matches of one request reuse them. Entry i is the identity of the node of block i
    (tokens `[i*B, (i+1)*B)`), chained from the request's root (its adapter and cache salt):

        hashes[0] = hash_fn(root_hash(adapter, salt), prompt[0:B], spans in [0, B))
        hashes[i] = hash_fn(hashes[i - 1], prompt[i*B:(i+1)*B], spans in [i*B, (i+1)*B))

    With the default `chain_hash` the prompt is serialised once and each block hashes a slice of it
    (the same bytes `chain_hash` would build, hence the same values)."""
    key = ("block_hashes", block_size, hash_fn)
    hashes = request.memo.get(key)
    if hashes is not None:
        return hashes
    prompt = request.prompt_ids
    parent = root_hash(request.adapter, request.cache_salt)
    hashes = []
    if hash_fn is chain_hash:
        data = memoryview(array("q", prompt).tobytes())
        block_bytes = 8 * block_size  # int64 ids
        for i in range(len(prompt) // block_size):
            h = xxhash.xxh64(parent.to_bytes(8, "little"))
            h.update(data[i * block_bytes:(i + 1) * block_bytes])
            spans = request.spans_in(i * block_size, (i + 1) * block_size)
            if spans:
                h.update(repr(spans).encode())
            parent = h.intdigest()
            hashes.append(parent)
    else:
        for i in range(len(prompt) // block_size):
            start = i * block_size
            parent = hash_fn(parent, prompt[start:start + block_size], request.spans_in(start, start + block_size))
            hashes.append(parent)
    request.memo[key] = hashes
    return hashes


class RootKey(NamedTuple):
    """Which root a request's blocks hang from: its LoRA adapter (None: the base model) and its cache salt (None:
    unsalted). Blocks and checkpoints are shared only between requests with equal keys."""

    adapter: str | None = None
    salt: str | None = None

    def __repr__(self) -> str:  # the salt is a secret: reprs land in logs and error messages
        return f"RootKey(adapter={self.adapter!r}, salted={self.salt is not None})"


def root_hash(adapter: str | None, salt: str | None = None) -> int:
    """The hash a root's first block chains from. Unsalted: the adapter's name alone; salted: the pair (a `repr`
    of a tuple starts with "(", of a name with a quote, of None with "N": the inputs never coincide)."""
    key = repr(adapter) if salt is None else repr((adapter, salt))
    return xxhash.xxh64(key.encode()).intdigest()


def path_to(node: Node) -> list[Node]:
    """The nodes from depth 1 down to `node` (empty for a root)."""
    nodes = []
    while not node.is_root:
        nodes.append(node)
        node = node.parent
    nodes.reverse()
    return nodes


class Node:
    """One full block in the trie (or a root: `block_id` None, depth 0, no tokens).

    root_key     the `RootKey` of the root it hangs from (its adapter and cache salt).
    depth        number of full blocks from the root to this node inclusive: the node ends at step depth*B.
    checkpoints  published checkpoints anchored here, indexed by (step, tail hash) -> list (collisions).
    by_first     children indexed by their first token, kept only while the node has more than
                 `Trie.INDEX_FIRST_TOKEN_AT` children (None otherwise): a shared system prompt's node can
                 have thousands of children, and a divergence search only needs those sharing a token.
    """

    __slots__ = (
        "root_key", "parent", "block_id", "token_ids", "spans", "hash", "depth", "children", "checkpoints",
        "last_access", "attached", "by_first",
    )

    def __init__(
        self, *, root_key: RootKey, parent: Node | None, block_id: int | None, token_ids: tuple[int, ...],
        spans: tuple, node_hash: int, last_access: int,
    ) -> None:
        self.root_key = root_key
        self.parent = parent
        self.block_id = block_id
        self.token_ids = token_ids
        self.spans = spans
        self.hash = node_hash
        self.depth = 0 if parent is None else parent.depth + 1
        self.children: dict[int, list[Node]] = {}
        self.checkpoints: dict[tuple[int, int], list[Any]] = {}
        self.last_access = last_access
        self.attached = True
        self.by_first: dict[int, list[Node]] | None = None

    @property
    def is_root(self) -> bool:
        return self.parent is None

    @property
    def adapter(self) -> str | None:
        return self.root_key.adapter

    def num_checkpoints(self) -> int:
        return sum(len(v) for v in self.checkpoints.values())

    def iter_checkpoints(self) -> Iterator[Any]:
        for bucket in self.checkpoints.values():
            yield from bucket

    def __repr__(self) -> str:
        return f"Node(adapter={self.adapter!r}, depth={self.depth}, block={self.block_id})"  # no salt in logs


class Trie:
    INDEX_FIRST_TOKEN_AT = 16

    def __init__(self, hash_fn: HashFn = chain_hash) -> None:
        self.hash_fn = hash_fn
        self.roots: dict[RootKey, Node] = {}
        self.leaves: set[Node] = set()
        self.num_nodes = 0

    def root(self, adapter: str | None, salt: str | None = None) -> Node:
        """The root of `adapter` and cache `salt` (made on first use)."""
        key = RootKey(adapter, salt)
        node = self.roots.get(key)
        if node is None:
            node = Node(
                root_key=key, parent=None, block_id=None, token_ids=(), spans=(), node_hash=root_hash(adapter, salt),
                last_access=0,
            )
            self.roots[key] = node
        return node

    def find_child(
        self, parent: Node, node_hash: int, token_ids: tuple[int, ...], spans: tuple,
    ) -> Node | None:
        """The child of `parent` with exactly these tokens and spans (the hash only narrows the search)."""
        for node in parent.children.get(node_hash, ()):
            if node.token_ids == token_ids and node.spans == spans:
                return node
        return None

    def add_child(
        self, parent: Node, node_hash: int, token_ids: tuple[int, ...], spans: tuple, block_id: int, now: int,
    ) -> Node:
        """A new child; the caller gives the node its reference on `block_id`."""
        node = Node(
            root_key=parent.root_key, parent=parent, block_id=block_id, token_ids=token_ids, spans=spans,
            node_hash=node_hash, last_access=now,
        )
        parent.children.setdefault(node_hash, []).append(node)
        if parent.by_first is not None:
            parent.by_first.setdefault(token_ids[0], []).append(node)
        elif len(parent.children) > self.INDEX_FIRST_TOKEN_AT:
            by_first: dict[int, list[Node]] = {}
            for bucket in parent.children.values():
                for child in bucket:
                    by_first.setdefault(child.token_ids[0], []).append(child)
            parent.by_first = by_first
        self.leaves.discard(parent)
        self.leaves.add(node)
        self.num_nodes += 1
        return node

    def remove_leaf(self, node: Node) -> None:
        """Detach a leaf (no children, no checkpoints); the caller drops its block reference."""
        if node.children or node.checkpoints or node.is_root:
            raise RuntimeError(f"{node} is not a removable leaf")
        parent = node.parent
        bucket = parent.children[node.hash]
        bucket.remove(node)
        if not bucket:
            del parent.children[node.hash]
        if parent.by_first is not None:
            if len(parent.children) <= self.INDEX_FIRST_TOKEN_AT // 2:
                parent.by_first = None
            else:
                same_first = parent.by_first[node.token_ids[0]]
                same_first.remove(node)
                if not same_first:
                    del parent.by_first[node.token_ids[0]]
        self.leaves.discard(node)
        if not parent.children and not parent.is_root:
            self.leaves.add(parent)
        node.attached = False
        self.num_nodes -= 1

    def children_starting_with(self, parent: Node, token_id: int) -> list[Node]:
        """The children of `parent` whose first token is `token_id`."""
        if parent.by_first is not None:
            return parent.by_first.get(token_id, [])
        return [c for bucket in parent.children.values() for c in bucket if c.token_ids[0] == token_id]

    def iter_nodes(self) -> Iterator[Node]:
        """Every node (roots included), parents before children."""
        stack = list(self.roots.values())
        while stack:
            node = stack.pop()
            yield node
            for bucket in node.children.values():
                stack.extend(bucket)
