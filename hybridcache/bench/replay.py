"""The replays that drive a real `PrefixCache` (or none) for one policy, and the policy specs, budgets and
results they share; `simulator.py` feeds them a workload (its docstring has the call sequence), `oracles.py`
holds the replays that know more than a cache can.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace

from hybridcache.bench.workloads import SimRequest
from hybridcache.cache import CacheConfig, CacheRequest, CopyKind, CostModel, PrefixCache
from hybridcache.engine.cost_model import ModelCost
from hybridcache.engine.memory import state_pages
from hybridcache.scheduler.save_plan import CheckpointPolicy, checkpoint_policy, plan_chunk

POLICY_NAMES = ("none", "block-aligned", "seed", "hybridcache", "hybridcache+flop", "oracle", "bounded-oracle",
                "hybridcache+all", "reuse-oracle")
DEFAULT_POLICIES = POLICY_NAMES[:-3]
# the policies that run the `hybridcache` cache mode, with KV and states in one pool of blocks
_HYBRID_POLICIES = ("hybridcache", "hybridcache+flop", "bounded-oracle", "hybridcache+all", "reuse-oracle")
GIB = 1 << 30
# blocks one simulated cache may hold (device + host): its pool keeps a list entry per block (8 bytes)
MAX_SIM_BLOCKS = 1 << 26


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
    def base(self) -> str:
        """The policy's name without its block size (`block-aligned:528` -> `block-aligned`)."""
        return self.name.partition(":")[0]

    @property
    def one_budget(self) -> bool:
        """KV blocks and checkpoint states share one pool (`CacheConfig.state_pages`), as in the engine."""
        return self.mode == "hybridcache"


def parse_policies(text: str | Iterable[str], block_size: int) -> list[PolicySpec]:
    """`"none,block-aligned:528,hybridcache"` -> specs; `NAME:B` overrides the block size of one policy."""
    names = [p.strip() for p in (text.split(",") if isinstance(text, str) else text) if p.strip()]
    if not names:
        raise ValueError(f"no policy given; choose from {', '.join(POLICY_NAMES)}")
    specs = []
    for name in names:
        base, _, size = name.partition(":")
        if base not in POLICY_NAMES:
            raise ValueError(f"unknown policy {base!r}; choose from {', '.join(POLICY_NAMES)} (NAME:BLOCK_SIZE)")
        mode = "hybridcache" if base in _HYBRID_POLICIES else base
        eviction = "flop_aware" if base == "hybridcache+flop" else "lru"
        admission = "all" if base == "hybridcache+all" else None
        if size and not (size.isdigit() and int(size) >= 1):
            raise ValueError(f"policy {name!r}: the block size after ':' must be an integer >= 1, got {size!r}")
        specs.append(PolicySpec(name, mode, int(size) if size else block_size, eviction, admission))
    if len({s.name for s in specs}) != len(specs):
        raise ValueError(f"policies repeat: {names}")
    return specs


@dataclass(frozen=True)
class SimConfig:
    """Memory budget (bytes, KV + checkpoint states), default block size, chunk budget, slot sizing, and the host
    tier behind the budget: `host_memory_bytes` of host blocks (0: none) for the policies that run the engine's
    cache (`CacheReplay.uses_host_tier`; not the oracles), whose promotions pay when a copy at `host_bandwidth`
    bytes/s (inf: free) takes no longer than recomputing at `device_flops` FLOP/s (`CostModel.promotion_pays`)."""

    memory_bytes: int
    block_size: int = 64
    chunk_budget: int = 8192
    kv_tokens_per_slot: int = 2048
    check_integrity: bool = False
    host_memory_bytes: int = 0
    host_bandwidth: float = float("inf")
    device_flops: float = 4e14


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
    host_save_blocks: int = 0
    host_load_blocks: int = 0
    host_hit_tokens: int = 0
    hits_by_reason: dict[str, int] = field(default_factory=dict)
    hit_tokens_by_turn: dict[int, list[int]] = field(default_factory=dict)

    def add(self, request: SimRequest, hit_tokens: int, cost: ModelCost, reason: str | None = None,
            host_hit_tokens: int = 0) -> None:
        """One completed sequence of `request` that skipped `hit_tokens` prompt tokens, restored from a
        checkpoint saved for `reason` (None: a miss), `host_hit_tokens` of them from the host tier (0 or
        `hit_tokens`). A sequence admitted with a hit and then run without the cache is added as a miss, so that
        the hit tokens, the hits by reason and the host hit tokens count the same sequences."""
        self.num_sequences += 1
        self.prompt_tokens += request.prompt_len
        self.hit_tokens += hit_tokens
        self.host_hit_tokens += host_hit_tokens
        if reason is not None:
            self.hits_by_reason[reason] = self.hits_by_reason.get(reason, 0) + 1
        self.flops_saved += cost.prefill_flops(hit_tokens)
        by_turn = self.hit_tokens_by_turn.setdefault(request.turn, [0, 0])
        by_turn[0] += hit_tokens
        by_turn[1] += request.prompt_len


@dataclass(frozen=True)
class PolicyResult:
    """The simulator's report for one policy. `token_hit_rate` = hit tokens / prompt tokens (every
    completion counts its prompt); `bytes_peak` = the largest KV + checkpoint-state bytes held (for
    `oracle`: the KV of every distinct fed token; its states are not counted). `hits_by_reason`: the completions
    whose hit `hit_tokens` counts, by the reason of the checkpoint restored (one admitted with a hit and then run
    without the cache for want of room counts as a miss everywhere). Host tier: `host_blocks` (None: none), the
    hit tokens served from it (within `hit_tokens`), the bytes copied each way (demotions: device -> host,
    promotions: host -> device) and the promotions skipped as not worth their copy."""

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
    host_blocks: int | None = None
    host_hit_tokens: int = 0
    host_save_bytes: int = 0
    host_load_bytes: int = 0
    promotions_skipped: int = 0

    def to_json(self) -> dict:
        return asdict(self)


def policy_result(name: str, c: Counters, **extra) -> PolicyResult:
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
        return policy_result(self.spec.name, self.counters)


@dataclass
class _Seq:
    rid: Hashable
    output_ids: tuple[int, ...]
    cached_len: int
    branch_step: int | None
    computed: int
    hit_reason: str | None = None  # the reason of the checkpoint its hit restored
    host_hit_tokens: int = 0  # its hit tokens when that checkpoint came from the host tier


class CacheReplay:
    """A policy that drives a real `PrefixCache` (see the module docstring for the call sequence)."""

    admission: str | None = None  # the cache's admission policy; None: the cache mode's
    uses_host_tier = True  # `SimConfig.host_memory_bytes` applies (paged policies only)

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
        self.host_blocks = 0
        if spec.one_budget and self.uses_host_tier and config.host_memory_bytes:
            self.host_blocks = int(config.host_memory_bytes // cost.block_bytes(spec.block_size))
        check_simulable(self.num_blocks, self.host_blocks, spec)
        cost_model = replace(cost.cache_cost_model(), host_bandwidth=config.host_bandwidth,
                             device_flops=config.device_flops)
        self.cache = PrefixCache(
            CacheConfig(block_size=spec.block_size, num_blocks=self.num_blocks, num_slots=self.num_slots,
                        max_checkpoints_per_anchor=self.policy.max_checkpoints_per_anchor,
                        eviction=spec.eviction, full_prompt_hits=self.policy.full_prompt_hits,
                        admission=spec.admission or self.admission or self.policy.admission,
                        state_pages=self.state_pages, host_blocks=self.host_blocks,
                        min_branch_point_step=min_branch_point_step(cost_model, spec.block_size, self.state_pages)),
            cost_model,
        )
        self.counters = Counters()

    def _plan(self, seq: _Seq, prompt_len: int, budget: int | None = None):
        """The engine's plan of `seq`'s next prompt chunk under `budget` tokens (None: the whole chunk budget)."""
        budget = self.config.chunk_budget if budget is None else budget
        return plan_chunk(self.policy, start=seq.computed, num_tokens=prompt_len, budget=budget,
                          prompt_len=prompt_len, block_size=self.block_size, branch_step=seq.branch_step,
                          hit_len=seq.cached_len)

    def run(self, request: SimRequest, cache_requests: Sequence[CacheRequest] | None = None) -> None:
        """Replay `request`; `cache_requests[i]` (from `cache_requests_of`) is completion i's cache request,
        shared by every policy so that its block hashes are computed once. With n > 1, a policy that shares
        prompts in flight runs the engine's order (`_run_forked`); the others match and admit as many
        completions as fit before any is fed (`_run_wave`), then the rest when those are done."""
        if request.n > self.max_running:
            raise ValueError(f"request {request.request_id} has n={request.n} > max_running {self.max_running}")
        self.counters.num_requests += 1
        pending = list(enumerate(request.outputs()))
        if cache_requests is None:
            cache_requests = cache_requests_of(request)
        if self.policy.share_in_flight and request.n > 1:
            self._run_forked(request, pending, cache_requests)
            return
        while pending:
            wave = self._admit(request, pending, cache_requests)
            if not wave:  # not even one sequence fits next to nothing: computed without the cache
                pending.pop(0)
                self._uncacheable(request)
                continue
            pending = pending[len(wave):]
            self._run_wave(request, wave)

    def _run_forked(
        self, request: SimRequest, pending: list[tuple[int, tuple[int, ...]]], cache_requests: Sequence[CacheRequest],
    ) -> None:
        """The `n` completions of `request` in the engine's order when prompts are shared in flight
        (`scheduler/in_flight.py`, the scheduler's steps with one token budget per step, steps synchronous):

            step 0        completion 0 is admitted and plans its first chunk; the others wait for its prefill
            ...           completion 0 prefills its prompt (the last chunk saves the prompt end and samples)
            next step     completion 0 feeds its first output token, then the others are admitted: they hit
                          the whole prompt and only sample (when completion 0 hit it all, in step 0 already)
            then          all decode together, completion 0 one token ahead; each finishes (its finish
                          checkpoint) at the end of the step that sampled its last token, in batch order

        A completion with no room waits for one to finish; one that fits with nothing running only as a miss
        runs as one, one that fits not even then runs without the cache (`uncacheable`). Steps in which
        every running completion decodes and nothing can be admitted are fed in one commit up to the next
        finish or block fill (`_decode_together`)."""
        prompt_len = len(request.prompt_ids)
        waiting = list(pending)
        running: list[_Seq] = []
        num_sampled: dict[Hashable, int] = {}
        blocked = False  # a waiting completion found no room: only a finish (or a drop) makes room
        while running or waiting:
            before = [s.rid for s in running]
            if running and (blocked or not waiting) and len(running) <= self.config.chunk_budget and all(
                    s.computed >= prompt_len for s in running):
                stepped, fed = self._decode_together(request, running, num_sampled)
            else:
                stepped, fed, blocked = self._forked_step(request, running, waiting, num_sampled, cache_requests,
                                                          blocked)
            if fed:
                self._commit(fed)
            self._end_step(request, running, stepped, num_sampled)
            if len(before) > sum(s.rid in before for s in running):
                blocked = False  # a completion finished or was dropped: there may be room now
        if self.config.check_integrity:
            self.cache.check_integrity()

    def _forked_step(
        self, request: SimRequest, running: list[_Seq], waiting: list[tuple[int, tuple[int, ...]]],
        num_sampled: dict[Hashable, int], cache_requests: Sequence[CacheRequest], blocked: bool,
    ) -> tuple[list[_Seq], dict, bool]:
        """Plan one scheduler step of `_run_forked`: the running completions first (a prefill chunk or one decode
        token each, while the budget lasts), then the waiting ones in order while the budget lasts and none of
        the running ones is still prefilling its prompt (the scheduler's `find_leader`). Returns the completions
        that compute or sample in the step, their fed tokens, and whether admission found no room."""
        cache, prompt = self.cache, request.prompt_ids
        prompt_len = len(prompt)
        budget = self.config.chunk_budget
        stepped: list[_Seq] = []
        fed: dict = {}
        prefilling = any(s.computed < prompt_len for s in running)  # as the scheduler sees it: before this step
        for seq in list(running):
            if budget == 0:
                break
            if seq.computed < prompt_len:
                plan = self._plan(seq, prompt_len, budget)
                end, reason = plan.end, plan.reason
            else:
                end, reason = seq.computed + 1, None
            if not cache.ensure_capacity(seq.rid, end):
                self._drop(request, seq, running)
                continue
            self._feed(prompt, seq, end, reason, fed)
            budget = max(0, budget - (end - seq.computed))
            seq.computed = end
            stepped.append(seq)
        while waiting and budget > 0 and not blocked:
            index, output = waiting[0]
            rid = (request.request_id, index)
            if prefilling:  # it waits for the prompt being prefilled, unless its own hit covers the prompt
                match = cache.match(cache_requests[index])
                cache.release_match(match)
                if match.cached_len < prompt_len:
                    break
            seq = self._admit_one(cache_requests[index], rid, output, prompt_len, None, budget)
            if seq is None and not running:
                seq = self._admit_one(cache_requests[index], rid, output, prompt_len, 0, budget)
            if seq is None:
                if running:
                    blocked = True
                    break
                waiting.pop(0)
                self._uncacheable(request)
                continue
            waiting.pop(0)
            running.append(seq)
            num_sampled[rid] = 0
            prefilling = prefilling or seq.computed < prompt_len
            if seq.computed < prompt_len:
                plan = self._plan(seq, prompt_len, budget)
                self._feed(prompt, seq, plan.end, plan.reason, fed)
                budget = max(0, budget - (plan.end - seq.computed))
                seq.computed = plan.end
            stepped.append(seq)
        return stepped, fed, blocked

    def _decode_together(
        self, request: SimRequest, running: list[_Seq], num_sampled: dict[Hashable, int],
    ) -> tuple[list[_Seq], dict]:
        """Every running completion decodes up to the step in which the first of them samples its last token or
        fills a block: the steps' tokens in one commit. The same as one commit per step, since blocks are taken
        only in a segment's first step and fill (joining the trie, where a completion's block that repeats
        another's is swapped for it and freed) only in its last. Returns the completions fed and their tokens."""
        prompt_len, size = len(request.prompt_ids), self.block_size
        steps = min(min(len(s.output_ids) - num_sampled[s.rid], size - s.computed % size) for s in running)
        stepped, fed = [], {}
        for seq in list(running):
            end = seq.computed + steps
            if not self.cache.ensure_capacity(seq.rid, end):
                self._drop(request, seq, running)
                continue
            fed[seq.rid] = seq.output_ids[seq.computed - prompt_len:end - prompt_len]
            num_sampled[seq.rid] += steps - 1  # the last step's sample is counted by `_end_step`
            seq.computed = end
            stepped.append(seq)
        return stepped, fed

    def _end_step(
        self, request: SimRequest, running: list[_Seq], stepped: list[_Seq], num_sampled: dict[Hashable, int],
    ) -> None:
        """After a step's commit: the stepped completions whose computed tokens reach their last known token
        sampled one; those that sampled their whole output finish, in batch order."""
        prompt_len = len(request.prompt_ids)
        done = []
        for seq in stepped:
            if seq.computed == prompt_len + num_sampled[seq.rid]:
                num_sampled[seq.rid] += 1
                if num_sampled[seq.rid] == len(seq.output_ids):
                    done.append(seq)
        if done:
            self._sample_memory()
        for seq in done:
            running.remove(seq)
            self._finish(request, seq)

    def _feed(self, prompt: tuple[int, ...], seq: _Seq, end: int, reason, fed: dict) -> None:
        """Plan `seq`'s tokens [computed, end) into `fed` (reserving the chunk's save, if any, as the scheduler)."""
        if reason is not None and self._wants_save(prompt, end):
            self.cache.reserve_save(seq.rid, end, reason)
        start, prompt_len = seq.computed, len(prompt)
        if end <= prompt_len:
            fed[seq.rid] = prompt[start:end]
        else:
            fed[seq.rid] = prompt[start:] + seq.output_ids[max(0, start - prompt_len):end - prompt_len]

    def _admit(
        self, request: SimRequest, pending: list[tuple[int, tuple[int, ...]]], cache_requests: Sequence[CacheRequest],
    ) -> list[_Seq]:
        prompt = request.prompt_ids
        wave: list[_Seq] = []
        for index, output in pending:
            rid = (request.request_id, index)
            seq = self._admit_one(cache_requests[index], rid, output, len(prompt), None, self.config.chunk_budget)
            if seq is None and not wave:  # a hit can need a block more than a miss (as the scheduler does)
                seq = self._admit_one(cache_requests[index], rid, output, len(prompt), 0, self.config.chunk_budget)
            if seq is None:
                break
            wave.append(seq)
        return wave

    def _admit_one(self, request: CacheRequest, rid: Hashable, output: tuple[int, ...], prompt_len: int,
                   max_step: int | None, budget: int) -> _Seq | None:
        """Match (at most `max_step`) and admit with room for the first chunk under `budget`; None (the match
        released, nothing changed) when there is no room."""
        match = self.cache.match(request, max_step)
        branch = match.divergence_len
        branch = branch if branch > match.cached_len and self.cache.saves_branch_point(branch) else None
        reason = None if match.checkpoint_reason is None else match.checkpoint_reason.value
        seq = _Seq(rid, output, match.cached_len, branch, match.cached_len, reason)
        host_before = self.cache.stats.num_host_hit_tokens if self.host_blocks else 0
        if self.cache.admit(match, self._plan(seq, prompt_len, budget).end) is None:
            self.cache.release_match(match)
            return None
        if self.host_blocks:
            seq.host_hit_tokens = self.cache.stats.num_host_hit_tokens - host_before
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
                self._commit(fed)
        decode = {}
        for seq in list(active):
            if len(seq.output_ids) > 1:
                if not cache.ensure_capacity(seq.rid, prompt_len + len(seq.output_ids) - 1):
                    self._drop(request, seq, active)
                    continue
                decode[seq.rid] = seq.output_ids[:-1]
        if decode:
            self._commit(decode)
        self._sample_memory()
        for seq in active:
            self._finish(request, seq)
        if self.config.check_integrity:
            cache.check_integrity()

    def _finish(self, request: SimRequest, seq: _Seq) -> None:
        """`seq` sampled its last token: it leaves a finish checkpoint (policies that save one) or nothing."""
        fed = request.prompt_ids + seq.output_ids[:-1]
        if self.policy.finish and self._wants_save(fed, len(fed)):
            self.cache.finish(seq.rid)
        else:
            self.cache.abort(seq.rid)
        self.counters.add(request, seq.cached_len, self.cost, seq.hit_reason, seq.host_hit_tokens)

    def _uncacheable(self, request: SimRequest) -> None:
        """A completion that fits not even next to nothing: computed without the cache."""
        self.counters.num_uncacheable += 1
        self.counters.add(request, 0, self.cost)

    def _commit(self, fed: dict) -> None:
        """`commit_step`, counting the host tier's copies (blocks each way)."""
        plan = self.cache.commit_step(fed)
        if self.host_blocks:
            self.counters.host_save_blocks += len(plan.pairs(CopyKind.HOST_SAVE))
            self.counters.host_load_blocks += len(plan.pairs(CopyKind.HOST_LOAD))

    def _wants_save(self, tokens: tuple[int, ...], step: int) -> bool:
        """Whether to save the state of `tokens[:step]` when the policy plans a save (all: the cache's own
        admission decides; the bounded oracle looks ahead)."""
        return True

    def _drop(self, request: SimRequest, seq: _Seq, active: list[_Seq]) -> None:
        """No room for the sequence's next blocks even after eviction: it runs without the cache."""
        self.cache.abort(seq.rid)
        active.remove(seq)
        self._uncacheable(request)

    def _sample_memory(self) -> None:
        stats = self.cache.stats
        held = stats.num_blocks_used * self.cost.block_bytes(self.block_size)  # paged: states' pages included
        if self.state_pages is None:
            held += (stats.num_slots_used - stats.num_running) * self.cost.state_bytes
        self.counters.bytes_peak = max(self.counters.bytes_peak, held)

    def result(self) -> PolicyResult:
        stats = self.cache.stats
        return policy_result(
            self.spec.name, self.counters,
            checkpoints_saved=sum(stats.saves_by_reason.values()),
            evictions=sum(stats.evictions_by_kind.values()),
            num_blocks=self.num_blocks, num_slots=self.num_slots, state_pages=self.state_pages,
            hits_by_reason=dict(self.counters.hits_by_reason), evictions_by_kind=dict(stats.evictions_by_kind),
            host_blocks=self.host_blocks or None, host_hit_tokens=self.counters.host_hit_tokens,
            host_save_bytes=self.counters.host_save_blocks * self.cost.block_bytes(self.block_size),
            host_load_bytes=self.counters.host_load_blocks * self.cost.block_bytes(self.block_size),
            promotions_skipped=stats.num_promotions_skipped,
        )


def check_simulable(num_blocks: int, host_blocks: int, spec: PolicySpec) -> None:
    """A ValueError when a cache of `num_blocks` device and `host_blocks` host blocks is beyond what the simulator
    holds (`MAX_SIM_BLOCKS`: its pools keep a list entry per block; 2^26 blocks are 4 TiB of 64 KiB blocks)."""
    for what, count in (("--memory-gib", num_blocks), ("--host-memory-gib", host_blocks)):
        if count > MAX_SIM_BLOCKS:
            raise ValueError(f"{what} makes {count:,} blocks of {spec.block_size} tokens; the simulator "
                             f"holds at most {MAX_SIM_BLOCKS:,} (a list entry per block): give less memory or a "
                             "larger block size")


def min_branch_point_step(cost: CostModel, block_size: int, state_pages: int | None) -> int:
    """The shortest branch point worth a checkpoint, as the engine sets it (`engine._make_scheduler`:
    `CostModel.state_tokens` of the engine's cost model, whose state bytes are the k pages a paged state occupies):
    k x B tokens when paged, else the tokens whose KV takes as many bytes as one state."""
    return state_pages * block_size if state_pages else cost.state_tokens


def cache_requests_of(request: SimRequest) -> list[CacheRequest]:
    """The cache's view of each completion of `request` (request id `(request_id, i)`)."""
    return [CacheRequest((request.request_id, i), request.prompt_ids) for i in range(request.n)]


