"""The replays that drive a real `PrefixCache` (`CacheReplay`) or none (`NoCacheReplay`) for one policy;
`simulator.py` feeds them a workload (its docstring has the call sequence). specs.py holds the policy specs and
budgets, results.py what a replay counts and reports, forked.py the n > 1 completions of the policies that share
prompts in flight, oracles.py the replays that know more than a cache can.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, replace

from hybridcache.bench.forked import ForkedRun
from hybridcache.bench.results import Counters, PolicyResult, policy_result
from hybridcache.bench.specs import PolicySpec, SimConfig, cache_sizing, check_simulable
from hybridcache.bench.workloads import SimRequest
from hybridcache.cache import CacheConfig, CacheRequest, CopyKind, CostModel, PrefixCache
from hybridcache.engine.cost_model import ModelCost
from hybridcache.engine.memory import state_pages
from hybridcache.scheduler.save_plan import CheckpointPolicy, checkpoint_policy, plan_chunk


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
class ReplaySeq:
    """One completion on a `CacheReplay`'s cache: its cache request id, its output, the hit it was admitted with
    (`cached_len`, the checkpoint's reason, the host tier's part), the branch point it saves (None: none) and the
    tokens it has `computed` (fed) so far."""

    rid: Hashable
    output_ids: tuple[int, ...]
    cached_len: int
    branch_step: int | None
    computed: int
    hit_reason: str | None = None  # the reason of the checkpoint its hit restored
    host_hit_tokens: int = 0  # its hit tokens when that checkpoint came from the host tier


class CacheReplay:
    """A policy that drives a real `PrefixCache` (simulator.py's docstring has the call sequence)."""

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
        if spec.one_budget:  # a state's bytes are its k pages, as the engine's cost model (`engine_cost_model`)
            cost_model = replace(cost_model, state_bytes=float(self.state_pages * block_bytes))
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

    def _plan(self, seq: ReplaySeq, prompt_len: int, budget: int | None = None):
        """The engine's plan of `seq`'s next prompt chunk under `budget` tokens (None: the whole chunk budget)."""
        budget = self.config.chunk_budget if budget is None else budget
        return plan_chunk(self.policy, start=seq.computed, num_tokens=prompt_len, budget=budget,
                          prompt_len=prompt_len, block_size=self.block_size, branch_step=seq.branch_step,
                          hit_len=seq.cached_len)

    def run(self, request: SimRequest, cache_requests: Sequence[CacheRequest] | None = None) -> None:
        """Replay `request`; `cache_requests[i]` (from `cache_requests_of`) is completion i's cache request,
        shared by every policy so that its block hashes are computed once. With n > 1, a policy that shares
        prompts in flight runs the engine's order (forked.py's `ForkedRun`); the others match and admit as many
        completions as fit before any is fed (`_run_wave`), then the rest when those are done."""
        if request.n > self.max_running:
            raise ValueError(f"request {request.request_id} has n={request.n} > max_running {self.max_running}")
        self.counters.num_requests += 1
        if cache_requests is None:
            cache_requests = cache_requests_of(request)
        if self.policy.share_in_flight and request.n > 1:
            ForkedRun(self, request, cache_requests).run()
            return
        pending = list(enumerate(request.outputs()))
        while pending:
            wave = self._admit(request, pending, cache_requests)
            if not wave:  # not even one sequence fits next to nothing: computed without the cache
                pending.pop(0)
                self._uncacheable(request)
                continue
            pending = pending[len(wave):]
            self._run_wave(request, wave)

    def _feed(self, prompt: tuple[int, ...], seq: ReplaySeq, end: int, reason, fed: dict) -> int:
        """Plan `seq`'s tokens [computed, end) into `fed` (reserving the chunk's save for `reason`, if any, as the
        scheduler) and advance `seq.computed` to `end`; returns the number of tokens planned."""
        if reason is not None and self._wants_save(prompt, end):
            self.cache.reserve_save(seq.rid, end, reason)
        start, prompt_len = seq.computed, len(prompt)
        if end <= prompt_len:
            fed[seq.rid] = prompt[start:end]
        else:
            fed[seq.rid] = prompt[start:] + seq.output_ids[max(0, start - prompt_len):end - prompt_len]
        seq.computed = end
        return end - start

    def _admit(
        self, request: SimRequest, pending: list[tuple[int, tuple[int, ...]]], cache_requests: Sequence[CacheRequest],
    ) -> list[ReplaySeq]:
        """Admit the `pending` completions in order while they fit (the first, if none fits with its hit, as a
        miss); returns those admitted (none: not even the first fits)."""
        prompt = request.prompt_ids
        wave: list[ReplaySeq] = []
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
                   max_step: int | None, budget: int) -> ReplaySeq | None:
        """Match (at most `max_step`) and admit with room for the first chunk under `budget`; None (the match
        released, nothing changed) when there is no room."""
        match = self.cache.match(request, max_step)
        branch = match.divergence_len
        worth = self.cache.saves_branch_point(branch, match.divergence_count)
        branch = branch if branch > match.cached_len and worth else None
        reason = None if match.checkpoint_reason is None else match.checkpoint_reason.value
        seq = ReplaySeq(rid, output, match.cached_len, branch, match.cached_len, reason)
        host_before = self.cache.stats.num_host_hit_tokens if self.host_blocks else 0
        if self.cache.admit(match, self._plan(seq, prompt_len, budget).end) is None:
            self.cache.release_match(match)
            return None
        if self.host_blocks:
            seq.host_hit_tokens = self.cache.stats.num_host_hit_tokens - host_before
        return seq

    def _run_wave(self, request: SimRequest, wave: list[ReplaySeq]) -> None:
        """Prefill the admitted `wave` in chunks side by side, then feed each one's output but its last token in
        one commit, then finish all of them."""
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
                self._feed(prompt, seq, plan.end, plan.reason, fed)
            if fed:
                self._commit(fed)
        decode = {}
        for seq in list(active):
            if len(seq.output_ids) > 1:
                if not cache.ensure_capacity(seq.rid, prompt_len + len(seq.output_ids) - 1):
                    self._drop(request, seq, active)
                    continue
                decode[seq.rid] = seq.output_ids[:-1]
        if decode or any(s.cached_len >= prompt_len for s in active):  # a zero-prefill hit's restore: one step
            self._commit(decode)
        self._sample_memory()
        for seq in active:
            self._finish(request, seq)
        if self.config.check_integrity:
            cache.check_integrity()

    def _finish(self, request: SimRequest, seq: ReplaySeq) -> None:
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

    def _drop(self, request: SimRequest, seq: ReplaySeq, active: list[ReplaySeq]) -> None:
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


def min_branch_point_step(cost: CostModel, block_size: int, state_pages: int | None) -> int:
    """The prefill a branch point must have saved the prompts seen leaving there (step x count, see
    `PrefixCache.saves_branch_point`) to be worth a checkpoint, as the engine sets it (`engine._make_scheduler`:
    `CostModel.state_tokens` of the engine's cost model, whose state bytes are the k pages a paged state occupies):
    k x B tokens when paged, else the tokens whose KV takes as many bytes as one state."""
    return state_pages * block_size if state_pages else cost.state_tokens


def cache_requests_of(request: SimRequest) -> list[CacheRequest]:
    """The cache's view of each completion of `request` (request id `(request_id, i)`)."""
    return [CacheRequest((request.request_id, i), request.prompt_ids) for i in range(request.n)]


