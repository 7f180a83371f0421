"""Bimodal insertion, an experiment on `hybridcache` (one budget); not a cache mode (docs/cache.md, closing
note: "Measured and dropped: thrash-resistant insertion").

Every request but one in K inserts its new trie nodes and publishes its checkpoints at the cold end of the
recency orders (recency 0): they go first under pressure unless a hit moves them to the hot end, so a
stream of chains used once does not flush what is held. `K` = 1 is today's LRU. Variant `Kaf` (adaptive,
threshold f): ghosts of evicted trie nodes (chained hash -> how many nodes had been evicted then, at most
8 x the budget's blocks) tell, at each admission, how many tokens past the hit the deepest evicted block
of the prompt would have given, and how long ago (in evicted blocks) it went: near (<= the budget's
blocks) or far. Sums of hit tokens H, near N and far F, decayed by 0.995 a request; a request inserts cold
only while F > f x (H + N): reuse beyond the cache's reach outweighs what it gets and what more room
would get. The hooks wrap private methods (`Lifecycle.insert_block`, `Lifecycle._remove_leaf`,
`Evictor.on_publish`, `PrefixCache.admit`); a cold checkpoint is placed with `RecencyOrder.insert` (O(n)).

    OMP_NUM_THREADS=1 nice -n 10 python benchmarks/bimodal_insertion.py mooncake \\
        --trace /path/to/conversation_trace.jsonl --num-requests 3000 --sweep 1,2,4,8 --variants 1,4,16,4a4
"""

from __future__ import annotations

import argparse
from collections import OrderedDict

from hybridcache.bench.replay import CacheReplay, cache_requests_of
from hybridcache.bench.simulator import GIB, SimConfig, _cyclic_gc_paused, parse_policies
from hybridcache.bench.workloads import load_workload
from hybridcache.cache.trie import chain_hash, prompt_block_hashes
from hybridcache.engine.cost_model import ModelCost, load_model_cost

GHOSTS_PER_BUDGET_BLOCK = 8
DECAY = 0.995


class BimodalReplay(CacheReplay):
    """`hybridcache` with bimodal insertion (see the module docstring); `variant` "K" or "KaF"."""

    def __init__(self, variant: str, cost: ModelCost, config: SimConfig, max_running: int) -> None:
        super().__init__(parse_policies("hybridcache", config.block_size)[0], cost, config, max_running)
        period, _, threshold = variant.partition("a")
        self.variant, self.period = variant, int(period)
        self.threshold = float(threshold) if threshold else None
        self.cold = False
        self.count = 0
        self.cold_requests = 0
        self.sums = {"hit": 0.0, "near": 0.0, "far": 0.0}
        self.ghosts: OrderedDict[int, int] = OrderedDict()
        self.evicted = 0
        self.budget_blocks = config.memory_bytes // cost.block_bytes(config.block_size)
        self.requests: dict = {}
        life, cache = self.cache._life, self.cache
        evictor = life.evictor
        insert, publish, remove, admit = life.insert_block, evictor.on_publish, life._remove_leaf, cache.admit

        def insert_block(parent, node_hash, token_ids, spans, own_block, now):
            new = life.trie.find_child(parent, node_hash, token_ids, spans) is None
            node = insert(parent, node_hash, token_ids, spans, own_block, now)
            if new and self.cold:
                node.last_access = 0
            return node

        def on_publish(ckpt):
            if not self.cold:
                publish(ckpt)
                return
            ckpt.last_access = 0
            evictor._published.insert(ckpt)
            if ckpt.frozen_block is not None:
                evictor._tails.insert(ckpt)
            evictor.leaf_changed(ckpt.anchor)

        def remove_leaf(node, kind):
            if kind is not None:
                self.evicted += 1
                self.ghosts[node.hash] = self.evicted
                self.ghosts.move_to_end(node.hash)
                while len(self.ghosts) > GHOSTS_PER_BUDGET_BLOCK * self.budget_blocks:
                    self.ghosts.popitem(last=False)
            remove(node, kind)

        def cache_admit(match, *args, **kwargs):
            admitted = admit(match, *args, **kwargs)
            if admitted is not None:
                self._observe(match)
            return admitted

        life.insert_block, evictor.on_publish, life._remove_leaf = insert_block, on_publish, remove_leaf
        cache.admit = cache_admit

    def _observe(self, match) -> None:
        block = self.block_size
        hashes = prompt_block_hashes(self.requests[match.request_id], block, chain_hash)
        for k in range(len(hashes) - 1, match.cached_len // block - 1, -1):
            when = self.ghosts.get(hashes[k])
            if when is not None:
                near = self.evicted - when <= self.budget_blocks
                self.sums["near" if near else "far"] += (k + 1) * block - match.cached_len
                break
        self.sums["hit"] += match.cached_len
        thrashing = self.threshold is None or self.sums["far"] > self.threshold * (self.sums["hit"] + self.sums["near"])
        self.cold = thrashing and self.count % self.period != 0
        self.cold_requests += self.cold

    def run(self, request, cache_requests=None) -> None:
        cache_requests = cache_requests if cache_requests is not None else cache_requests_of(request)
        self.requests = {cr.request_id: cr for cr in cache_requests}
        self.cold = False
        super().run(request, cache_requests)
        self.count += 1
        for key in self.sums:
            self.sums[key] *= DECAY


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("workload")
    parser.add_argument("--trace", default=None)
    parser.add_argument("--num-requests", type=int, default=None)
    parser.add_argument("--sweep", required=True, help="budgets in GiB, comma-separated")
    parser.add_argument("--variants", default="1,4,16,4a4", help="K (every K-th request hot) or KaF (adaptive)")
    args = parser.parse_args()
    cost = load_model_cost(None)
    requests = list(load_workload(args.workload, trace=args.trace, num_requests=args.num_requests))
    for gib in (float(g) for g in args.sweep.split(",")):
        config = SimConfig(int(gib * GIB))
        replays = [BimodalReplay(v, cost, config, requests[0].n) for v in args.variants.split(",")]
        with _cyclic_gc_paused():
            for request in requests:
                shared = cache_requests_of(request)
                for replay in replays:
                    replay.run(request, shared)
        print(args.workload, gib, " ".join(
            f"{r.variant}:{r.result().token_hit_rate:.3f} (cold {r.cold_requests / len(requests):.2f})"
            for r in replays), flush=True)


if __name__ == "__main__":
    main()
