"""Prompts shared in flight: which prefill a waiting sequence should wait for instead of computing the
shared prefix again (the `n` completions of one request, identical or prefix-sharing prompts of one batch).

A waiting sequence F *follows* a running sequence L that is still prefilling when their prompts share a
prefix `[0, shared)` that L has not computed yet and that is worth the wait: at least one block more than
F's cache hit, or all of F's prompt. L ends a chunk at `shared` (a branch point, `Seq.fork_steps`; the
prompt end needs none: it is a prefill-end save); F stays in the queue until L has computed `shared`, then
its match restores that checkpoint (sharing L's full blocks, copying the state and the tail), and when
`shared` is F's whole prompt, it only samples (a zero-prefill hit).

Example (B = 16): L = 100 prompt tokens, F = the same 60 tokens + 40 others, admitted in one step. L's
first chunk ends at 60 (branch point), F waits one step, then hits 60 and prefills [60, 100) itself.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from hybridcache.cache.request import common_prefix_len
from hybridcache.multimodal import MultimodalInput
from hybridcache.scheduler.sequence import Seq


def worth_sharing(shared: int, cached_len: int, prompt_len: int, block_size: int) -> bool:
    """Whether waiting for `[0, shared)` beats computing it: a block more than the hit, or the whole prompt."""
    return shared > cached_len and (shared - cached_len >= block_size or shared >= prompt_len)


def prompt_share(leader: Seq, follower: Seq) -> int:
    """How much of `follower`'s prompt `leader`'s prompt (as the cache sees it) covers. With multimodal spans,
    only up to the first span the two do not have alike (same place, same content hash), and never into a span:
    an image that differs starts where the shared part ends. Nothing across cache salts (their roots differ: the
    follower could not restore what the leader saves, and its wait would tell it what another salt computes)."""
    if (not leader.token_ids or not follower.token_ids or leader.token_ids[0] != follower.token_ids[0]
            or leader.cache_salt != follower.cache_salt):
        return 0
    prompt = leader.token_ids[:leader.cache_prompt_len]
    shared = common_prefix_len(prompt, follower.token_ids)
    if leader.mm_inputs or follower.mm_inputs:
        shared = _alike_spans_end(leader.mm_inputs, follower.mm_inputs, shared)
    return shared


def _alike_spans_end(spans_a: Sequence[MultimodalInput], spans_b: Sequence[MultimodalInput], shared: int) -> int:
    """`shared` cut at the start of the first span (of either side, starting before it) the other side does not
    have alike, and at the start of a span that `shared` falls strictly inside."""
    before_a = [s for s in spans_a if s.start < shared]
    before_b = [s for s in spans_b if s.start < shared]
    for index in range(max(len(before_a), len(before_b))):
        a = before_a[index] if index < len(before_a) else None
        b = before_b[index] if index < len(before_b) else None
        if a is None or b is None or (a.start, a.end, a.content_hash) != (b.start, b.end, b.content_hash):
            return min(s.start for s in (a, b) if s is not None)
        if a.end > shared:
            return a.start
    return shared


def find_leader(
    follower: Seq, running: Iterable[Seq], cached_len: int, block_size: int,
) -> tuple[Seq, int] | None:
    """The running, still-prefilling sequence `follower` should wait for, and the shared length; None when
    none is worth it (see the module docstring). Ties: the largest share, then the earliest leader."""
    best: tuple[Seq, int] | None = None
    for leader in running:
        if leader.num_computed >= leader.cache_prompt_len:
            continue  # its prompt is computed: what it saved is already matchable
        shared = prompt_share(leader, follower)
        if shared <= leader.num_computed or not worth_sharing(shared, cached_len, follower.num_tokens, block_size):
            continue
        if best is None or shared > best[1]:
            best = (leader, shared)
    return best
