"""Many replicas behind a router, simulated: `hybridcache simulate --replicas N --routing POLICIES`.

Each replica is a `CacheReplay` of the `hybridcache` policy with its own budget (`--memory-gib` each). A
routing policy picks the replica of every request, in arrival order, one request at a time:

    round-robin   request i -> replica i mod N
    session       a session's first request -> the replica with the fewest requests so far; the rest follow it
    kv-prefix     the replica holding the most of the prompt's full KV blocks (`PrefixCache.probe().kv_len`),
                  what a KV-only prefix router can know at best
    checkpoint    the replica with the longest usable hit: KV *and* a state at that step (`probe().cached_len`),
                  what hybridcache's router predicts from cache events; when no replica has one, the replica
                  holding the most of the prompt's KV if that KV is most of the stored chain it matches
                  (`chain_len`: a later turn of the conversation stored there)

kv-prefix and checkpoint are the HTTP router's own rule (router/policy.py `Chooser`), after SGLang's
cache-aware router: the best replica is taken when its score covers at least `min_hit_fraction` of the prompt
(SGLang's cache threshold) and it has no more than `abs_margin` requests more than the least-loaded one or no
more than `rel_margin` times as many (its balance thresholds); otherwise the least-loaded one is, among equals
the one whose trie holds the fewest blocks (SGLang's smallest tree), then the lowest index. (Without the
threshold, a few tokens of a shared chat template pull every new conversation to one replica, and the balance
rule then pushes the continuing ones away from their checkpoints.)
Load here is the number of requests routed so far (requests are replayed one at a time, so nothing is in
flight); `max_over_mean` is the largest replica's count over the mean.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

from hybridcache.bench.replay import CacheReplay, cache_requests_of
from hybridcache.bench.specs import PolicySpec, SimConfig, parse_policies
from hybridcache.bench.workloads import SimRequest, Workload
from hybridcache.cache import PrefixCache
from hybridcache.cache.matching import walk_prompt
from hybridcache.cache.request import CacheRequest
from hybridcache.engine.cost_model import ModelCost
from hybridcache.router.index import MAX_CHAIN_NODES
from hybridcache.router.policy import Chooser, RoutingConfig

ROUTING_POLICIES = ("round-robin", "session", "kv-prefix", "checkpoint")


@dataclass(frozen=True)
class Balance:
    """When a prefix-aware router gives up the best replica for the least-loaded one (module docstring)."""

    abs_margin: int = 4
    rel_margin: float = 1.2
    min_hit_fraction: float = 0.3

    def too_loaded(self, load: int, least: int) -> bool:
        return load - least > self.abs_margin and load > self.rel_margin * least


@dataclass(frozen=True)
class RoutingResult:
    """One routing policy over N replicas: the token hit rate over all of them (hit / prompt tokens), the
    requests each replica got, max / mean of those, and each replica's own hit rate."""

    routing: str
    num_replicas: int
    token_hit_rate: float
    hit_tokens: int
    prompt_tokens: int
    requests_per_replica: tuple[int, ...]
    max_over_mean: float
    hit_rate_per_replica: tuple[float, ...]

    def to_json(self) -> dict:
        return asdict(self)


class Router:
    """Picks a replica for each request under one policy; `loads[r]` counts what replica r got."""

    def __init__(self, policy: str, replicas: list[CacheReplay], balance: Balance) -> None:
        if policy not in ROUTING_POLICIES:
            raise ValueError(f"unknown routing policy {policy!r}; choose from {', '.join(ROUTING_POLICIES)}")
        self.policy, self.replicas, self.balance = policy, replicas, balance
        self.loads = [0] * len(replicas)
        self.chooser = Chooser(RoutingConfig(policy if policy in ("kv-prefix", "checkpoint") else "checkpoint",
                                             balance.abs_margin, balance.rel_margin, balance.min_hit_fraction))
        self.sessions: dict[str, int] = {}
        self.next = 0

    def pick(self, request: SimRequest, cache_request) -> int:
        n = len(self.replicas)
        least = min(range(n), key=lambda r: (self.loads[r], r))
        if self.policy == "round-robin":
            choice = self.next % n
            self.next += 1
        elif self.policy == "session":
            choice = self.sessions.setdefault(request.session_id or request.request_id, least)
        else:
            probes = [replica.cache.probe(cache_request) for replica in self.replicas]
            choice = self.chooser.choose(probes, self.loads, cache_request.prompt_len,
                                         lambda i, limit: chain_len(self.replicas[i].cache, cache_request, limit),
                                         [replica.cache._trie.num_nodes for replica in self.replicas])
        self.loads[choice] += 1
        return choice


def chain_len(cache: PrefixCache, request: CacheRequest, limit: int) -> int:
    """What `ReplicaIndex.chain_len` answers from this cache's events: tokens from the start to the deepest block
    of the trie under the prompt's last matched full block (0 when none matches), up to `limit` (the walk stops
    past it, or after `MAX_CHAIN_NODES` blocks, and then answers `limit`)."""
    path = walk_prompt(cache._trie, request, cache.block_size)
    if len(path) < 2:
        return 0
    size = cache.block_size
    deepest, stack, visited = path[-1].depth, [path[-1]], 0
    while stack:
        visited += 1
        if deepest * size > limit or visited > MAX_CHAIN_NODES:
            return limit
        for children in stack.pop().children.values():
            for child in children:
                deepest = max(deepest, child.depth)
                stack.append(child)
    return min(deepest * size, limit)


def simulate_routing(
    workload: Workload, policies: list[str], num_replicas: int, cost: ModelCost, config: SimConfig,
    balance: Balance = Balance(), spec: PolicySpec | None = None,
    on_request: Callable[[int], None] | None = None,
    make_router: Callable[[str, list[CacheReplay], Balance], Router] = Router,
) -> dict[str, RoutingResult]:
    """Replay `workload` once through N replicas per routing policy (each replica: `spec`, default the
    `hybridcache` policy at `config.block_size`, with `config.memory_bytes`); results by policy name.
    `make_router(policy, replicas, balance)`: the router of each policy (benchmarks/routing_rules.py passes
    variants of these rules)."""
    if num_replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {num_replicas}")
    if not policies:
        raise ValueError(f"no routing policy given; choose from {', '.join(ROUTING_POLICIES)}")
    spec = spec or parse_policies("hybridcache", config.block_size)[0]
    requests = list(workload)
    max_running = max((r.n for r in requests), default=1)
    fleets = {p: [CacheReplay(spec, cost, config, max_running) for _ in range(num_replicas)] for p in policies}
    routers = {p: make_router(p, fleet, balance) for p, fleet in fleets.items()}
    for i, request in enumerate(requests):
        shared = cache_requests_of(request)
        for policy, router in routers.items():
            fleets[policy][router.pick(request, shared[0])].run(request, shared)
        if on_request is not None:
            on_request(i)
    results = {}
    for policy, fleet in fleets.items():
        counters = [replica.counters for replica in fleet]
        hit = sum(c.hit_tokens for c in counters)
        prompt = sum(c.prompt_tokens for c in counters)
        loads = routers[policy].loads
        mean = sum(loads) / len(loads)
        results[policy] = RoutingResult(
            routing=policy, num_replicas=num_replicas, token_hit_rate=hit / prompt if prompt else 0.0,
            hit_tokens=hit, prompt_tokens=prompt, requests_per_replica=tuple(loads),
            max_over_mean=max(loads) / mean if mean else 1.0,
            hit_rate_per_replica=tuple(c.hit_tokens / c.prompt_tokens if c.prompt_tokens else 0.0 for c in counters),
        )
    return results


def format_routing_table(workload: str, results: dict[str, RoutingResult], memory_gib: float) -> str:
    first = next(iter(results.values()))
    lines = [f"workload {workload}: {first.num_replicas} replicas x {memory_gib:.3g} GiB",
             f"{'routing':<14}{'hit rate':>9}{'max/mean load':>15}  requests per replica"]
    for name, r in results.items():
        lines.append(f"{name:<14}{r.token_hit_rate:>9.3f}{r.max_over_mean:>15.2f}  "
                     f"{','.join(str(x) for x in r.requests_per_replica)}")
    return "\n".join(lines)
