"""The cache simulator (`hybridcache simulate`): replays a workload through the real `PrefixCache` (the code
the engine runs, no model) under several policies side by side, and counts what each one saves.

Per request and policy (`CacheReplay.run`)::

    m = cache.match(CacheRequest(rid, prompt))        branch = m.divergence_len when > m.cached_len
    plan = plan_chunk(policy, start=m.cached_len, ...) the engine's own chunk/save planner (save_plan.py)
    cache.admit(m, plan.end)                           None: no room even after eviction -> uncacheable
    repeat until the prompt is fed:
        cache.ensure_capacity(rid, plan.end); cache.reserve_save(rid, plan.end, plan.reason)
        cache.commit_step({rid: prompt[start:plan.end]}); plan = plan_chunk(...)
    cache.commit_step({rid: output[:-1]})              all decode tokens but the last in one commit
    cache.finish(rid) if policy.finish else cache.abort(rid)

Simplifications (documented in docs/bench.md):
- Requests are simulated one at a time in arrival order, even when they overlap in time; the `n`
  completions of one request run together (matched and admitted before any is fed), as in the engine.
- Decode tokens are fed in one commit: with decode checkpoints off (the default) only the blocks they fill
  and the finish step matter to the cache, and both are the same as one commit per token.
- Each sequence gets the whole chunk budget (`chunk_budget`, 8192 tokens by default).

Policies (`parse_policies`): `none`; `block-aligned` (state only at block boundaries, one per anchor; a
block size may follow a colon, `block-aligned:528` as vLLM forces for Qwen3.5-4B); `seed` (exact prefill
and chunk ends, one checkpoint per anchor, LRU); `hybridcache` (this project's defaults: chunk ends, branch
points, finish, 4 per anchor, learned admission, LRU; what the engine runs), `hybridcache+flop` (the same
with FLOP-aware eviction), `hybridcache+all` (the same admitting every save); `oracle`
(unbounded memory and a state at every step: the longest prefix shared with any earlier request's fed
tokens, up to the whole prompt (a state keeps its last hidden state), computed directly by `OracleIndex`;
the other completions of a request hit all of its prompt); `bounded-oracle` (`BoundedOracleReplay`: the
real cache with the same budget and accounting, saving and evicting with knowledge of the future).

Memory: a budget of M bytes holds KV blocks and checkpoint states. The `hybridcache`-mode policies hold both
as the engine does (`PolicySpec.one_budget`): M // block bytes blocks, a checkpoint's state in
k = ceil(state bytes / block bytes) of them (`CacheConfig.state_pages`; KV and states compete in one eviction
order). `block-aligned` and `seed` model engines with a separate state pool: two pools, one slot per
`kv_tokens_per_slot` tokens of KV (`cache_sizing`). The running sequences' own state slots come on top (the
engine's budget is M + max_num_seqs state slots).
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

from hybridcache.bench.cost_model import ModelCost
from hybridcache.bench.workloads import SimRequest, Workload
from hybridcache.cache import CacheConfig, CacheRequest, PrefixCache
from hybridcache.cache.request import common_prefix_len
from hybridcache.engine.memory import state_pages
from hybridcache.scheduler.save_plan import CheckpointPolicy, checkpoint_policy, plan_chunk

POLICY_NAMES = ("none", "block-aligned", "seed", "hybridcache", "hybridcache+flop", "oracle", "bounded-oracle",
                "hybridcache+all", "reuse-oracle")
DEFAULT_POLICIES = POLICY_NAMES[:-3]
# the policies that run the `hybridcache` cache mode, with KV and states in one pool of blocks
_HYBRID_POLICIES = ("hybridcache", "hybridcache+flop", "bounded-oracle", "hybridcache+all", "reuse-oracle")
_FUTURE_POLICIES = ("bounded-oracle", "reuse-oracle")  # replayed with the whole workload known (`BoundedOracleReplay`)
GIB = 1 << 30


@dataclass(frozen=True)
class PolicySpec:
    """One simulated policy: `name` as reported, the cache `mode` of save_plan.py (or `none` / `oracle`),
    the eviction policy and the block size it runs with."""

    name: str
    mode: str
    block_size: int
    eviction: str = "lru"
    admission: str | None = None  # the cache's admission policy; None: the mode's

    @property
    def one_budget(self) -> bool:
        """KV blocks and checkpoint states share one pool (`CacheConfig.state_pages`), as in the engine."""
        return self.mode == "hybridcache"


def parse_policies(text: str | Iterable[str], block_size: int) -> list[PolicySpec]:
    """`"none,block-aligned:528,hybridcache"` -> specs; `NAME:B` overrides the block size of one policy."""
    names = [p.strip() for p in (text.split(",") if isinstance(text, str) else text) if p.strip()]
    specs = []
    for name in names:
        base, _, size = name.partition(":")
        if base not in POLICY_NAMES:
            raise ValueError(f"unknown policy {base!r}; choose from {', '.join(POLICY_NAMES)} (NAME:BLOCK_SIZE)")
        mode = "hybridcache" if base in _HYBRID_POLICIES else base
        eviction = "flop_aware" if base == "hybridcache+flop" else "lru"
        admission = "all" if base == "hybridcache+all" else None
        specs.append(PolicySpec(name, mode, int(size) if size else block_size, eviction, admission))
    if len({s.name for s in specs}) != len(specs):
        raise ValueError(f"policies repeat: {names}")
    return specs


@dataclass(frozen=True)
class SimConfig:
    """Memory budget (bytes, KV + checkpoint states), default block size, chunk budget, slot sizing."""

    memory_bytes: int
    block_size: int = 64
    chunk_budget: int = 8192
    kv_tokens_per_slot: int = 2048
    check_integrity: bool = False


def cache_sizing(memory_bytes: int, cost: ModelCost, block_size: int, kv_tokens_per_slot: int) -> tuple[int, int]:
    """(num_blocks, num_checkpoint_slots) that fit `memory_bytes` in an engine with a separate pool of state slots
    (the `block-aligned` and `seed` policies model such engines; hybridcache's own keeps one pool, see the module
    docstring): one state slot per `kv_tokens_per_slot` KV tokens, bought in pairs. Example: 1 GiB of the built-in model
    (1,024 B per KV token, 117,248 B per slot with its last hidden state), B = 64, 2,048 tokens per slot: a pair
    is 117,248 + 32 blocks x 65,536 = 2,214,400 B: 484 slots, then (2^30 - 484 x 117,248) // 65,536 = 15,518
    blocks."""
    block_bytes = cost.block_bytes(block_size)
    pair = cost.state_bytes + block_bytes * kv_tokens_per_slot // block_size
    num_slots = int(memory_bytes // pair)
    num_blocks = int((memory_bytes - num_slots * cost.state_bytes) // block_bytes)
    if num_blocks < 1 or num_slots < 1:
        raise ValueError(f"a budget of {memory_bytes / GIB:.3g} GiB holds {num_blocks} blocks and {num_slots} slots")
    return num_blocks, num_slots


@dataclass
class Counters:
    """What one policy did over a workload (mutable while it runs)."""

    num_requests: int = 0
    num_sequences: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    flops_saved: float = 0.0
    num_uncacheable: int = 0
    bytes_peak: int = 0
    hit_tokens_by_turn: dict[int, list[int]] = field(default_factory=dict)

    def add(self, request: SimRequest, hit_tokens: int, cost: ModelCost) -> None:
        """One completed sequence of `request` that skipped `hit_tokens` prompt tokens."""
        self.num_sequences += 1
        self.prompt_tokens += request.prompt_len
        self.hit_tokens += hit_tokens
        self.flops_saved += cost.prefill_flops(hit_tokens)
        by_turn = self.hit_tokens_by_turn.setdefault(request.turn, [0, 0])
        by_turn[0] += hit_tokens
        by_turn[1] += request.prompt_len


@dataclass(frozen=True)
class PolicyResult:
    """The simulator's report for one policy. `token_hit_rate` = hit tokens / prompt tokens (every
    completion counts its prompt); `bytes_peak` = the largest KV + checkpoint-state bytes held (for
    `oracle`: the KV of every distinct fed token; its states are not counted)."""

    name: str
    token_hit_rate: float
    prefill_tokens_computed: int
    flops_saved: float
    checkpoints_saved: int
    evictions: int
    bytes_peak: int
    num_requests: int
    prompt_tokens: int
    hit_tokens: int
    num_uncacheable: int
    num_blocks: int | None
    num_slots: int | None
    state_pages: int | None  # paged: blocks per checkpoint state (None: two pools, or no cache)
    hits_by_reason: dict[str, int]
    evictions_by_kind: dict[str, int]
    hit_rate_by_turn: dict[int, float]

    def to_json(self) -> dict:
        return asdict(self)


def _result(name: str, c: Counters, **extra) -> PolicyResult:
    values = dict(checkpoints_saved=0, evictions=0, num_blocks=None, num_slots=None, state_pages=None,
                  hits_by_reason={}, evictions_by_kind={})
    values.update(extra)
    return PolicyResult(
        name=name,
        token_hit_rate=c.hit_tokens / c.prompt_tokens if c.prompt_tokens else 0.0,
        prefill_tokens_computed=c.prompt_tokens - c.hit_tokens,
        flops_saved=c.flops_saved,
        bytes_peak=c.bytes_peak,
        num_requests=c.num_requests,
        prompt_tokens=c.prompt_tokens,
        hit_tokens=c.hit_tokens,
        num_uncacheable=c.num_uncacheable,
        hit_rate_by_turn={t: h / p if p else 0.0 for t, (h, p) in sorted(c.hit_tokens_by_turn.items())},
        **values,
    )


class NoCacheReplay:
    """`none`: nothing is reused; the running sequence's own KV is the only memory held."""

    def __init__(self, spec: PolicySpec, cost: ModelCost) -> None:
        self.spec, self.cost, self.counters = spec, cost, Counters()

    def run(self, request: SimRequest) -> None:
        self.counters.num_requests += 1
        fed = request.prompt_len + max(len(o) for o in request.outputs()) - 1
        self.counters.bytes_peak = max(self.counters.bytes_peak, request.n * fed * self.cost.kv_bytes_per_token)
        for _ in range(request.n):
            self.counters.add(request, 0, self.cost)

    def result(self) -> PolicyResult:
        return _result(self.spec.name, self.counters)


class OracleIndex:
    """Every fed token sequence so far, as a trie of `block_size`-token blocks keyed exactly by
    (parent node, tokens); each node also lists its children and partial tails by first token, so the
    longest common prefix with anything fed costs O(prompt / B) dict lookups plus a few comparisons::

        fed so far: [a b c d | e f g h | i j]          (B = 4)
        query:      [a b c d | e f x y | ...]  -> 4 (block) + 2 (common prefix with child "e f g h") = 6
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
            if len(block) == size:
                child = self._nodes.get((node, block))
                if child is None:
                    child = len(self._nodes) + 1
                    self._nodes[(node, block)] = child
                    self._by_first.setdefault(node, {}).setdefault(block[0], []).append(block)
                    self.num_tokens += size
                node, pos = child, pos + size
            else:
                tails = self._by_first.setdefault(node, {}).setdefault(block[0], [])
                if not any(t[: len(block)] == block for t in tails):
                    tails.append(block)
                    self.num_tokens += len(block)
                break


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
        return _result(self.spec.name, self.counters)


@dataclass
class _Seq:
    rid: Hashable
    output_ids: tuple[int, ...]
    cached_len: int
    branch_step: int | None
    computed: int


class CacheReplay:
    """A policy that drives a real `PrefixCache` (see the module docstring for the call sequence)."""

    admission: str | None = None  # the cache's admission policy; None: the cache mode's

    def __init__(self, spec: PolicySpec, cost: ModelCost, config: SimConfig, max_running: int = 1) -> None:
        self.spec, self.cost, self.config = spec, cost, config
        self.policy: CheckpointPolicy = checkpoint_policy(spec.mode)
        self.block_size = spec.block_size
        self.state_pages: int | None = None
        if spec.one_budget:  # paged, as the engine: the budget in blocks, k of them per checkpoint state
            block_bytes = cost.block_bytes(spec.block_size)
            self.num_blocks = max(1, int(config.memory_bytes // block_bytes))
            self.state_pages = state_pages(int(cost.state_bytes), int(block_bytes))
            num_ckpt_slots = 0  # the running sequences' runtime slots only
        else:
            self.num_blocks, num_ckpt_slots = cache_sizing(config.memory_bytes, cost, spec.block_size,
                                                           config.kv_tokens_per_slot)
        self.num_slots = num_ckpt_slots + max_running
        self.max_running = max_running
        self.cache = PrefixCache(
            CacheConfig(block_size=spec.block_size, num_blocks=self.num_blocks, num_slots=self.num_slots,
                        max_checkpoints_per_anchor=self.policy.max_checkpoints_per_anchor,
                        eviction=spec.eviction, full_prompt_hits=self.policy.full_prompt_hits,
                        admission=spec.admission or self.admission or self.policy.admission,
                        state_pages=self.state_pages),
            cost.cache_cost_model(),
        )
        self.counters = Counters()

    def _plan(self, seq: _Seq, prompt_len: int):
        return plan_chunk(self.policy, start=seq.computed, num_tokens=prompt_len, budget=self.config.chunk_budget,
                          prompt_len=prompt_len, block_size=self.block_size, branch_step=seq.branch_step,
                          hit_len=seq.cached_len)

    def run(self, request: SimRequest, cache_requests: Sequence[CacheRequest] | None = None) -> None:
        """Replay `request`; `cache_requests[i]` (from `cache_requests_of`) is completion i's cache request,
        shared by every policy so that its block hashes are computed once."""
        if request.n > self.max_running:
            raise ValueError(f"request {request.request_id} has n={request.n} > max_running {self.max_running}")
        self.counters.num_requests += 1
        pending = list(enumerate(request.outputs()))
        if cache_requests is None:
            cache_requests = cache_requests_of(request)
        while pending:
            # in-flight sharing: the other completions wait for the first one's prefill, then fork from it
            first_alone = self.policy.share_in_flight and len(pending) == request.n > 1
            wave = self._admit(request, pending[:1] if first_alone else pending, cache_requests)
            if not wave:  # not even one sequence fits next to nothing: computed without the cache
                pending.pop(0)
                self.counters.num_uncacheable += 1
                self.counters.add(request, 0, self.cost)
                continue
            pending = pending[len(wave):]
            self._run_wave(request, wave)

    def _admit(
        self, request: SimRequest, pending: list[tuple[int, tuple[int, ...]]], cache_requests: Sequence[CacheRequest],
    ) -> list[_Seq]:
        prompt = request.prompt_ids
        wave: list[_Seq] = []
        for index, output in pending:
            rid = (request.request_id, index)
            seq = self._admit_one(cache_requests[index], rid, output, len(prompt), max_step=None)
            if seq is None and not wave:  # a hit can need a block more than a miss (as the scheduler does)
                seq = self._admit_one(cache_requests[index], rid, output, len(prompt), max_step=0)
            if seq is None:
                break
            wave.append(seq)
        return wave

    def _admit_one(self, request: CacheRequest, rid: Hashable, output: tuple[int, ...], prompt_len: int,
                   max_step: int | None) -> _Seq | None:
        match = self.cache.match(request, max_step)
        branch = match.divergence_len if match.divergence_len > match.cached_len else None
        seq = _Seq(rid, output, match.cached_len, branch, match.cached_len)
        if self.cache.admit(match, self._plan(seq, prompt_len).end) is None:
            self.cache.release_match(match)
            return None
        return seq

    def _run_wave(self, request: SimRequest, wave: list[_Seq]) -> None:
        cache, prompt = self.cache, request.prompt_ids
        prompt_len = len(prompt)
        active = list(wave)
        while any(s.computed < prompt_len for s in active):
            fed = {}
            for seq in list(active):
                if seq.computed >= prompt_len:
                    continue
                plan = self._plan(seq, prompt_len)
                if not cache.ensure_capacity(seq.rid, plan.end):
                    self._drop(request, seq, active)
                    continue
                if plan.reason is not None and self._wants_save(prompt, plan.end):
                    cache.reserve_save(seq.rid, plan.end, plan.reason)
                fed[seq.rid] = prompt[seq.computed:plan.end]
                seq.computed = plan.end
            if fed:
                cache.commit_step(fed)
        decode = {}
        for seq in list(active):
            if len(seq.output_ids) > 1:
                if not cache.ensure_capacity(seq.rid, prompt_len + len(seq.output_ids) - 1):
                    self._drop(request, seq, active)
                    continue
                decode[seq.rid] = seq.output_ids[:-1]
        if decode:
            cache.commit_step(decode)
        self._sample_memory()
        for seq in active:
            fed = prompt + seq.output_ids[:-1]
            if self.policy.finish and self._wants_save(fed, len(fed)):
                cache.finish(seq.rid)
            else:
                cache.abort(seq.rid)
            self.counters.add(request, seq.cached_len, self.cost)
        if self.config.check_integrity:
            cache.check_integrity()

    def _wants_save(self, tokens: tuple[int, ...], step: int) -> bool:
        """Whether to save the state of `tokens[:step]` when the policy plans a save (all: the cache's own
        admission decides; the bounded oracle looks ahead)."""
        return True

    def _drop(self, request: SimRequest, seq: _Seq, active: list[_Seq]) -> None:
        """No room for the sequence's next blocks even after eviction: it runs without the cache."""
        self.cache.abort(seq.rid)
        active.remove(seq)
        self.counters.num_uncacheable += 1
        self.counters.add(request, 0, self.cost)

    def _sample_memory(self) -> None:
        stats = self.cache.stats
        held = stats.num_blocks_used * self.cost.block_bytes(self.block_size)  # paged: states' pages included
        if self.state_pages is None:
            held += (stats.num_slots_used - stats.num_running) * self.cost.state_bytes
        self.counters.bytes_peak = max(self.counters.bytes_peak, held)

    def result(self) -> PolicyResult:
        stats = self.cache.stats
        return _result(
            self.spec.name, self.counters,
            checkpoints_saved=sum(stats.saves_by_reason.values()),
            evictions=sum(stats.evictions_by_kind.values()),
            num_blocks=self.num_blocks, num_slots=self.num_slots, state_pages=self.state_pages,
            hits_by_reason=dict(stats.hits_by_reason), evictions_by_kind=dict(stats.evictions_by_kind),
        )


class FutureIndex:
    """Who needs a prefix next: for every request of the workload (in order), its prompt and the chained
    hashes of its full blocks (the cache's own), indexed hash -> the requests holding that block.

    `next_use(prefix_hash, depth, tail, after)`: the first request index > `after` whose prompt has the
    full blocks ending in `prefix_hash` (at `depth`) followed by `tail` (verified exactly), and is at least
    that long; None when no later request has it. Depth 0 (no full block) looks at every later request,
    up to `scan` of them.
    """

    def __init__(self, requests: Sequence[SimRequest], block_size: int, scan: int = 256) -> None:
        from bisect import bisect_right

        from hybridcache.cache.trie import chain_hash, prompt_block_hashes

        self._bisect = bisect_right
        self.block_size, self.scan = block_size, scan
        self.prompts = [r.prompt_ids for r in requests]
        self.by_hash: dict[int, list[int]] = {}
        for i, request in enumerate(requests):
            hashes = prompt_block_hashes(CacheRequest(i, request.prompt_ids), block_size, chain_hash)
            for h in hashes:
                self.by_hash.setdefault(h, []).append(i)

    def next_use(self, prefix_hash: int | None, depth: int, tail: tuple[int, ...], after: int) -> int | None:
        base = depth * self.block_size
        if depth:
            holders = self.by_hash.get(prefix_hash, ())
            candidates = holders[self._bisect(holders, after):]
        else:
            candidates = range(after + 1, min(len(self.prompts), after + 1 + self.scan))
        for j in candidates:
            prompt = self.prompts[j]
            if len(prompt) >= base + len(tail) and prompt[base:base + len(tail)] == tail:
                return j
        return None


class BeladyPolicy:
    """Eviction with knowledge of the future (the `bounded-oracle`): evict what is needed furthest in the
    future (never again first), weighing bytes: the largest (distance to the next use) x (bytes held).
    `now` is the index of the request being replayed (set by `BoundedOracleReplay`).

    `timing=False` (the `reuse-oracle`) knows *whether* an item is used again but not *when*: never-used
    items first (by bytes), then the least recently used, as `hybridcache`'s LRU. What separates it from
    the bounded oracle is the foresight of when chains return."""

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
    Belady's (`BeladyPolicy`). Needs the whole workload up front (`prepare`)."""

    needs_future = True
    admission = "all"  # it admits by looking ahead (`_wants_save`)

    def __init__(self, spec: PolicySpec, cost: ModelCost, config: SimConfig, max_running: int = 1) -> None:
        super().__init__(spec, cost, config, max_running)
        self.now = -1
        self.current: SimRequest | None = None
        self.future: FutureIndex | None = None
        self.belady: BeladyPolicy | None = None

    def prepare(self, requests: Sequence[SimRequest]) -> None:
        self.future = FutureIndex(requests, self.block_size)
        life = self.cache._life
        self.belady = BeladyPolicy(self.future, life.block_bytes, life.state_bytes,  # paged: a state is k pages
                                   timing=not self.spec.name.startswith("reuse-oracle"))
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
        anchor = prompt_block_hashes_of(tokens[:q * size], size)[-1] if q else None
        return self.future.next_use(anchor, q, tokens[q * size:step], self.now) is not None


def prompt_block_hashes_of(tokens: tuple[int, ...], block_size: int) -> list[int]:
    from hybridcache.cache.trie import chain_hash, prompt_block_hashes

    return prompt_block_hashes(CacheRequest(None, tokens), block_size, chain_hash)


Replay = NoCacheReplay | OracleReplay | CacheReplay


def cache_requests_of(request: SimRequest) -> list[CacheRequest]:
    """The cache's view of each completion of `request` (request id `(request_id, i)`)."""
    return [CacheRequest((request.request_id, i), request.prompt_ids) for i in range(request.n)]


def _replay_all(
    requests: Iterable[SimRequest], replays: list[Replay], max_running: int,
    on_request: Callable[[int], None] | None,
) -> int:
    """Feed each request to every replay in turn (one rendering, one set of cache requests whose block
    hashes every cache policy reuses); `on_request(i)` after request i. Returns the number of requests."""
    count = 0
    for request in requests:
        if request.n > max_running:  # resize is not possible mid-run; workloads keep n constant
            raise ValueError(f"request {request.request_id}: n={request.n}, the first request had {max_running}")
        shared = None
        for replay in replays:
            if isinstance(replay, CacheReplay):
                if shared is None:
                    shared = cache_requests_of(request)
                replay.run(request, shared)
            else:
                replay.run(request)
        if on_request is not None:
            on_request(count)
        count += 1
    return count


def make_replay(spec: PolicySpec, cost: ModelCost, config: SimConfig, max_running: int = 1) -> Replay:
    if spec.mode == "none":
        return NoCacheReplay(spec, cost)
    if spec.mode == "oracle":
        return OracleReplay(spec, cost)
    if spec.name.partition(":")[0] in _FUTURE_POLICIES:
        return BoundedOracleReplay(spec, cost, config, max_running)
    return CacheReplay(spec, cost, config, max_running)


@dataclass(frozen=True)
class SimResult:
    """One simulator run: the workload, the model, the budget and every policy's result."""

    workload: str
    model: str
    memory_bytes: int
    block_size: int
    num_requests: int
    policies: dict[str, PolicyResult]

    def to_json(self) -> dict:
        return {
            "workload": self.workload,
            "model": self.model,
            "memory_gib": self.memory_bytes / GIB,
            "block_size": self.block_size,
            "num_requests": self.num_requests,
            "policies": {name: r.to_json() for name, r in self.policies.items()},
        }


def simulate(
    workload: Workload,
    specs: list[PolicySpec],
    cost: ModelCost,
    config: SimConfig,
    on_request: Callable[[int], None] | None = None,
) -> SimResult:
    """Replay `workload` once, feeding each request to every policy in turn (tokens are rendered once).
    `on_request(i)` is called after request i (for a progress bar)."""
    results, count = _simulate_jobs(workload, [(s, config) for s in specs], cost, on_request)
    return SimResult(workload.name, cost.name, config.memory_bytes, config.block_size, count,
                     {s.name: r for s, r in zip(specs, results, strict=True)})


def _simulate_jobs(
    workload: Workload, jobs: list[tuple[PolicySpec, SimConfig]], cost: ModelCost,
    on_request: Callable[[int], None] | None,
) -> tuple[list[PolicyResult], int]:
    """Every (policy, config) job over one rendering of the workload; results in job order, and the count."""
    requests = iter(workload)
    first = next(requests, None)
    max_running = 1 if first is None else first.n
    replays = [make_replay(spec, cost, config, max_running) for spec, config in jobs]
    stream: Iterable[SimRequest] = () if first is None else _chain(first, requests)
    if any(getattr(r, "needs_future", False) for r in replays):  # the bounded oracle sees the whole workload
        stream = list(stream)
        for replay in replays:
            if getattr(replay, "needs_future", False):
                replay.prepare(stream)
    with _cyclic_gc_paused():
        count = 0 if first is None else _replay_all(stream, replays, max_running, on_request)
    return [r.result() for r in replays], count


@contextmanager
def _cyclic_gc_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector while replaying. A replay holds millions of live objects
    (trie nodes, token tuples) and frees almost everything by reference counting; each full collection
    walks them all and finds next to nothing (173 objects in 3,000 Mooncake requests x 3 policies), and
    they took half of the run time. Reference counting still frees memory while paused."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _chain(first: SimRequest, rest: Iterable[SimRequest]) -> Iterable[SimRequest]:
    yield first
    yield from rest


def simulate_many(
    workload: Workload,
    jobs: list[tuple[PolicySpec, SimConfig]],
    cost: ModelCost,
    num_workers: int = 1,
    on_request: Callable[[], None] | None = None,
) -> list[PolicyResult]:
    """Run each (policy, config) job over the workload; results in job order. The jobs are split into
    `num_workers` groups of about equal cost (`_split_jobs`); a group replays one rendering of the workload
    through all its jobs, in one forked process per group when `num_workers` > 1. `on_request()` is called
    once per simulated request of any job (polled from a shared counter), for a progress bar."""
    if num_workers <= 1 or len(jobs) <= 1:
        tick = None if on_request is None else lambda _: [on_request() for _ in jobs]
        return _simulate_jobs(workload, jobs, cost, tick)[0]
    groups = _split_jobs(jobs, num_workers)
    import multiprocessing as mp
    import queue as queue_module

    ctx = mp.get_context("fork")
    counter = ctx.Value("q", 0)
    done = ctx.Queue()
    results: dict[int, PolicyResult] = {}
    running: dict[int, mp.process.BaseProcess] = {}
    for g, group in enumerate(groups):
        running[g] = ctx.Process(target=_job, args=(workload, [jobs[i] for i in group], cost, counter, done, g),
                                 daemon=True)
        running[g].start()
    seen = 0

    def names(g: int) -> str:
        return ", ".join(jobs[i][0].name for i in groups[g])

    while running:
        try:
            g, result = done.get(timeout=0.2)
        except queue_module.Empty:
            seen = _report(counter, seen, on_request)
            for g, proc in running.items():
                if proc.exitcode not in (None, 0):
                    raise RuntimeError(f"simulating {names(g)} died (exit code {proc.exitcode})") from None
            continue
        if isinstance(result, BaseException):
            raise RuntimeError(f"simulating {names(g)} failed") from result
        results.update(zip(groups[g], result, strict=True))
        running.pop(g).join()
    _report(counter, seen, on_request)
    return [results[i] for i in range(len(jobs))]


def _split_jobs(jobs: list[tuple[PolicySpec, SimConfig]], num_groups: int) -> list[list[int]]:
    """Job indices in at most `num_groups` non-empty groups of about equal estimated cost (a cache policy
    costs 1, `oracle` 0.5, `none` nothing), heaviest first onto the lightest group: 6 default policies on
    2 groups -> [block-aligned, hybridcache, oracle] and [seed, hybridcache+flop, none]."""
    weight = {"none": 0.0, "oracle": 0.5}
    order = sorted(range(len(jobs)), key=lambda i: -weight.get(jobs[i][0].mode, 1.0))
    groups: list[list[int]] = [[] for _ in range(min(num_groups, len(jobs)))]
    loads = [0.0] * len(groups)
    for i in order:
        g = min(range(len(groups)), key=lambda k: (loads[k], len(groups[k])))
        groups[g].append(i)
        loads[g] += weight.get(jobs[i][0].mode, 1.0)
    return [sorted(group) for group in groups]


def _report(counter, seen: int, on_request: Callable[[], None] | None) -> int:
    value = counter.value
    if on_request is not None:
        for _ in range(value - seen):
            on_request()
    return value


def _job(workload, jobs, cost, counter, queue, index) -> None:
    def tick(_: int) -> None:
        with counter.get_lock():
            counter.value += len(jobs)

    try:
        queue.put((index, _simulate_jobs(workload, jobs, cost, tick)[0]))
    except BaseException as error:  # sent to the parent, which raises it
        queue.put((index, error))
