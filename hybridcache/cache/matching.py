"""Matching a request against the trie (read-only): the prompt's path, the deepest usable checkpoint on it,
and how far the prompt agrees with cached content (the branch point).

    path = walk_prompt(trie, request, B)        [root, node of block 0, node of block 1, ...] (exact match)
    ckpt = find_deepest(trie, path, request, B, request.prompt_len - 1)   (prompt_len: zero-prefill hits)
    divergence_len(trie, path, request, B, request.prompt_len - 1)
                                                >= the matched full blocks; see `MatchResult.divergence_len`
"""

from __future__ import annotations

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


def divergence_len(trie: Trie, path: list[Node], request: CacheRequest, block_size: int, max_step: int) -> int:
    """How far the prompt agrees with cached content: the matched full blocks, then the longest common
    prefix with a child block or a checkpoint tail of the deepest node (spans compared too); clamped to
    `max_step` (the deepest step a match may return) and moved down to a safe boundary."""
    if not path:
        return 0
    node = path[-1]
    base = node.depth * block_size
    rest = request.prompt_ids[base:base + block_size]
    if not rest:
        return min(base, max_step)
    # a child whose first token differs agrees on 0 tokens: only those sharing it can raise the agreement
    others = [(c.token_ids, c.spans) for c in trie.children_starting_with(node, rest[0])]
    others += [(c.tail_ids, c.tail_spans) for c in node.iter_checkpoints()]
    return agreement_step(request, base, block_size, others, max_step)


def agreement_step(
    request: CacheRequest, base: int, block_size: int, others: list[tuple[tuple[int, ...], tuple]], max_step: int,
) -> int:
    """`base` plus the longest common prefix of the prompt's next block from `base` with any of `others`
    ((tokens, spans) of child blocks or checkpoint tails that start at `base`; a span that one side has and the
    other lacks ends the agreement at its start), clamped to `max_step` and moved down to a safe boundary."""
    rest = request.prompt_ids[base:base + block_size]
    best = 0
    for tokens, spans in others:
        agree = common_prefix_len(tokens, rest)
        if agree <= best:
            continue
        mine = set(request.spans_in(base, base + agree))
        theirs = {s for s in spans if s.start < base + agree and s.end > base}
        differing = mine ^ theirs
        if differing:
            agree = max(0, min(s.start for s in differing) - base)
        best = max(best, agree)
    step = min(base + best, max_step)
    for span in request.spans_in(step - 1, step + 1):
        if span.start < step < span.end:
            step = span.start
    return step
