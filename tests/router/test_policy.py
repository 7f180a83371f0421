"""The router's choice: longest usable hit, the balance margin, misses to the least-loaded, round-robin."""

from __future__ import annotations

import httpx
import pytest
from fastapi import FastAPI, Request

from hybridcache.cache.events import CacheEvent, EventKind
from hybridcache.cache.request import Probe
from hybridcache.cache.trie import root_hash
from hybridcache.router.app import RouterConfig, build_router_app
from hybridcache.router.policy import Chooser, RoutingConfig
from tests.router.serving import replica_app, serving_app


def test_checkpoint_prefers_the_usable_hit_over_more_kv():
    probes = [Probe(kv_len=640, cached_len=0), Probe(kv_len=320, cached_len=330), Probe(kv_len=0, cached_len=0)]
    assert Chooser(RoutingConfig("checkpoint")).choose(probes, [0, 0, 0], 400) == 1
    assert Chooser(RoutingConfig("kv-prefix")).choose(probes, [0, 0, 0], 400) == 0


def test_balance_margin_and_misses():
    chooser = Chooser(RoutingConfig("checkpoint", abs_margin=2, rel_margin=1.5))
    hit = [Probe(64, 70), Probe(0, 0)]
    assert chooser.choose(hit, [2, 0], 100) == 0  # 2 more in flight: within the absolute margin
    assert chooser.choose(hit, [3, 0], 100) == 1  # 3 more and more than 1.5x: the least-loaded
    assert chooser.choose(hit, [9, 7], 100) == 0  # 2 more: within
    assert chooser.choose(hit, [12, 8], 100) == 0  # 4 more but only 1.5x: within the relative margin
    assert chooser.choose(hit, [13, 8], 100) == 1
    assert chooser.choose([Probe(0, 0)] * 3, [4, 1, 1], 100) == 1  # a miss: least loaded, lowest index
    ties = [Probe(64, 70), Probe(64, 70)]
    assert chooser.choose(ties, [1, 0], 100) == 1  # equal hits: the less loaded
    assert chooser.choose(hit, [1, 0], 200) == 0  # 70 of 200 tokens: over the 0.3 cache threshold
    assert chooser.choose(hit, [1, 0], 300) == 1  # 70 of 300: under it, so the least-loaded


def test_round_robin_and_bad_config():
    chooser = Chooser(RoutingConfig("round-robin"))
    assert [chooser.choose([Probe(0, 50)] * 3, [0, 0, 0], 100) for _ in range(4)] == [0, 1, 2, 0]
    with pytest.raises(ValueError, match="unknown routing policy 'random'"):
        RoutingConfig("random")
    with pytest.raises(ValueError, match="margins"):
        RoutingConfig(rel_margin=0.5)
    with pytest.raises(ValueError, match="min_hit_fraction"):
        RoutingConfig(min_hit_fraction=1.5)
    with pytest.raises(ValueError, match="one probe per load"):
        chooser.choose([], [], 1)


def test_replica_command_line_drops_the_router_options():
    from hybridcache.router.cli import replica_argv

    argv = ["serve", "MODEL", "--data-parallel-size", "3", "--port=9000", "--host", "0.0.0.0", "--routing",
            "kv-prefix", "--cache-threshold=0.5", "--block-size", "16"]
    assert replica_argv(argv, 9001, 9.5) == ["serve", "MODEL", "--block-size", "16", "--host", "127.0.0.1",
                                             "--port", "9001", "--shutdown-timeout", "9.5"]


def test_load_ties_go_to_the_smallest_index_then_the_first():
    """Misses on replicas of equal load go to the one indexing the fewest blocks (SGLang's smallest tree), then the
    first listed (every one went to replica 0: an idle fleet's new conversations all landed there)."""
    chooser = Chooser(RoutingConfig("checkpoint"))
    miss = [Probe(0, 0)] * 3
    assert chooser.choose(miss, [0, 0, 0], 100, sizes=[40, 12, 12]) == 1
    assert chooser.choose(miss, [0, 0, 0], 100, sizes=[0, 0, 0]) == 0
    assert chooser.choose(miss, [1, 0, 0], 100, sizes=[0, 50, 30]) == 2  # load first, then size
    assert chooser.choose(miss, [0, 1, 1], 100, sizes=[90, 0, 0]) == 0
    hit = [Probe(64, 70), Probe(0, 0), Probe(0, 0)]
    assert chooser.choose(hit, [0, 0, 0], 100, sizes=[90, 0, 0]) == 0  # a usable hit still wins
    assert Chooser(RoutingConfig("kv-prefix")).choose(miss, [2, 2, 2], 100, sizes=[5, 3, 4]) == 1
    with pytest.raises(ValueError, match="one size"):
        chooser.choose(miss, [0, 0, 0], 100, sizes=[1, 2])


def test_the_router_spreads_new_conversations_over_idle_replicas():
    """Through the HTTP router: fake replicas that index what they serve (their events grow by a block per request)
    take the first turns of new conversations in turn, not all on replica 0."""
    def indexing_replica() -> FastAPI:
        app = replica_app()

        @app.post("/v1/completions")
        async def completions(request: Request):
            prompt = (await request.json())["prompt"]
            app.state.events.append(CacheEvent(EventKind.BLOCK_STORED, block_hash=hash(tuple(prompt)) & (2**63 - 1),
                                               parent_hash=root_hash(None), depth=1).to_json())
            return {"choices": [{"index": 0, "text": "ok"}]}

        return app

    replicas = [indexing_replica() for _ in range(3)]
    with serving_app(replicas[0]) as a, serving_app(replicas[1]) as b, serving_app(replicas[2]) as c:
        config = RouterConfig((a, b, c), RoutingConfig("checkpoint"), poll_interval_s=30.0)
        with serving_app(build_router_app(config, tokenizer=None)) as router:
            for k in range(6):
                prompt = [1000 * (k + 1) + i for i in range(40)]  # six unrelated first turns, one at a time
                response = httpx.post(f"{router}/v1/completions", json={"prompt": prompt, "max_tokens": 1}, timeout=30)
                assert response.status_code == 200
            assert [len(r.state.events) for r in replicas] == [2, 2, 2]
