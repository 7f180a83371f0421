"""Routing rules for a hybrid model's replicas, side by side in the simulator (issue 33: the checkpoint router
against kv-prefix on Mooncake).

Every rule runs N replicas of the `hybridcache` policy (bench/routing.py: same budgets, balance margins 4 and
1.2x, cache threshold 0.3 of the prompt) and prints the token hit rate and max / mean requests per replica:

    kv-prefix       the most of the prompt's KV (bench/routing.py, the router's rule)
    usable-only     the longest usable hit: KV and a state at that step; when none passes the threshold, the
                    least loaded (the checkpoint router's rule before issue 33's study)
    follow-kv       usable-only; when no replica's usable hit passes the threshold, the replica with the most of
                    the prompt's KV (threshold and balance as above), else the least loaded
    checkpoint      follow-kv, only where that KV is at least half of the stored chain it matches (the deepest
                    branch under its last matched block, `bench.routing.chain_len`): a later turn of the
                    conversation held there, not a sibling of a longer one that shares its prefix (the router's
                    rule, router/policy.py)
    follow-kv-most  follow-kv, only where that KV covers at least 0.75 of the prompt (a KV-only match counted at
                    0.4 of its length against the same threshold)
    NAME~S          NAME with every tie (equal scores, equal loads) broken at random (seed S) instead of toward
                    the lowest replica index: a change of no meaning, whose spread over seeds measures how far
                    arbitrary decisions move the result

    OMP_NUM_THREADS=1 nice -n 10 python benchmarks/routing_rules.py --workload mooncake --replicas 4 \
        --memory-gib 0.5 [--trace FULL --skip 4000 --num-requests 2000] [--rules ...] [--json out.json]

`--skip K` drops the first K lines of a Mooncake trace (a held-out slice: the requests after those the rules
were looked at on).
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from itertools import islice
from pathlib import Path

from hybridcache.bench.replay import CacheReplay
from hybridcache.bench.routing import Balance, Router, chain_len, simulate_routing
from hybridcache.bench.simulator import GIB
from hybridcache.bench.specs import SimConfig
from hybridcache.bench.workloads import default_trace_path, load_workload
from hybridcache.bench.workloads.base import SimRequest
from hybridcache.cache.request import CacheRequest
from hybridcache.engine.cost_model import load_model_cost
from hybridcache.router.policy import CHAIN_SHARE

RULES = ("kv-prefix", "usable-only", "follow-kv", "checkpoint", "follow-kv-most")
MOST_OF_PROMPT = 0.75  # follow-kv-most: the KV covers at least this share of the prompt


class RuleRouter(Router):
    """`Router` with the rules of the module docstring (`NAME~S`: ties broken at random, seed S)."""

    def __init__(self, rule: str, replicas: list[CacheReplay], balance: Balance) -> None:
        self.rule, _, seed = rule.partition("~")
        if self.rule not in RULES or (seed and not seed.isdigit()):
            raise ValueError(f"unknown rule {rule!r}; choose from {', '.join(RULES)} (NAME~SEED: random ties)")
        self.random = random.Random(int(seed)) if seed else None
        super().__init__("checkpoint", replicas, balance)

    def pick(self, request: SimRequest, cache_request: CacheRequest) -> int:
        n, loads = len(self.replicas), self.loads
        order = list(range(n))  # the tie-break: lowest first, or a random order
        if self.random is not None:
            self.random.shuffle(order)
        rank = {r: i for i, r in enumerate(order)}
        least = min(range(n), key=lambda r: (loads[r], rank[r]))
        probes = [replica.cache.probe(cache_request) for replica in self.replicas]
        threshold = self.balance.min_hit_fraction * cache_request.prompt_len

        def best(scores: list[int], minimum: float) -> int | None:
            choice = max(range(n), key=lambda r: (scores[r], -loads[r], -rank[r]))
            if scores[choice] == 0 or scores[choice] < minimum:
                return None
            return None if self.balance.too_loaded(loads[choice], loads[least]) else choice

        kv = [p.kv_len for p in probes]
        if self.rule == "kv-prefix":
            choice = best(kv, threshold)
        else:
            choice = best([p.cached_len for p in probes], threshold)
            if choice is None and self.rule == "follow-kv-most":
                choice = best(kv, max(threshold, MOST_OF_PROMPT * cache_request.prompt_len))
            elif choice is None and self.rule != "usable-only":
                choice = best(kv, threshold)
                if choice is not None and self.rule == "checkpoint":
                    limit = int(kv[choice] / CHAIN_SHARE) + 1
                    chain = chain_len(self.replicas[choice].cache, cache_request, limit)
                    choice = choice if kv[choice] >= CHAIN_SHARE * chain else None
        choice = least if choice is None else choice
        loads[choice] += 1
        return choice


def skipped_trace(path: Path, skip: int, folder: str) -> Path:
    """A copy of the trace without its first `skip` lines (the loader then cuts `--num-requests`)."""
    out = Path(folder) / f"{path.stem}-from-{skip}{path.suffix}"
    with open(path, encoding="utf-8") as src, open(out, "w", encoding="utf-8") as dst:
        dst.writelines(islice(src, skip, None))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", required=True, choices=("swe-agent", "sharegpt", "mooncake"))
    parser.add_argument("--trace", default=None)
    parser.add_argument("--skip", type=int, default=0, help="mooncake: drop the trace's first SKIP requests")
    parser.add_argument("--num-requests", type=int, default=None)
    parser.add_argument("--replicas", type=int, required=True)
    parser.add_argument("--memory-gib", type=float, required=True, help="each replica's cache")
    parser.add_argument("--rules", default=",".join(RULES))
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rules = [r.strip() for r in args.rules.split(",") if r.strip()]
    cost = load_model_cost(None, "auto")
    config = SimConfig(int(args.memory_gib * GIB))
    with tempfile.TemporaryDirectory() as folder:
        trace = args.trace
        if args.skip:
            if args.workload != "mooncake":
                raise SystemExit("--skip applies to the mooncake trace only")
            trace = str(skipped_trace(Path(trace or default_trace_path("mooncake")), args.skip, folder))
        workload = load_workload(args.workload, trace=trace, num_requests=args.num_requests)
        start = time.monotonic()
        results = simulate_routing(workload, rules, args.replicas, cost, config, make_router=RuleRouter)
    row = {"workload": args.workload, "skip": args.skip, "requests": len(workload), "replicas": args.replicas,
           "memory_gib": args.memory_gib, "seconds": round(time.monotonic() - start, 1),
           "hit_rate": {r: round(x.token_hit_rate, 4) for r, x in results.items()},
           "max_over_mean": {r: round(x.max_over_mean, 3) for r, x in results.items()}}
    print(json.dumps(row))
    if args.json:
        Path(args.json).write_text(json.dumps(row, indent=2))


if __name__ == "__main__":
    main()
