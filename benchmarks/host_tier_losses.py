"""Where a host tier loses to the bounded oracle (issue 30), request by request.

Replays a workload through `hybridcache` with a host tier of R x the GPU budget, `hybridcache` with (1 + R) x the
budget in one pool (the same bytes: does the tier deliver its capacity?) and the bounded oracle at the GPU
budget, side by side, and compares the hit tokens of each request: how many requests the oracle hits more on
and by how much, how many it hits less on; then the requests it gains most on, each with the earlier request
whose prompt shares the longest prefix with it and how many requests ago that was (a chain that returns after
more traffic than the host tier holds is lost to any recency order).

Two diagnostic replays split what the host tier lacks against the oracle: the host tier demoting only the
checkpoints a later request uses (foresight of *which* items return, for the host alone: `keep_only_what_returns`),
once with the cache's own admission and once saving every checkpoint (`hybridcache+all`). Where the second
reaches the oracle and the host never fills, the tier's capacity is not what is missing: what is, is knowing which
demotions return (and, between the two, the saves the learned admission declines that a host would have served).

    OMP_NUM_THREADS=1 nice -n 10 python benchmarks/host_tier_losses.py --workload mooncake \\
        --trace /path/to/mooncake/conversation_trace.jsonl --num-requests 1000 --gib 1 [--ratio 4] [--top 12]
"""

from __future__ import annotations

import argparse
import statistics
import sys

from host_tier_sweep import load_cost_and_workload, workload_arguments  # a sibling script

from hybridcache.bench.oracles import FutureIndex
from hybridcache.bench.replay import CacheReplay, cache_requests_of
from hybridcache.bench.simulator import GIB, make_replay, prepare_oracles
from hybridcache.bench.specs import SimConfig, parse_policies
from hybridcache.cache.request import common_prefix_len


class Clock:
    """The index of the request being replayed (read by `keep_only_what_returns`)."""

    now = -1


def keep_only_what_returns(replay: CacheReplay, future: FutureIndex, clock: Clock) -> None:
    """A diagnostic, not a policy: `replay`'s device eviction demotes to the host tier only a checkpoint that a later
    request uses (`FutureIndex.next_use` after `clock.now`); every other one is released as without a host tier.
    The host keeps its own order (`HostOrder`)."""
    life = replay.cache._life
    demotable = life._demotable

    def returns(ckpt) -> bool:
        anchor = ckpt.anchor
        return demotable(ckpt) and future.next_use(anchor.hash, anchor.depth, ckpt.tail_ids, clock.now) is not None

    life._demotable = returns


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    workload_arguments(parser)
    parser.add_argument("--gib", type=float, required=True, help="the GPU budget, GiB")
    parser.add_argument("--ratio", type=float, default=4.0, help="the host tier as a multiple of the GPU budget")
    parser.add_argument("--top", type=int, default=12, help="requests listed, the oracle's largest gains first")
    args = parser.parse_args(argv)

    cost, workload = load_cost_and_workload(args)
    requests = list(workload)
    gpu, size = int(args.gib * GIB), args.block_size
    hybrid, oracle, every = parse_policies("hybridcache,bounded-oracle,hybridcache+all", size)
    host = SimConfig(gpu, size, host_memory_bytes=int(args.ratio * gpu))
    replays = {
        "host": make_replay(hybrid, cost, host),
        "one pool": make_replay(hybrid, cost, SimConfig(int((1 + args.ratio) * gpu), size)),
        "oracle": make_replay(oracle, cost, SimConfig(gpu, size)),
        "which": make_replay(hybrid, cost, host),
        "which, every save": make_replay(every, cost, host),
    }
    prepare_oracles(replays.values(), requests)
    clock = Clock()
    for name in ("which", "which, every save"):
        keep_only_what_returns(replays[name], replays["oracle"].future, clock)
    hits: dict[str, list[int]] = {name: [] for name in replays}
    for request in requests:
        clock.now += 1
        shared = cache_requests_of(request)
        for name, replay in replays.items():
            before = replay.counters.hit_tokens
            replay.run(request, shared)
            hits[name].append(replay.counters.hit_tokens - before)
    prompt_tokens = sum(r.prompt_len * r.n for r in requests)
    print(f"{len(requests)} requests of {args.workload}, GPU {args.gib:g} GiB, host {args.ratio:g}x, B={size}")
    for name, label in (("host", f"hybridcache + host {args.ratio:g}x"),
                        ("one pool", f"hybridcache at {1 + args.ratio:g}x in one pool"),
                        ("oracle", "bounded-oracle at the GPU budget"),
                        ("which", "diagnostic: host keeps only what returns"),
                        ("which, every save", "the same, every checkpoint saved")):
        dropped = replays[name].cache.stats.num_host_dropped if replays[name].host_blocks else "-"
        print(f"  {label:<44} hit rate {sum(hits[name]) / prompt_tokens:.4f}   host dropped {dropped}")
    gains = [(o - h, i) for i, (h, o) in enumerate(zip(hits["host"], hits["oracle"], strict=True)) if o > h]
    losses = [h - o for h, o in zip(hits["host"], hits["oracle"], strict=True) if h > o]
    print(f"the oracle hits more on {len(gains)} requests (+{sum(g for g, _ in gains):,} tokens), fewer on "
          f"{len(losses)} (-{sum(losses):,} tokens)")
    if len(gains) >= 2:
        print("its gains per request, deciles:", [round(q) for q in statistics.quantiles([g for g, _ in gains], n=10)])
    print("\n| request | prompt tokens | host-tier hit | oracle hit | longest shared prefix | with request | "
          "requests ago |\n| --- | --- | --- | --- | --- | --- | --- |")
    for _gain, i in sorted(gains, reverse=True)[: args.top]:
        prompt = requests[i].prompt_ids
        shared, j = max(((common_prefix_len(prompt, requests[j].prompt_ids), j) for j in range(i)), default=(0, i))
        print(f"| {requests[i].request_id} | {len(prompt):,} | {hits['host'][i]:,} | {hits['oracle'][i]:,} | "
              f"{shared:,} | {requests[j].request_id} | {i - j} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
