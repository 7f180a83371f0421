"""The router's choice: longest usable hit, the balance margin, misses to the least-loaded, round-robin."""

from __future__ import annotations

import pytest

from hybridcache.cache.request import Probe
from hybridcache.router.policy import Chooser, RoutingConfig


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
    assert replica_argv(argv, 9001) == ["serve", "MODEL", "--block-size", "16", "--host", "127.0.0.1",
                                        "--port", "9001"]
