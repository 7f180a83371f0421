"""How far a host-tier rule that sees only what is known at demotion can go (issue 30): an optimistic bound.

A rule for the host tier decides, when device eviction hands it a checkpoint, whether to demote it (or release it)
and how long to keep it (`HostOrder`: proven ones one host capacity longer). All it can see then is the
checkpoint's features. This script gives such a rule **hindsight of its features' worth**: a first replay
(`hybridcache` + a host of R x the GPU budget, the default order) records, at each demotion, the checkpoint's
class (its features) and whether a later request uses it (`FutureIndex.next_use`, the bounded oracle's); each
class's share that returns is then known. Replays with the class rule follow: demote a checkpoint only when its
class's share is at least `release_below`, and keep it as long as a proven one when the share is at least
`protect_from` (what `proven_at_demotion` proves is kept longer as before). The shares come from the run being
measured, where an online learner of the same features would have to estimate them: where even the best of these
rules stays below the bounded oracle, that is evidence (not a proof: the features could be used otherwise) that
a rule of these features cannot reach it.

Features (what the cache could see at demotion): why it was saved; hit (before, not shadowed); the anchor's depth
(log2 of its blocks); how many requests so far had the anchor's block in their prompt (the prefix's popularity,
up to 3: the trie sees every lookup); the share of the saving request's prompt that hit (0, < 1/2, >= 1/2); how
many requests ago that request came (< 100, < 300, later). Classes: `coarse` = (why, hit, depth), `fine` =
every feature.

    OMP_NUM_THREADS=1 nice -n 10 python benchmarks/host_tier_bound.py --workload mooncake \\
        --trace /path/to/mooncake/conversation_trace.jsonl --num-requests 3000 --gib 1 [--ratio 4]
"""

from __future__ import annotations

import argparse
import json
import sys
from bisect import bisect_right
from collections import defaultdict
from collections.abc import Callable

from host_tier_sweep import load_cost_and_workload, workload_arguments  # a sibling script

from hybridcache.bench.oracles import FutureIndex
from hybridcache.bench.replay import CacheReplay, cache_requests_of
from hybridcache.bench.simulator import GIB, SimConfig, make_replay
from hybridcache.bench.specs import parse_policies

RULES = ((0.0, None), (0.02, None), (0.05, None), (0.1, None), (0.0, 0.3), (0.05, 0.3))  # (release below, protect from)


class Seen:
    """What the replay has seen so far: the index of the request being replayed (`now`) and, per cache request
    id, (prompt length, hit tokens, request index) of the requests replayed."""

    def __init__(self) -> None:
        self.now = -1
        self.owners: dict = {}


def features(ckpt, future: FutureIndex, seen: Seen, fine: bool) -> tuple:
    """The class of device checkpoint `ckpt` now, as the cache could see it."""
    anchor = ckpt.anchor
    key: tuple = (ckpt.reason.value, ckpt.was_hit and not ckpt.shadowed, anchor.depth.bit_length())
    if not fine:
        return key
    popularity = bisect_right(future.by_hash.get(anchor.hash, ()), seen.now) if anchor.depth else 0
    prompt_len, hit, index = seen.owners.get(ckpt.owner, (0, 0, seen.now))
    share = 0 if not hit else (1 if 2 * hit < prompt_len else 2)
    age = seen.now - index
    return (*key, min(popularity, 3), share, 0 if age < 100 else (1 if age < 300 else 2))


def record(replay: CacheReplay, future: FutureIndex, seen: Seen, fine: bool) -> dict[tuple, list[int]]:
    """Wrap `replay`'s demotion to count, per class, [demotions, those a later request uses]."""
    life = replay.cache._life
    demote = life._demote_checkpoint
    counts: dict[tuple, list[int]] = defaultdict(lambda: [0, 0])

    def recording(ckpt, owner) -> None:
        anchor = ckpt.anchor
        row = counts[features(ckpt, future, seen, fine)]
        row[0] += 1
        row[1] += future.next_use(anchor.hash, anchor.depth, ckpt.tail_ids, seen.now) is not None
        demote(ckpt, owner)

    life._demote_checkpoint = recording
    return counts


def apply_rule(
    replay: CacheReplay, future: FutureIndex, seen: Seen, fine: bool, share: Callable[[tuple], float | None],
    release_below: float, protect_from: float | None,
) -> None:
    """Wrap `replay`'s host tier with the class rule: demote only a checkpoint whose class's share is at least
    `release_below` (a class the first replay never demoted is demoted), and protect it as a proven one when the
    share is at least `protect_from`."""
    life = replay.cache._life
    demotable, host = life._demotable, life.host
    hang = host.hang_checkpoint
    protect: set[int] = set()

    def deciding(ckpt) -> bool:
        if not demotable(ckpt):
            return False
        value = share(features(ckpt, future, seen, fine))
        if value is None:
            return True
        if protect_from is not None and value >= protect_from:
            protect.add(ckpt.ckpt_id)
        return value >= release_below

    def hanging(ckpt, owner, proven=False) -> None:
        hang(ckpt, owner, proven or ckpt.ckpt_id in protect)
        protect.discard(ckpt.ckpt_id)

    life._demotable = deciding
    host.hang_checkpoint = hanging


def replay_all(replays: list[tuple[CacheReplay, Seen]], requests) -> None:
    """Feed every request to each replay, keeping each replay's `Seen` up to date."""
    for i, request in enumerate(requests):
        shared = cache_requests_of(request)
        for replay, seen in replays:
            seen.now = i
            before = replay.counters.hit_tokens
            replay.run(request, shared)
            hit = (replay.counters.hit_tokens - before) // request.n
            seen.owners.update((r.request_id, (request.prompt_len, hit, i)) for r in shared)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    workload_arguments(parser)
    parser.add_argument("--gib", type=float, required=True, help="the GPU budget, GiB")
    parser.add_argument("--ratio", type=float, default=4.0, help="the host tier as a multiple of the GPU budget")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    cost, workload = load_cost_and_workload(args)
    requests = list(workload)
    (hybrid,) = parse_policies("hybridcache", args.block_size)
    gpu = int(args.gib * GIB)
    config = SimConfig(gpu, args.block_size, host_memory_bytes=int(args.ratio * gpu))
    future = FutureIndex(requests, args.block_size)
    prompt_tokens = sum(r.prompt_len * r.n for r in requests)
    print(f"{len(requests)} requests of {args.workload}, GPU {args.gib:g} GiB, host {args.ratio:g}x, "
          f"B={args.block_size}")
    rows = []
    for fine in (False, True):
        seen = Seen()
        base = make_replay(hybrid, cost, config)
        counts = record(base, future, seen, fine)
        replay_all([(base, seen)], requests)
        shares = {k: back / n for k, (n, back) in counts.items()}
        kind = "fine" if fine else "coarse"
        print(f"\n{kind} classes: {len(counts)}, {sum(n for n, _ in counts.values()):,} demotions; "
              f"the default order: hit rate {base.counters.hit_tokens / prompt_tokens:.4f}")
        if not fine:
            print("| why, hit, log2 depth | demotions | share that returns |\n| --- | --- | --- |")
            for k in sorted(counts):
                print(f"| {k} | {counts[k][0]:,} | {shares[k]:.2f} |")
        replays = [(make_replay(hybrid, cost, config), Seen()) for _ in RULES]
        for (replay, seen), (release_below, protect_from) in zip(replays, RULES, strict=True):
            apply_rule(replay, future, seen, fine, shares.get, release_below, protect_from)
        replay_all(replays, requests)
        print("| classes | release below | protect from | hit rate | PFLOPs saved | host dropped |\n"
              "| --- | --- | --- | --- | --- | --- |")
        for (replay, _), (release_below, protect_from) in zip(replays, RULES, strict=True):
            result = replay.result()
            print(f"| {kind} | {release_below:g} | {'-' if protect_from is None else f'{protect_from:g}'} | "
                  f"{result.token_hit_rate:.4f} | {result.flops_saved / 1e15:.4f} | "
                  f"{replay.cache.stats.num_host_dropped:,} |")
            rows.append({"classes": kind, "release_below": release_below, "protect_from": protect_from,
                         "hit_rate": result.token_hit_rate, "flops_saved": result.flops_saved})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"workload": args.workload, "num_requests": len(requests), "gib": args.gib,
                       "ratio": args.ratio, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
