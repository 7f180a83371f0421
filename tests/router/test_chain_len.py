"""`ReplicaIndex.chain_len` (the stored chain a prompt's KV match sits on, from cache events) equals what the cache's
own trie holds (`bench.routing.chain_len`, the simulator's), for every prompt and limit while blocks come and go;
the checkpoint policy follows KV without a state only along the conversation's own chain."""

from __future__ import annotations

import random

import pytest

from hybridcache.bench.routing import chain_len
from hybridcache.cache import CacheRequest
from hybridcache.cache.request import Probe
from hybridcache.router.fleet_index import FleetIndex
from hybridcache.router.index import ReplicaIndex
from hybridcache.router.policy import CHAIN_SHARE, Chooser, RoutingConfig
from tests.cache.conftest import make_driver
from tests.cache.test_events import B, _probe_prompts, _workload


@pytest.mark.parametrize("num_blocks", [24, 512], ids=lambda n: f"blocks{n}")
def test_the_index_measures_the_chain_the_cache_holds(num_blocks):
    rng = random.Random(num_blocks)
    driver = make_driver(block_size=B, num_blocks=num_blocks, num_slots=12)
    cache = driver.cache
    log = cache.enable_events()
    index = ReplicaIndex(B)
    seen: list[tuple[int, ...]] = []
    seq = num_chains = num_capped = 0
    for k, prompt in enumerate(_workload(rng, 60)):
        driver.run(CacheRequest(f"r{k}", prompt), decode=[7, 8, 9][:rng.randrange(4)], branch=True)
        seen.append(prompt)
        batch = log.since(seq)
        assert not batch.lost
        index.apply(batch.events)
        seq = batch.next_seq
        for probe_prompt in _probe_prompts(rng, seen):
            request = CacheRequest("p", probe_prompt)
            for limit in (B, 4 * B, 10**6):
                expected = chain_len(cache, request, limit)
                assert index.chain_len(probe_prompt, limit) == expected, (k, limit)
                num_chains += 0 < expected < limit
                num_capped += expected == limit
    assert num_chains > 20 and num_capped > 20  # both whole chains and capped walks were compared
    assert index.chain_len((), 100) == 0
    fleet = FleetIndex()  # what the Ray router asks: each replica's chain, up to twice its KV match
    fleet.publish("r1", {"block_size": B, "reset": True, "next": 0, "epoch": "e",
                         "events": [e.to_json() for e in cache.snapshot_events()]})
    prompt = max(seen, key=len)
    probes = fleet.predict([list(prompt)], ["r1", "gone"])
    limit = int(probes[0].kv_len / CHAIN_SHARE) + 1
    assert fleet.chains([list(prompt)], probes, ["r1", "gone"]) == [
        chain_len(cache, CacheRequest("p", prompt), limit) if probes[0].kv_len else 0, 0]


def test_checkpoint_follows_kv_without_a_state_only_along_its_own_chain():
    chooser = Chooser(RoutingConfig("checkpoint"))
    probes = [Probe(kv_len=0, cached_len=0), Probe(kv_len=320, cached_len=0), Probe(kv_len=160, cached_len=0)]
    asked: list[tuple[int, int]] = []

    def chain_of(chains):
        def ask(i: int, limit: int) -> int:
            asked.append((i, limit))
            return min(chains[i], limit)
        return ask

    # no usable hit anywhere: the most KV (320 of 400 tokens), whose chain is 400 tokens long (a later turn)
    assert chooser.choose(probes, [1, 1, 0], 400, chain_of([0, 400, 400])) == 1
    assert asked == [(1, 641)]  # asked of that replica only, up to twice its KV
    # the same KV on a 2,000-token chain (a sibling sharing its prefix): the least loaded
    assert chooser.choose(probes, [1, 1, 0], 400, chain_of([0, 2000, 400])) == 2 == \
        chooser.choose(probes, [1, 1, 0], 400)  # without chains, never followed
    assert chooser.choose(probes, [1, 5, 0], 400, chain_of([0, 400, 400])) == 2  # too loaded: the least loaded
    assert chooser.choose(probes, [1, 1, 0], 1200, chain_of([0, 400, 400])) == 2  # 320 < 0.3 x 1200
    kv_prefix = Chooser(RoutingConfig("kv-prefix"))
    assert kv_prefix.choose(probes, [1, 1, 0], 400, chain_of([0, 2000, 400])) == 1  # kv-prefix ignores chains
