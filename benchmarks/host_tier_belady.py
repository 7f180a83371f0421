"""The host tier's hit rate when its own eviction is offline-optimal (issue 30): Belady's rule on the host pool.

`hybridcache` + a host of R x the GPU budget, the device policy unchanged (learned admission, LRU, every
demotion as built), with `HostTier.queues` replaced by `BeladyHostOrder`: the host drops the unpinned host
checkpoint whose next use (`FutureIndex.next_use`, the bounded oracle's: the first later request whose prompt holds
its prefix and tail) is furthest away, those never used again first (the largest first: its blocks and the host
nodes it leaves dead). With variable sizes and shared chains Belady's rule is not provably optimal, and a promotion
changes the device's later demotions, so the demotion stream is the one this replay produces; it is the standard
offline yardstick, and the best a host order can do behind this device policy up to those two effects.

Variants (each a replay in one process, the first always the default order as built):

    default            `HostOrder` (what the engine runs)
    belady             the host's eviction is Belady's, everything demoted as built
    whether            what is never used again goes first (the largest first), then the default order: the
                       foresight of *which* returns without *when* (the reuse oracle's, on the host)
    whether@P          `whether` wrong about a fixed random share 1 - P of the checkpoints (either way): what a
                       predictor of returns of accuracy P would reach
    belady+returns     also demote only checkpoints a later request uses (what is demoted, with foresight of which)
    belady+all         every save admitted on the device (`hybridcache+all`'s admission), Belady on the host
    inclusive-belady   a host of (R - 1) x the budget: what an inclusive tier (a promotion keeps its host copy,
                       so re-demoting it costs no copy) has left for items not on the device, at best

    OMP_NUM_THREADS=1 nice -n 10 python benchmarks/host_tier_belady.py --workload mooncake \\
        --trace /path/to/mooncake/conversation_trace.jsonl --num-requests 3000 --gib 1 [--ratio 4] \\
        [--variants default,belady,belady+returns]
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import sys
import time
from collections.abc import Callable
from dataclasses import replace

from host_tier_bound import Seen, replay_all  # sibling scripts
from host_tier_sweep import load_cost_and_workload, workload_arguments

from hybridcache.bench.oracles import FutureIndex
from hybridcache.bench.replay import CacheReplay
from hybridcache.bench.simulator import GIB, SimConfig, make_replay
from hybridcache.bench.specs import parse_policies
from hybridcache.cache.checkpoint import Checkpoint
from hybridcache.cache.host_order import HostOrder
from hybridcache.cache.host_tier import _num_blocks, _num_pruned

VARIANTS = ("default", "belady", "whether", "belady+returns", "belady+all", "inclusive-belady")


class BeladyHostOrder(HostOrder):
    """`HostOrder` whose victim is Belady's: the unpinned host checkpoint used next furthest in the future (never
    first, the largest of those first). `timing=False` knows only *whether* a checkpoint is used again: the never
    used first (the largest first), then `HostOrder`'s own order (due first). Next uses are kept per checkpoint,
    in a lazy max-heap, and every one the replay has reached (`seen.now`, the index of the request being
    replayed) is looked up again before a pick."""

    def __init__(
        self, protection: int, future: FutureIndex, seen: Seen, timing: bool = True, accuracy: float = 1.0,
    ) -> None:
        super().__init__(protection)
        self.future, self.seen, self.timing, self.accuracy = future, seen, timing, accuracy
        self._heap: list[tuple[int, int, int]] = []  # (-never, -(size if never else next use), ckpt id)
        self._uses: list[tuple[int, int]] = []  # (next use, ckpt id): looked up again once the replay passes it
        self._key: dict[int, tuple[int, int]] = {}
        self._next: dict[int, int | None] = {}
        self._ckpts: dict[int, Checkpoint] = {}

    def add(self, ckpt: Checkpoint, proven: bool) -> None:
        super().add(ckpt, proven)
        self._ckpts[ckpt.ckpt_id] = ckpt
        self._push(ckpt)

    def remove(self, ckpt: Checkpoint) -> None:
        super().remove(ckpt)
        cid = ckpt.ckpt_id
        del self._ckpts[cid], self._key[cid], self._next[cid]

    def _push(self, ckpt: Checkpoint) -> None:
        anchor = ckpt.anchor
        j = self.future.next_use(anchor.hash, anchor.depth, ckpt.tail_ids, self.seen.now)
        cid = ckpt.ckpt_id
        wrong = self.accuracy < 1 and random.Random(cid).random() >= self.accuracy  # the same for its life
        if (j is None) != wrong:
            key = (1, _num_blocks(ckpt) + _num_pruned(ckpt))
        else:
            key = (0, j) if self.timing else (0, -self._due[cid])
        self._next[cid], self._key[cid] = j, key
        heapq.heappush(self._heap, (-key[0], -key[1], cid))
        if j is not None:
            heapq.heappush(self._uses, (j, cid))

    def victim(self) -> Checkpoint | None:
        uses, now = self._uses, self.seen.now
        while uses and uses[0][0] <= now:  # a next use has come (and not promoted it): when is the one after?
            j, cid = heapq.heappop(uses)
            if self._next.get(cid) == j:
                self._push(self._ckpts[cid])
        # (an entry whose key differs was removed or re-keyed since)
        return first_unpinned(self._heap, lambda entry: self._ckpts[entry[2]]
                              if self._key.get(entry[2]) == (-entry[0], -entry[1]) else None)


def first_unpinned(heap: list[tuple], live: Callable[[tuple], Checkpoint | None]) -> Checkpoint | None:
    """The first checkpoint in `heap` order that is live (`live(entry)`: its checkpoint, or None for a stale entry)
    and not pinned. Stale entries are popped for good; pinned ones are set aside and pushed back."""
    aside, found = [], None
    while heap:
        ckpt = live(heap[0])
        if ckpt is None:
            heapq.heappop(heap)
            continue
        if ckpt.num_pins:
            aside.append(heapq.heappop(heap))
            continue
        found = ckpt
        break
    for entry in aside:
        heapq.heappush(heap, entry)
    return found


def use_belady(
    replay: CacheReplay, future: FutureIndex, seen: Seen, timing: bool = True, accuracy: float = 1.0,
) -> None:
    """Give `replay`'s host tier Belady's order (it must be empty: call before the first request)."""
    host = replay.cache._life.host
    if host.order:
        raise ValueError("the host tier already holds checkpoints")
    host.queues = BeladyHostOrder(host.queues.protection, future, seen, timing, accuracy)


def demote_only_returns(replay: CacheReplay, future: FutureIndex, seen: Seen) -> None:
    """Wrap `replay`'s demotion test: a checkpoint no later request uses is released instead of demoted."""
    life = replay.cache._life
    demotable = life._demotable

    def deciding(ckpt) -> bool:
        anchor = ckpt.anchor
        return demotable(ckpt) and future.next_use(anchor.hash, anchor.depth, ckpt.tail_ids, seen.now) is not None

    life._demotable = deciding


def _is_noisy(variant: str) -> bool:
    """`whether@P`: `whether` with a predictor of accuracy P (0 <= P <= 1)."""
    base, _, accuracy = variant.partition("@")
    try:
        return base == "whether" and 0 <= float(accuracy) <= 1
    except ValueError:
        return False


def build(variant: str, spec, cost, gpu: int, ratio: float, block_size: int, future: FutureIndex):
    """(replay, seen) for one variant."""
    seen = Seen()
    host_ratio = ratio - 1 if variant == "inclusive-belady" else ratio
    config = SimConfig(gpu, block_size, host_memory_bytes=int(host_ratio * gpu))
    replay = make_replay(replace(spec, admission="all") if variant == "belady+all" else spec, cost, config)
    base, _, accuracy = variant.partition("@")
    if variant != "default":
        use_belady(replay, future, seen, timing=base != "whether", accuracy=float(accuracy or 1))
    if variant == "belady+returns":
        demote_only_returns(replay, future, seen)
    return replay, seen


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    workload_arguments(parser)
    parser.add_argument("--gib", type=float, required=True, help="the GPU budget, GiB")
    parser.add_argument("--ratio", type=float, default=4.0, help="the host tier as a multiple of the GPU budget")
    parser.add_argument("--variants", default=",".join(VARIANTS[:3]),
                        help=f"from {', '.join(VARIANTS)}, whether@P (0 <= P <= 1)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS and not _is_noisy(v)]
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")

    started = time.monotonic()
    cost, workload = load_cost_and_workload(args)
    requests = list(workload)
    (hybrid,) = parse_policies("hybridcache", args.block_size)
    gpu = int(args.gib * GIB)
    future = FutureIndex(requests, args.block_size)
    replays = [build(v, hybrid, cost, gpu, args.ratio, args.block_size, future) for v in variants]
    replay_all(replays, requests)
    print(f"{len(requests)} requests of {args.workload}, GPU {args.gib:g} GiB, host {args.ratio:g}x, "
          f"B={args.block_size} ({time.monotonic() - started:.0f} s)")
    print("| host order | hit rate | PFLOPs saved | host hit tokens | demoted ckpts | host dropped |\n"
          "| --- | --- | --- | --- | --- | --- |")
    rows = []
    for variant, (replay, _) in zip(variants, replays, strict=True):
        result, stats = replay.result(), replay.cache.stats
        print(f"| {variant} | {result.token_hit_rate:.4f} | {result.flops_saved / 1e15:.4f} | "
              f"{result.host_hit_tokens:,} | {stats.num_demoted_checkpoints:,} | {stats.num_host_dropped:,} |")
        rows.append({"variant": variant, "hit_rate": result.token_hit_rate, "flops_saved": result.flops_saved,
                     "host_hit_tokens": result.host_hit_tokens})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"workload": args.workload, "num_requests": len(requests), "gib": args.gib,
                       "ratio": args.ratio, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
