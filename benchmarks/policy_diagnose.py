"""What `hybridcache` and the `bounded-oracle` hold and hit, side by side (issue 12's gap under pressure).

Replays one workload through both policies at one budget (the simulator's own replays, one rendering) and
prints, per policy: hits and hit tokens by save reason, saves by reason, evictions by kind, the average
bytes held in KV blocks and in checkpoint states (sampled after every request), and the checkpoints
released before any hit, by reason. Then, for every request where the oracle skipped more tokens than
`hybridcache`, what `hybridcache` had at that moment, judged from its match:
  no_content      nothing of the prompt past its own hit (divergence <= its cached length)
  kv_no_state     its trie/tails agree with the prompt at least as far as the oracle's hit, but no
                  checkpoint there (the KV is there, the state is not)
  partial_content it agrees with the prompt past its hit but less far than the oracle's hit
each split by whether it still hit something shallower (`shallower`) or nothing (`miss`).

    OMP_NUM_THREADS=1 nice -n 10 python benchmarks/policy_diagnose.py --workload mooncake \
        --trace /path/to/mooncake/conversation_trace.jsonl --num-requests 1500 --memory-gib 1 [--json out.json]

`--reuse` prints only the reuse distances of a Mooncake trace (`mooncake_reuse`), from its hash ids.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter

from hybridcache.bench.replay import CacheReplay, cache_requests_of
from hybridcache.bench.simulator import GIB, SimConfig, _cyclic_gc_paused, make_replay, parse_policies, prepare_oracles
from hybridcache.bench.workloads import load_workload
from hybridcache.bench.workloads.base import SimRequest
from hybridcache.bench.workloads.mooncake import MOONCAKE_BLOCK_LEN, read_mooncake
from hybridcache.cache.checkpoint import CheckpointState
from hybridcache.engine.cost_model import ModelCost, load_model_cost


class _Probe:
    """Records, for one replay, each admitted match and every published checkpoint released unhit."""

    def __init__(self, replay: CacheReplay) -> None:
        self.replay = replay
        self.matches: dict = {}  # request id -> (cached_len, divergence_len, reason) of its admitted match
        self.unhit: Counter[str] = Counter()
        self.released: Counter[str] = Counter()
        self.kv_bytes = 0.0
        self.state_bytes = 0.0
        self.samples = 0
        cache = replay.cache
        life = cache._life
        admit, release, drop = cache.admit, life.release, replay._drop

        def traced_admit(match, *args, **kwargs):
            admitted = admit(match, *args, **kwargs)
            if admitted is not None:
                reason = match.checkpoint_reason.value if match.checkpoint_reason is not None else None
                self.matches[match.request_id] = (match.cached_len, match.divergence_len, reason)
            return admitted

        def traced_drop(request, seq, active):  # it runs without the cache: it skips nothing
            self.matches[seq.rid] = (0, self.matches[seq.rid][1], None)
            drop(request, seq, active)

        def traced_release(ckpt, kind):
            if ckpt.state is CheckpointState.PUBLISHED:
                self.released[ckpt.reason.value] += 1
                if not ckpt.was_hit:
                    self.unhit[ckpt.reason.value] += 1
            release(ckpt, kind)

        cache.admit = traced_admit
        life.release = traced_release
        replay._drop = traced_drop

    def outcome(self, request_id) -> tuple[int, int, str | None]:
        """(tokens skipped, divergence length, reason of the checkpoint restored) of a finished sequence;
        (0, 0, None) when it was never admitted (computed without the cache)."""
        return self.matches.pop(request_id, (0, 0, None))

    def sample(self) -> None:
        stats = self.replay.cache.stats
        cost = self.replay.cost
        self.kv_bytes += stats.num_blocks_used * cost.block_bytes(self.replay.block_size)
        self.state_bytes += (stats.num_slots_used - stats.num_running) * cost.state_bytes
        self.samples += 1

    def still_held_unhit(self) -> Counter[str]:
        held: Counter[str] = Counter()
        for ckpt in self.replay.cache._life.published():
            if not ckpt.was_hit:
                held[ckpt.reason.value] += 1
        return held


def diagnose(requests: list[SimRequest], config: SimConfig, policies: str = "hybridcache,bounded-oracle",
             cost: ModelCost | None = None) -> dict:
    """Replay `requests` through the two `policies` (the diagnosed one, then the yardstick) at `config`; the
    report described in the module docstring, as a dict (`hit_rate` is the simulator's token hit rate)."""
    cost = cost if cost is not None else load_model_cost(None)
    specs = parse_policies(policies, config.block_size)
    if len(specs) != 2:
        raise ValueError(f"diagnose compares two policies, got {policies!r}")
    for spec in specs:
        if spec.mode != "hybridcache":
            raise ValueError(f"diagnose needs policies that run the real cache, got {spec.name!r}")
    replays = [make_replay(spec, cost, config, requests[0].n) for spec in specs]
    prepare_oracles(replays, requests)
    probes = [_Probe(r) for r in replays]
    hit_tokens: list[Counter[str]] = [Counter() for _ in replays]
    gap: Counter[str] = Counter()
    gap_tokens: Counter[str] = Counter()
    gap_by_oracle_reason: Counter[str] = Counter()
    with _cyclic_gc_paused():
        for request in requests:
            shared = cache_requests_of(request)
            outcomes = []
            for replay, probe, tokens in zip(replays, probes, hit_tokens, strict=True):
                replay.run(request, shared)
                probe.sample()
                outcomes.append({cr.request_id: probe.outcome(cr.request_id) for cr in shared})
                for cached, _, reason in outcomes[-1].values():
                    if cached:
                        tokens[reason] += cached
            mine, theirs = outcomes
            for cr in shared:
                cached, divergence, _ = mine[cr.request_id]
                o_cached, _, o_reason = theirs[cr.request_id]
                if o_cached <= cached:
                    continue
                if divergence <= cached:
                    what = "no_content"
                elif divergence >= o_cached:
                    what = "kv_no_state"
                else:
                    what = "partial_content"
                what += "/shallower" if cached else "/miss"
                gap[what] += 1
                gap_tokens[what] += o_cached - cached
                gap_by_oracle_reason[o_reason] += o_cached - cached

    report: dict = {"num_requests": len(requests), "memory_gib": config.memory_bytes / GIB}
    for replay, probe, tokens in zip(replays, probes, hit_tokens, strict=True):
        stats = replay.cache.stats
        report[replay.spec.name] = {
            "hit_rate": round(replay.result().token_hit_rate, 4),
            "hits_by_reason": dict(stats.hits_by_reason),
            "hit_tokens_by_reason": dict(tokens),
            "saves_by_reason": dict(stats.saves_by_reason),
            "declined_saves": dict(stats.declined_saves),
            "evictions_by_kind": dict(stats.evictions_by_kind),
            "avg_kv_mib": round(probe.kv_bytes / probe.samples / 2**20, 1),
            "avg_state_mib": round(probe.state_bytes / probe.samples / 2**20, 1),
            "released_by_reason": dict(probe.released),
            "released_unhit_by_reason": dict(probe.unhit),
            "held_unhit_at_end_by_reason": dict(probe.still_held_unhit()),
        }
    report["gap"] = {"requests": dict(gap), "tokens": dict(gap_tokens),
                     "tokens_by_oracle_reason": dict(gap_by_oracle_reason)}
    return report


def mooncake_reuse(trace: str, num_requests: int | None) -> dict:
    """Reuse distances in a Mooncake trace, from its hash ids (one per 512-token block): for every request
    whose prompt starts with at least two blocks of an earlier prompt, the reused tokens and the traffic
    (prompt + output tokens of the requests in between) since the last request that had that prefix;
    token-weighted quantiles of that traffic, and how many reuses hit a prefix already reused before."""
    records = read_mooncake(trace, num_requests)
    last: dict[tuple[int, ...], int] = {}  # prefix of hash ids -> the last request that had it
    reused_before: Counter[tuple[int, ...]] = Counter()
    traffic = [0]
    for r in records:
        traffic.append(traffic[-1] + r.input_length + r.output_length)
    events = []  # (reused tokens, traffic since the previous use, requests since, reused before)
    for i, r in enumerate(records):
        ids = r.hash_ids
        depth = next((k for k in range(len(ids), 0, -1) if ids[:k] in last), 0)
        if depth >= 2:
            j = last[ids[:depth]]
            events.append((min(depth * MOONCAKE_BLOCK_LEN, r.input_length), traffic[i] - traffic[j + 1], i - j,
                           reused_before[ids[:depth]] > 0))
        for k in range(1, len(ids) + 1):
            if k <= depth:
                reused_before[ids[:k]] += 1
            last[ids[:k]] = i
    events.sort(key=lambda e: e[1])
    total = sum(e[0] for e in events)
    quantiles, acc, qs = {}, 0, [0.1, 0.25, 0.5, 0.75, 0.9]
    for tokens, distance, requests, _ in events:
        acc += tokens
        while qs and acc >= qs[0] * total:
            quantiles[str(qs.pop(0))] = {"traffic_tokens": distance, "requests": requests}
    return {"num_requests": len(records), "reuses": len(events), "reused_tokens": total,
            "reuses_of_a_reused_prefix": sum(1 for e in events if e[3]),
            "token_weighted_distance_quantiles": quantiles}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="mooncake")
    parser.add_argument("--trace", default=None)
    parser.add_argument("--num-requests", type=int, default=1500)
    parser.add_argument("--memory-gib", type=float, default=1.0)
    parser.add_argument("--policies", default="hybridcache,bounded-oracle",
                        help="two policies: the one diagnosed, then the yardstick")
    parser.add_argument("--model", default=None, help="model folder for the cost model and the tokenizer "
                        "(default: the built-in model)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--reuse", action="store_true", help="only the reuse distances of a Mooncake trace")
    args = parser.parse_args()
    if args.reuse:
        print(json.dumps(mooncake_reuse(args.trace, args.num_requests), indent=1))
        return

    requests = list(load_workload(args.workload, trace=args.trace, num_requests=args.num_requests,
                                  model_dir=args.model))
    report = {"workload": args.workload, **diagnose(requests, SimConfig(int(args.memory_gib * GIB)), args.policies,
                                                    load_model_cost(args.model))}
    text = json.dumps(report, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
