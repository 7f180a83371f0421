"""Which demotions to the host tier come back (issue 30): what the cache could see of each checkpoint when it was
demoted, against whether a later request uses it.

Replays a workload through `hybridcache` with a host tier of R x the GPU budget and, at every demotion of a
checkpoint, records what is known then (why it was saved, whether it was hit, whether it is shadowed, its step,
the prompt length of the request that saved it and the share of that prompt which hit, how many requests ago that
request came) and, from the workload's future (`FutureIndex`, the bounded oracle's), whether and how many requests
later a prompt uses it. Prints the share that returns per feature: a feature that separates those that return
from those that never do is a candidate for the host's own order (`HostOrder`); the gaps of the returns against
the host's lifetime say what a recency order can keep.

    OMP_NUM_THREADS=1 nice -n 10 python benchmarks/host_tier_returns.py --workload mooncake \\
        --trace /path/to/mooncake/conversation_trace.jsonl --num-requests 3000 --gib 1 [--ratio 4]
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

from host_tier_sweep import load_cost_and_workload, workload_arguments  # a sibling script

from hybridcache.bench.oracles import FutureIndex
from hybridcache.bench.replay import cache_requests_of
from hybridcache.bench.simulator import GIB, SimConfig, make_replay
from hybridcache.bench.specs import parse_policies


@dataclass(frozen=True)
class Demotion:
    """A checkpoint demoted to the host tier: what was known then, and its future (`gap`: requests until one uses
    it, None when none does)."""

    reason: str
    was_hit: bool
    shadowed: bool
    step: int
    prompt_len: int
    hit_share: float
    age: int
    gap: int | None


def record_demotions(replay, future: FutureIndex, now: list[int], owners: dict) -> list[Demotion]:
    """Wrap `replay`'s demotion of a checkpoint to record a `Demotion` each time (`now[0]`: the request being
    replayed; `owners`: cache request id -> (prompt length, hit tokens, request index))."""
    life = replay.cache._life
    demote = life._demote_checkpoint
    rows: list[Demotion] = []

    def recording(ckpt, owner) -> None:
        anchor = ckpt.anchor
        used = future.next_use(anchor.hash, anchor.depth, ckpt.tail_ids, now[0])
        prompt_len, hit, index = owners.get(ckpt.owner, (0, 0, now[0]))
        rows.append(Demotion(ckpt.reason.value, ckpt.was_hit, ckpt.shadowed, ckpt.step, prompt_len,
                             hit / prompt_len if prompt_len else 0.0, now[0] - index,
                             None if used is None else used - now[0]))
        demote(ckpt, owner)

    life._demote_checkpoint = recording
    return rows


def table(title: str, rows: list[Demotion], key: Callable[[Demotion], object]) -> None:
    """The share of `rows` that returns, per value of `key` (rows where it is None are left out)."""
    counts: dict[object, list[int]] = defaultdict(lambda: [0, 0])
    for row in rows:
        k = key(row)
        if k is not None:
            counts[k][0] += 1
            counts[k][1] += row.gap is not None
    print(f"\n{title}\n| value | demotions | share that returns |\n| --- | --- | --- |")
    for k in sorted(counts):  # one table's keys are all alike
        n, back = counts[k]
        print(f"| {k} | {n:,} | {back / n:.2f} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    workload_arguments(parser)
    parser.add_argument("--gib", type=float, required=True, help="the GPU budget, GiB")
    parser.add_argument("--ratio", type=float, default=4.0, help="the host tier as a multiple of the GPU budget")
    args = parser.parse_args(argv)

    cost, workload = load_cost_and_workload(args)
    requests = list(workload)
    (hybrid,) = parse_policies("hybridcache", args.block_size)
    gpu = int(args.gib * GIB)
    replay = make_replay(hybrid, cost, SimConfig(gpu, args.block_size, host_memory_bytes=int(args.ratio * gpu)))
    future = FutureIndex(requests, args.block_size)
    now, owners = [-1], {}
    rows = record_demotions(replay, future, now, owners)
    for i, request in enumerate(requests):
        now[0] = i
        shared = cache_requests_of(request)
        before = replay.counters.hit_tokens
        replay.run(request, shared)
        hit = (replay.counters.hit_tokens - before) // request.n
        owners.update((r.request_id, (request.prompt_len, hit, i)) for r in shared)
    back = sum(r.gap is not None for r in rows)
    hit_rate = replay.counters.hit_tokens / sum(r.prompt_len * r.n for r in requests)
    print(f"{len(requests)} requests of {args.workload}, GPU {args.gib:g} GiB, host {args.ratio:g}x, "
          f"B={args.block_size}: {len(rows):,} checkpoints demoted, {back:,} used by a later request "
          f"({back / max(1, len(rows)):.2f}); hit rate {hit_rate:.4f}")
    table("why it was saved, hit before, shadowed", rows, lambda r: (r.reason, r.was_hit, r.shadowed))
    table("why it was saved, prompt length of its request (32k buckets)", rows,
          lambda r: (r.reason, min(r.prompt_len // 32768, 3) * 32768))
    table("chunk ends: tokens from it to its request's prompt end (4k buckets)", rows,
          lambda r: min((r.prompt_len - r.step) // 4096, 8) * 4096 if r.reason == "chunk_end" else None)
    table("chunk ends: share of its request's prompt that hit", rows,
          lambda r: round(min(r.hit_share, 0.99), 1) if r.reason == "chunk_end" else None)
    table("chunk ends: hit before, requests since its request (50s)", rows,
          lambda r: (r.was_hit, min(r.age // 50, 10) * 50) if r.reason == "chunk_end" else None)
    table("returning chunk ends: requests until the return (200s; every one returns)", rows,
          lambda r: min(r.gap // 200, 8) * 200 if r.reason == "chunk_end" and r.gap is not None else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
