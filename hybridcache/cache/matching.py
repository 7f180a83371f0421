"""Matching a request against the trie (read-only): the prompt's path, the deepest usable checkpoint on it,
and how far the prompt agrees with cached content (the branch point).

    path = walk_prompt(trie, request, B)        [root, node of block 0, node of block 1, ...] (exact match)
    ckpt = find_deepest(trie, path, request, B, request.prompt_len - 1)   (prompt_len: zero-prefill hits)
    divergence(trie, path, request, B, request.prompt_len - 1)
                                                (step, num_continuations): step >= the matched full blocks;
                                                see `MatchResult.divergence_len` and `divergence_count`
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

from hybridcache.cache.checkpoint import Checkpoint
from hybridcache.cache.request import CacheRequest, common_prefix_len
from hybridcache.cache.trie import Node, Trie, prompt_block_hashes


def walk_prompt(trie: Trie, request: CacheRequest, block_size: int) -> list[Node]:
    """The trie path of the prompt's full blocks: [root, node of block 0, ...] as far as they match
    exactly; [] when the request's root (its adapter and cache salt) does not exist yet."""
    size, prompt = block_size, request.prompt_ids
    root = trie.roots.get(request.root_key)
    if root is None:
        return []
    path = [root]
    node = root
    hashes = prompt_block_hashes(request, size, trie.hash_fn)
    for i in range(len(prompt) // size):
        if not node.children:
            break
        tokens = prompt[i * size:(i + 1) * size]
        spans = request.spans_in(i * size, (i + 1) * size)
        child = trie.find_child(node, hashes[i], tokens, spans)
        if child is None:
            break
        path.append(child)
        node = child
    return path


def find_deepest(
    trie: Trie, path: list[Node], request: CacheRequest, block_size: int, max_step: int,
) -> Checkpoint | None:
    """The deepest usable checkpoint for `request` on `path` (path[d] = node at depth d, path[0] = root).

    Candidates on a node are looked up by (step, tail hash of the request's tokens at that step) and then
    verified exactly: tail tokens, tail spans, root (adapter and cache salt), ownership, safe boundary,
    step <= max_step, and the routed-expert history when the request asks for it and the tail is partial.
    Ties: most recently used. Cost: one dict probe per path node plus O(B) per distinct candidate step.
    """
    prompt = request.prompt_ids
    for depth in range(len(path) - 1, -1, -1):
        node = path[depth]
        if not node.checkpoints:
            continue
        base = depth * block_size
        steps = sorted({step for step, _ in node.checkpoints if step <= max_step}, reverse=True)
        for step in steps:
            if not request.is_safe(step):
                continue
            tail = prompt[base:step]
            spans = request.spans_in(base, step)
            bucket = node.checkpoints.get((step, trie.hash_fn(node.hash, tail, spans)), ())
            valid = [
                c for c in bucket
                if c.is_usable and c.root_key == request.root_key
                and c.tail_ids == tail and c.tail_spans == spans
                and (step == base or not request.routed_experts or c.routed_experts is not None)
            ]
            if valid:
                return max(valid, key=lambda c: (c.last_access, c.ckpt_id))
    return None


class Divergence(NamedTuple):
    """Where a prompt leaves cached content below one trie position (a device node, the host tier's `Hanging`
    off it, or both).

    step               the divergence step (`MatchResult.divergence_len` is the deepest over the device and host).
    num_continuations  the child blocks and checkpoint tails there that agree with the prompt up to `step` (a
                       tail that is a prefix of another one or of a child block is the same continuation, counted
                       once); 0 when none does (the path's own blocks still pass there: callers count at least 1).
    """

    step: int
    num_continuations: int


class Below(NamedTuple):
    """What hangs off one owner (a trie node or a host-tier `Hanging`): `owner.children` (hash -> list of nodes
    with `token_ids` and `spans`), `owner.iter_checkpoints()` (with `tail_ids` and `tail_spans`), and
    `starting_with(t)`: its children whose first token is t (a divergence search needs only those)."""

    owner: Any
    starting_with: Callable[[int], Iterable[Any]]


def below_node(trie: Trie, node: Node) -> Below:
    """What hangs off a device trie node (its children found through the trie's first-token index)."""
    return Below(node, lambda token: trie.children_starting_with(node, token))


def divergence(trie: Trie, path: list[Node], request: CacheRequest, block_size: int, max_step: int) -> Divergence:
    """How far the prompt agrees with cached content on the device: the matched full blocks, then the longest
    common prefix with a child block or a checkpoint tail of the deepest node (spans compared too); clamped to
    `max_step` (the deepest step a match may return) and moved down to a safe boundary. With it, how many
    cached continuations leave the prompt there (`divergence_at`; `HostTier.divergence` adds the host tier's)."""
    if not path:
        return Divergence(0, 0)
    return divergence_at(request, path[-1].depth * block_size, block_size, [below_node(trie, path[-1])], max_step)


def divergence_at(request: CacheRequest, base: int, block_size: int, owners: list[Below], max_step: int) -> Divergence:
    """The prompt against the child blocks and checkpoint tails that hang off `owners` at step `base` (one trie
    position: a device node and the host tier's part of it are two owners). The step is `base` plus the longest
    common prefix of the prompt's next block with any of them (a span that one side has and the other lacks ends
    the agreement at its start), clamped to `max_step` and moved down to a safe boundary; the continuations are
    those that agree with the prompt up to the step. B = 8, from `base`::

        prompt   a b c d e f g h
        child 1  a b c x . . . .     agrees on 3
        child 2  a b c d e z . .     agrees on 5  -+- one continuation (the tail is a checkpoint that
        tail     a b c d e z         agrees on 5  -+  child 2's sequence saved on its way)
        child 3  a b c d e y . .     agrees on 5      -> Divergence(base + 5, 2)

    At the block boundary (`base`: nothing shares the prompt's next token) every child block and every
    non-empty tail leaves the prompt there."""
    rest = request.prompt_ids[base:base + block_size]
    ckpts = [c for below in owners for c in below.owner.iter_checkpoints()]
    if rest:
        # a child whose first token differs agrees on 0 tokens: only those sharing it can raise the agreement
        blocks = [_agreement(request, base, rest, c.token_ids, c.spans)
                  for below in owners for c in below.starting_with(rest[0])]
        tails = [(_agreement(request, base, rest, c.tail_ids, c.tail_spans), c.tail_ids) for c in ckpts]
        step = min(base + max([*blocks, *(agree for agree, _ in tails)], default=0), max_step)
        for span in request.spans_in(step - 1, step + 1):
            if span.start < step < span.end:
                step = span.start
    else:
        step = min(base, max_step)
    if step == 0:  # no branch point at step 0: not counted (the root's children are every distinct first block)
        return Divergence(0, 0)
    if step <= base:
        num_blocks = sum(len(bucket) for below in owners for bucket in below.owner.children.values())
        return Divergence(step, num_blocks + _num_own_tails([c.tail_ids for c in ckpts if c.tail_ids], owners))
    num_blocks = sum(agree >= step - base for agree in blocks)
    return Divergence(step, num_blocks + _num_own_tails([t for a, t in tails if a >= step - base], owners))


def _agreement(request: CacheRequest, base: int, rest: tuple[int, ...], tokens: tuple[int, ...], spans: tuple) -> int:
    """How many tokens from `base` on the prompt (whose next block is `rest`) shares with `tokens` and `spans`."""
    agree = common_prefix_len(tokens, rest)
    if agree:
        mine = set(request.spans_in(base, base + agree))
        theirs = {s for s in spans if s.start < base + agree and s.end > base}
        differing = mine ^ theirs
        if differing:
            agree = max(0, min(s.start for s in differing) - base)
    return agree


def _num_own_tails(tails: list[tuple[int, ...]], owners: list[Below]) -> int:
    """The checkpoint tails among `tails` that are continuations of their own: not a prefix of a child block of
    `owners` nor of another tail in `tails` (a checkpoint saved on the way of a sequence that went on, whichever
    tier each is in); equal tails count once."""
    distinct = set(tails)
    num = 0
    for tail in distinct:
        longer = [c.token_ids for below in owners for c in below.starting_with(tail[0])]
        longer += [t for t in distinct if len(t) > len(tail)]
        num += not any(t[:len(tail)] == tail for t in longer)
    return num
