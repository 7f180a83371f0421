"""The cache simulator (`hybridcache simulate`): replays a workload through the real `PrefixCache` (the code
the engine runs, no model) under several policies side by side, and counts what each one saves. This file
feeds the workload and collects results; replay.py drives the cache for one policy, oracles.py the yardsticks.

Per request and policy (`CacheReplay.run`)::

    m = cache.match(CacheRequest(rid, prompt))        branch = m.divergence_len when > m.cached_len and
                                                       divergence_len x divergence_count (the cached continuations
                                                       leaving the prompt there) >= min_branch_point_step (as the
                                                       engine: k x B tokens; `PrefixCache.saves_branch_point`)
    plan = plan_chunk(policy, start=m.cached_len, ...) the engine's own chunk/save planner (save_plan.py)
    cache.admit(m, plan.end)                           None: no room even after eviction -> uncacheable
    repeat until the prompt is fed:
        cache.ensure_capacity(rid, plan.end); cache.reserve_save(rid, plan.end, plan.reason)
        cache.commit_step({rid: prompt[start:plan.end]}); plan = plan_chunk(...)
    cache.commit_step({rid: output[:-1]})              all decode tokens but the last in one commit
    cache.finish(rid) if policy.finish else cache.abort(rid)

The `n` > 1 completions of one request (forked.py's `ForkedRun`, the policies that share prompts in flight,
as the engine's scheduler does): completion 0 prefills alone, the others wait for it, then hit its whole prompt
(sample only) and decode beside it one token behind; each finishes in the step that samples its last token.
Policies that do not share in flight (`block-aligned`, `seed`) match and admit all of them before any is fed.

Simplifications (documented in docs/bench.md):
- Requests are simulated one at a time in arrival order, even when they overlap in time.
- Decode tokens are fed in one commit (n > 1: one per run of steps up to the next finish or block fill):
  with decode checkpoints off (the default) only the blocks they fill and the finish step matter to the
  cache, and both are the same as one commit per token.
- Each sequence gets the whole chunk budget (`chunk_budget`, 8192 tokens by default); n > 1 completions
  that share in flight share it per step, as the engine's do.

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
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from hybridcache.bench.oracles import FUTURE_POLICIES, BoundedOracleReplay, FutureIndex, OracleReplay
from hybridcache.bench.replay import CacheReplay, NoCacheReplay, cache_requests_of
from hybridcache.bench.results import PolicyResult
from hybridcache.bench.specs import DEFAULT_POLICIES, GIB, POLICY_NAMES, PolicySpec, SimConfig, parse_policies
from hybridcache.bench.workloads import SimRequest, Workload
from hybridcache.engine.cost_model import ModelCost

__all__ = ["DEFAULT_POLICIES", "GIB", "POLICY_NAMES", "SimConfig", "SimResult", "make_replay", "parse_policies",
           "prepare_oracles", "simulate", "simulate_many"]

Replay = NoCacheReplay | OracleReplay | CacheReplay


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
    if spec.base in FUTURE_POLICIES:
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
    if any(isinstance(r, BoundedOracleReplay) for r in replays):  # the oracles see the whole workload
        stream = list(stream)
        prepare_oracles(replays, stream)
    with _cyclic_gc_paused():
        count = 0 if first is None else _replay_all(stream, replays, max_running, on_request)
    return [r.result() for r in replays], count


def prepare_oracles(replays: Iterable[Replay], requests: Sequence[SimRequest]) -> None:
    """Give every bounded or reuse oracle among `replays` the whole workload: one `FutureIndex` per block size,
    shared (it is read-only; building it hashes every prompt)."""
    futures: dict[int, FutureIndex] = {}
    for replay in replays:
        if isinstance(replay, BoundedOracleReplay):
            future = futures.get(replay.block_size)
            if future is None:
                future = futures[replay.block_size] = FutureIndex(requests, replay.block_size)
            replay.prepare(future)


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
    once per simulated request of any job (polled from a shared counter), for a progress bar. A ValueError in a
    worker is raised here as a ValueError with its message, after the names of the group's policies; any other
    error as a RuntimeError from it."""
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

    try:
        while running:
            try:
                g, result = done.get(timeout=0.2)
            except queue_module.Empty:
                seen = _report(counter, seen, on_request)
                for g, proc in running.items():
                    if proc.exitcode not in (None, 0):
                        raise RuntimeError(f"simulating {names(g)} died (exit code {proc.exitcode})") from None
                ended = [g for g, proc in running.items() if proc.exitcode == 0]
                if not ended:
                    continue
                try:  # a worker's result is in the pipe before it exits: one that ended without it never sends it
                    g, result = done.get(timeout=1.0)
                except queue_module.Empty:  # (the queue drops what it cannot pickle: the wait would never end)
                    raise RuntimeError(f"simulating {names(ended[0])} ended without sending its result") from None
            if isinstance(result, ValueError):  # a bad input: the same error as in one process, naming the policies
                raise ValueError(f"simulating {names(g)}: {result}") from result
            if isinstance(result, BaseException):
                raise RuntimeError(f"simulating {names(g)} failed") from result
            results.update(zip(groups[g], result, strict=True))
            running.pop(g).join()
    finally:
        for proc in running.values():  # (an error above: no worker is left behind)
            proc.terminate()
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
    value = counter.get_obj().value  # (no lock: a worker that died holding it would block the parent for good)
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

