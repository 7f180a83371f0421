"""The simulator's yardsticks: `oracle` (unbounded memory, a state at every step: `OracleIndex`), and the
`bounded-oracle` and `reuse-oracle` (`BoundedOracleReplay`: the real cache at the same budget, saving only what
a later request uses and evicting with knowledge of the future: when items are used next (`BeladyPolicy`), or
only whether they are (`timing=False`)).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence

from hybridcache.bench.replay import CacheReplay
from hybridcache.bench.results import Counters, PolicyResult, policy_result
from hybridcache.bench.specs import PolicySpec, SimConfig
from hybridcache.bench.workloads import SimRequest
from hybridcache.cache import CacheRequest
from hybridcache.cache.policy import EvictionPolicy
from hybridcache.cache.request import common_prefix_len
from hybridcache.cache.trie import chain_hash, prompt_block_hashes, root_hash
from hybridcache.engine.cost_model import ModelCost

FUTURE_POLICIES = ("bounded-oracle", "reuse-oracle")  # replayed with the whole workload known (`BoundedOracleReplay`)


class OracleIndex:
    """Every fed token sequence so far, as a trie of `block_size`-token blocks keyed exactly by
    (parent node, tokens); each node also lists its children and partial tails by first token, so the
    longest common prefix with anything fed costs O(prompt / B) dict lookups plus a few comparisons::

        fed so far: [a b c d | e f g h | i j]          (B = 4)
        query:      [a b c d | e f x y | ...]  -> 4 (block) + 2 (common prefix with child "e f g h") = 6

    `num_tokens` counts every distinct fed prefix once (the tokens of a token-level trie): a block or tail adds
    its tokens beyond the longest prefix it shares with the blocks and tails already under its node::

        fed [a b], then [a b c d | e]:  2, then + 2 (c d: "a b" was fed) + 1 (e) = 5
    """

    def __init__(self, block_size: int = 64) -> None:
        self.block_size = block_size
        self._nodes: dict[tuple[int, tuple[int, ...]], int] = {}
        self._by_first: dict[int, dict[int, list[tuple[int, ...]]]] = {}
        self.num_tokens = 0

    def longest_prefix(self, token_ids: tuple[int, ...]) -> int:
        size, node, pos = self.block_size, 0, 0
        while pos + size <= len(token_ids):
            child = self._nodes.get((node, token_ids[pos:pos + size]))
            if child is None:
                break
            node, pos = child, pos + size
        rest = token_ids[pos:pos + size]
        best = 0
        if rest:
            for other in self._by_first.get(node, {}).get(rest[0], ()):
                agree = common_prefix_len(other, rest)
                best = max(best, agree)
        return pos + best

    def insert(self, token_ids: tuple[int, ...]) -> None:
        size, node, pos = self.block_size, 0, 0
        while pos < len(token_ids):
            block = token_ids[pos:pos + size]
            entries = self._by_first.setdefault(node, {}).setdefault(block[0], [])  # blocks and tails
            if len(block) == size:
                child = self._nodes.get((node, block))
                if child is None:
                    child = len(self._nodes) + 1
                    self._nodes[(node, block)] = child
                    self.num_tokens += size - _longest_common_prefix(block, entries)
                    entries.append(block)
                node, pos = child, pos + size
            else:
                seen = _longest_common_prefix(block, entries)
                if seen < len(block):
                    entries.append(block)
                    self.num_tokens += len(block) - seen
                break


def _longest_common_prefix(tokens: tuple[int, ...], others: Sequence[tuple[int, ...]]) -> int:
    return max((common_prefix_len(tokens, other) for other in others), default=0)


class OracleReplay:
    """`oracle`: unbounded memory and a state at every step (see `OracleIndex`)."""

    def __init__(self, spec: PolicySpec, cost: ModelCost) -> None:
        self.spec, self.cost, self.counters = spec, cost, Counters()
        self.index = OracleIndex()

    def run(self, request: SimRequest) -> None:
        self.counters.num_requests += 1
        hit = self.index.longest_prefix(request.prompt_ids)
        for i in range(request.n):  # siblings share the first completion's prompt (in flight)
            self.counters.add(request, hit if i == 0 else request.prompt_len, self.cost)
        for output in request.outputs():
            self.index.insert(request.prompt_ids + output[:-1])
        self.counters.bytes_peak = self.index.num_tokens * self.cost.kv_bytes_per_token

    def result(self) -> PolicyResult:
        return policy_result(self.spec.name, self.counters)


class FutureIndex:
    """Who needs a prefix next: for every request of the workload (in order), its prompt and the chained
    hashes of its full blocks (the cache's own), indexed hash -> the requests holding that block.

    `next_use(prefix_hash, depth, tail, after)`: the first request index > `after` whose prompt has the
    full blocks ending in `prefix_hash` (at `depth`) followed by `tail` (verified exactly), and is at least
    that long; None when no later request has it. Depth 0 (no full block) looks at every later request,
    up to `scan` of them.
    """

    def __init__(self, requests: Sequence[SimRequest], block_size: int, scan: int = 256) -> None:
        self.block_size, self.scan = block_size, scan
        self.prompts = [r.prompt_ids for r in requests]
        self.hashes = [prompt_block_hashes(CacheRequest(i, prompt), block_size, chain_hash)
                       for i, prompt in enumerate(self.prompts)]  # request i's full blocks, its trie identities
        self.by_hash: dict[int, list[int]] = {}
        for i, hashes in enumerate(self.hashes):
            for h in hashes:
                self.by_hash.setdefault(h, []).append(i)

    def next_use(self, prefix_hash: int | None, depth: int, tail: tuple[int, ...], after: int) -> int | None:
        base = depth * self.block_size
        if depth:
            holders = self.by_hash.get(prefix_hash, ())
            candidates = holders[bisect_right(holders, after):]
        else:
            candidates = range(after + 1, min(len(self.prompts), after + 1 + self.scan))
        for j in candidates:
            prompt = self.prompts[j]
            if len(prompt) >= base + len(tail) and prompt[base:base + len(tail)] == tail:
                return j
        return None


class BeladyPolicy(EvictionPolicy):
    """Eviction with knowledge of the future (the `bounded-oracle`): evict what is needed furthest in the
    future (never again first), weighing bytes: the largest (distance to the next use) x (bytes held).
    `now` is the index of the request being replayed (set by `BoundedOracleReplay`).

    `timing=False` (the `reuse-oracle`) knows *whether* an item is used again but not *when*: never-used
    items first (by bytes), then the least recently used, as `hybridcache`'s LRU. What separates it from
    the bounded oracle is the foresight of when chains return."""

    orders_kinds = True  # leaves against checkpoints by score (`prefer_checkpoint`); no shadowed precedence

    def __init__(self, future: FutureIndex, block_bytes: float, state_bytes: float, timing: bool = True) -> None:
        self.future, self.now = future, 0
        self.block_bytes, self.state_bytes = block_bytes, state_bytes
        self.timing = timing
        self._memo: dict[tuple, int | None] = {}
        self._memo_now = -1

    def _next(self, key: tuple, anchor, tail: tuple[int, ...]) -> float:
        if self._memo_now != self.now:
            self._memo, self._memo_now = {}, self.now
        if key not in self._memo:
            self._memo[key] = self.future.next_use(anchor.hash, anchor.depth, tail, self.now)
        j = self._memo[key]
        return float("inf") if j is None else float(j - self.now)

    def _held(self, ckpt) -> float:
        return self.state_bytes + (self.block_bytes if ckpt.frozen_block is not None else 0)

    def _ckpt_score(self, ckpt) -> tuple:
        distance = self._next(("c", ckpt.ckpt_id), ckpt.anchor, ckpt.tail_ids)
        return self._score(distance, self._held(ckpt), ckpt.last_access, False)

    def _leaf_score(self, node) -> tuple:
        held = self.block_bytes + sum(self._held(c) for c in node.iter_checkpoints())
        distance = self._next(("n", node.block_id, node.hash), node, ())
        recency = max([node.last_access, *(c.last_access for c in node.iter_checkpoints())])
        return self._score(distance, held, recency, True)

    def _score(self, distance: float, held: float, last_access: int, leaf: bool) -> tuple:
        """Larger is evicted first: never needed again (by bytes), then distance x bytes (`timing`) or, as
        `hybridcache` orders them, leaves before checkpoints, the least recently used first."""
        if distance == float("inf"):
            return (1, held, 0.0)
        return (0, 0, distance * held) if self.timing else (0, int(leaf), -last_access)

    def pick_checkpoint(self, candidates):
        return max(candidates, key=lambda c: self._ckpt_score(c) + (-c.ckpt_id,))

    def prefer_checkpoint(self, ckpt, leaf) -> bool:
        """Under one budget in bytes: whether `ckpt` goes before `leaf` (the larger score)."""
        return self._ckpt_score(ckpt) > self._leaf_score(leaf)

    def pick_leaf(self, candidates):
        return max(candidates, key=lambda n: self._leaf_score(n) + (-n.block_id,))


class BoundedOracleReplay(CacheReplay):
    """`bounded-oracle`: the hybridcache policy on the real cache with the same budget and accounting, but
    a save is made only when a later request will need that prefix (`FutureIndex`), and eviction is
    Belady's (`BeladyPolicy`). Needs the whole workload up front (`prepare`, with its `FutureIndex`)."""

    admission = "all"  # it admits by looking ahead (`_wants_save`)
    uses_host_tier = False  # a yardstick of one budget: run it at GPU + host bytes to compare with a host tier

    def __init__(self, spec: PolicySpec, cost: ModelCost, config: SimConfig, max_running: int = 1) -> None:
        super().__init__(spec, cost, config, max_running)
        self.now = -1
        self.current: SimRequest | None = None
        self.future: FutureIndex | None = None
        self.belady: BeladyPolicy | None = None

    def prepare(self, future: FutureIndex) -> None:
        """Replay against `future`, the workload's `FutureIndex` at this replay's block size (read-only: the
        bounded and reuse oracles of one run share it)."""
        self.future = future
        life = self.cache._life
        self.belady = BeladyPolicy(future, life.block_bytes, life.state_bytes,  # paged: a state is k pages
                                   timing=self.spec.base == "bounded-oracle")
        self.cache._life.evictor.policy = self.belady  # the full-scan pick path (evictor.py)

    def run(self, request: SimRequest, cache_requests: Sequence[CacheRequest] | None = None) -> None:
        self.now += 1
        self.belady.now = self.now
        self.current = request
        super().run(request, cache_requests)

    def _wants_save(self, tokens: tuple[int, ...], step: int) -> bool:
        prompt = self.current.prompt_ids
        if self.current.n > 1 and step <= len(prompt) and tokens[:step] == prompt[:step]:
            return True  # the request's other completions fork from it
        size = self.block_size
        q = step // size
        anchor = self._anchor_hash(tokens, q) if q else None
        return self.future.next_use(anchor, q, tokens[q * size:step], self.now) is not None

    def _anchor_hash(self, tokens: tuple[int, ...], q: int) -> int:
        """The chained hash of the first q >= 1 full blocks of `tokens` (the trie's node identity): the current
        prompt's own hashes (`FutureIndex.hashes`) as far as `tokens` agree with the prompt, then chained on
        over the rest (a finish save's reply blocks), instead of hashing the whole prefix again per save."""
        size, prompt = self.block_size, self.current.prompt_ids
        own = self.future.hashes[self.now]
        known = min(q, len(own))
        if tokens[:known * size] != prompt[:known * size]:
            known = 0
        parent = own[known - 1] if known else root_hash(None)
        for i in range(known, q):
            parent = chain_hash(parent, tokens[i * size:(i + 1) * size], ())
        return parent


