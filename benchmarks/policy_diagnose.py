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
"""

from __future__ import annotations

import argparse
import json
from collections import Counter

from hybridcache.bench.cost_model import load_model_cost
from hybridcache.bench.simulator import (
    GIB,
    BoundedOracleReplay,
    CacheReplay,
    SimConfig,
    _cyclic_gc_paused,
    cache_requests_of,
    parse_policies,
)
from hybridcache.bench.workloads import load_workload
from hybridcache.cache.checkpoint import CheckpointState


class _Probe:
    """Records, for one replay, each admitted match and every published checkpoint released unhit."""

    def __init__(self, replay: CacheReplay) -> None:
        self.replay = replay
        self.matches: dict = {}  # request id -> (cached_len, divergence_len, reason)
        self.unhit: Counter[str] = Counter()
        self.released: Counter[str] = Counter()
        self.kv_bytes = 0.0
        self.state_bytes = 0.0
        self.samples = 0
        cache = replay.cache
        life = cache._life
        match, release = cache.match, life.release

        def traced_match(request, max_step=None):
            result = match(request, max_step)
            reason = result.checkpoint_reason.value if result.checkpoint_reason is not None else None
            self.matches[request.request_id] = (result.cached_len, result.divergence_len, reason)
            return result

        def traced_release(ckpt, kind):
            if ckpt.state is CheckpointState.PUBLISHED:
                self.released[ckpt.reason.value] += 1
                if not ckpt.was_hit:
                    self.unhit[ckpt.reason.value] += 1
            release(ckpt, kind)

        cache.match = traced_match
        life.release = traced_release

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="mooncake")
    parser.add_argument("--trace", default=None)
    parser.add_argument("--num-requests", type=int, default=1500)
    parser.add_argument("--memory-gib", type=float, default=1.0)
    parser.add_argument("--policies", default="hybridcache,bounded-oracle",
                        help="two policies: the one diagnosed, then the yardstick")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    cost = load_model_cost(None)
    workload = load_workload(args.workload, trace=args.trace, num_requests=args.num_requests)
    requests = list(workload)
    config = SimConfig(int(args.memory_gib * GIB))
    specs = parse_policies(args.policies, config.block_size)
    replays = []
    for spec in specs:
        cls = BoundedOracleReplay if spec.name.startswith("bounded-oracle") else CacheReplay
        replay = cls(spec, cost, config, requests[0].n)
        if isinstance(replay, BoundedOracleReplay):
            replay.prepare(requests)
        replays.append(replay)
    probes = [_Probe(r) for r in replays]
    hit_tokens = [Counter() for _ in replays]
    gap: Counter[str] = Counter()
    gap_tokens: Counter[str] = Counter()
    gap_by_oracle_reason: Counter[str] = Counter()
    with _cyclic_gc_paused():
        for request in requests:
            shared = cache_requests_of(request)
            for replay, probe, tokens in zip(replays, probes, hit_tokens, strict=True):
                replay.run(request, shared)
                probe.sample()
                for cr in shared:
                    cached, _, reason = probe.matches[cr.request_id]
                    if cached:
                        tokens[reason] += cached
            for cr in shared:
                cached, divergence, _ = probes[0].matches[cr.request_id]
                o_cached, _, o_reason = probes[1].matches[cr.request_id]
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

    report: dict = {"workload": args.workload, "num_requests": len(requests), "memory_gib": args.memory_gib}
    for replay, probe, tokens in zip(replays, probes, hit_tokens, strict=True):
        stats = replay.cache.stats
        report[replay.spec.name] = {
            "hit_rate": round(stats.num_hit_tokens / max(1, stats.num_query_tokens), 4),
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
    text = json.dumps(report, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
