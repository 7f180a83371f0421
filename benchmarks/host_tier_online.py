"""Screen online host-eviction rules against the default order (issue 30): rules that decide at host-eviction
time, from what the cache could know by then, how long a host checkpoint is kept.

Each rule gives a host checkpoint a due time (in the host order's clock, host blocks allocated, as `HostOrder`):
the host drops the unpinned one due first. `default` is `HostOrder` itself (proven: due one capacity later).

    gap          proven as default; an unproven checkpoint whose saving request continued an earlier prompt
                 (the deepest block it shares with any earlier prompt is at least half its blocks) with a gap of
                 at most one host capacity of clock ticks since that prompt is kept as a proven one (LIRS's
                 low inter-reference recency: its chain came back within what the host holds, so it is likely to
                 again)
    gap-due      the same, due at demotion + 2 x that gap (at most one capacity): kept until about when it
                 would come back again
    cont         any continuation kept as a proven one, whatever its gap (session 41's "popularity per
                 request", for comparison)
    gap-chunk    `gap` for chunk ends only (the long chains; a chat's short prompts have none)
    reads        default, and a host checkpoint whose prefix and tail a later prompt reads (its match walks past
                 it: a deeper checkpoint served it) is re-dated as a proven one (frequency of reads since
                 demotion)
    passed       the opposite: such a checkpoint goes first (a later turn went past it, as a shadowed turn end on
                 the device: the next turn will use the deeper one)

    OMP_NUM_THREADS=1 nice -n 10 python benchmarks/host_tier_online.py --workload mooncake \\
        --trace /path/to/mooncake/conversation_trace.jsonl --num-requests 3000 --gib 1 [--rules default,gap]
"""

from __future__ import annotations

import argparse
import heapq
import sys
import time
from bisect import bisect_left
from collections.abc import Callable

from host_tier_belady import first_unpinned  # sibling scripts
from host_tier_sweep import load_cost_and_workload, workload_arguments

from hybridcache.bench.oracles import FutureIndex
from hybridcache.bench.replay import CacheReplay, cache_requests_of
from hybridcache.bench.simulator import GIB, SimConfig, make_replay
from hybridcache.bench.specs import parse_policies
from hybridcache.cache.checkpoint import Checkpoint
from hybridcache.cache.host_order import HostOrder
from hybridcache.cache.matching import walk_prompt
from hybridcache.cache.request import SaveReason

RULES = ("default", "gap", "gap-due", "cont", "gap-chunk", "reads", "passed")


class DueOrder(HostOrder):
    """`HostOrder` with any due time: `extra(ckpt)` (ticks, or None) for an unproven checkpoint; a lazy min-heap."""

    def __init__(self, protection: int, extra: Callable[[Checkpoint], int | None]) -> None:
        super().__init__(protection)
        self.extra = extra
        self._heap: list[tuple[int, int, int]] = []
        self._ckpts: dict[int, Checkpoint] = {}

    def add(self, ckpt: Checkpoint, proven: bool) -> None:
        bonus = None if proven else self.extra(ckpt)
        super().add(ckpt, proven or bonus is not None)
        due = self.clock + (self.protection if proven else (bonus or 0))
        self._due[ckpt.ckpt_id] = due
        self._ckpts[ckpt.ckpt_id] = ckpt
        heapq.heappush(self._heap, (due, int(proven or bonus is not None), ckpt.ckpt_id))

    def remove(self, ckpt: Checkpoint) -> None:
        super().remove(ckpt)
        del self._ckpts[ckpt.ckpt_id]

    def touch(self, ckpt: Checkpoint, due: int | None = None) -> None:
        """`ckpt` was read: due `due`, by default one protection from now."""
        due = self.clock + self.protection if due is None else due
        self._due[ckpt.ckpt_id] = due
        heapq.heappush(self._heap, (due, 1, ckpt.ckpt_id))

    def victim(self) -> Checkpoint | None:
        return first_unpinned(self._heap, lambda entry: self._ckpts.get(entry[2])
                              if self._due.get(entry[2]) == entry[0] else None)


class Continuations:
    """Per request index: the latest earlier request whose prompt shares at least half of its full blocks (None:
    a first turn), from the workload's block hashes (`FutureIndex`), and the host clock at each request's start."""

    def __init__(self, future: FutureIndex) -> None:
        self.future = future
        self.previous: list[int | None] = []
        for i, hashes in enumerate(future.hashes):
            prev = None
            for depth in range(len(hashes), max(1, (len(hashes) + 1) // 2) - 1, -1):
                holders = future.by_hash.get(hashes[depth - 1], ())
                k = bisect_left(holders, i)
                if k:
                    prev = holders[k - 1]
                    break
            self.previous.append(prev)


def make_rule(rule: str, replay: CacheReplay, conts: Continuations, index_of: dict, clock_at: list[int]):
    host = replay.cache._life.host
    capacity = host.queues.protection

    def gap_ticks(ckpt: Checkpoint) -> int | None:
        rid = ckpt.owner[0] if isinstance(ckpt.owner, tuple) else ckpt.owner
        i = index_of.get(rid)
        prev = None if i is None else conts.previous[i]
        return None if prev is None else clock_at[i] - clock_at[prev]

    def extra(ckpt: Checkpoint) -> int | None:
        gap = gap_ticks(ckpt)
        if gap is None:
            return None
        if rule == "cont":
            return capacity
        if rule == "gap-chunk" and ckpt.reason is not SaveReason.CHUNK_END:
            return None
        if gap > capacity:
            return None
        return capacity if rule == "gap" else min(capacity, 2 * gap)

    if rule in ("reads", "passed"):
        host.queues = DueOrder(capacity, lambda ckpt: None)
        cache, match = replay.cache, replay.cache.match

        def reading(request, max_step=None):
            result = match(request, max_step)
            size = cache.block_size
            path = walk_prompt(cache._trie, request, size)
            owners = [host.under.get(n) for n in path] + host.continuation(path, request, size)
            prompt = request.prompt_ids
            for depth, owner in enumerate(owners):
                if owner is None:
                    continue
                for ckpt in list(owner.iter_checkpoints()):
                    base = depth * size
                    if ckpt.step <= len(prompt) and prompt[base:ckpt.step] == ckpt.tail_ids and (
                            ckpt.ckpt_id != result.checkpoint_id):
                        host.queues.touch(ckpt, None if rule == "reads" else 0)
            return result

        cache.match = reading
    elif rule != "default":
        host.queues = DueOrder(capacity, extra)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    workload_arguments(parser)
    parser.add_argument("--gib", type=float, required=True)
    parser.add_argument("--ratio", type=float, default=4.0)
    parser.add_argument("--rules", default=",".join(RULES))
    args = parser.parse_args(argv)
    rules = [r for r in args.rules.split(",") if r]
    started = time.monotonic()
    cost, workload = load_cost_and_workload(args)
    requests = list(workload)
    (hybrid,) = parse_policies("hybridcache", args.block_size)
    gpu = int(args.gib * GIB)
    future = FutureIndex(requests, args.block_size)
    conts = Continuations(future)
    index_of: dict = {}
    runs = []
    for rule in rules:
        replay = make_replay(hybrid, cost, SimConfig(gpu, args.block_size, host_memory_bytes=int(args.ratio * gpu)))
        clock_at: list[int] = []
        make_rule(rule, replay, conts, index_of, clock_at)
        runs.append((rule, replay, clock_at))
    for i, request in enumerate(requests):
        index_of[request.request_id] = i
        shared = cache_requests_of(request)
        for _, replay, clock_at in runs:
            clock_at.append(replay.cache._life.host.queues.clock)
            replay.run(request, shared)
    firsts = sum(p is None for p in conts.previous)
    print(f"{len(requests)} requests of {args.workload} ({firsts} first turns), GPU {args.gib:g} GiB, host "
          f"{args.ratio:g}x ({time.monotonic() - started:.0f} s)")
    for rule, replay, _ in runs:
        r = replay.result()
        print(f"| {rule} | {r.token_hit_rate:.4f} | {r.flops_saved / 1e15:.4f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
