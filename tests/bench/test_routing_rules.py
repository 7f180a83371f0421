"""benchmarks/routing_rules.py: its `checkpoint` and `kv-prefix` rules are the simulator's own (same hits and
loads); `follow-kv` sends a request that hits nowhere to the replica holding its prefix's KV, where it saves the
branch point the next request sharing that prefix hits, and `checkpoint` does so only along the conversation's
own chain; random tie-breaks change only ties."""

from __future__ import annotations

import pytest

from benchmarks.routing_rules import RuleRouter
from hybridcache.bench.routing import Balance, simulate_routing
from hybridcache.bench.workloads import SimRequest
from tests.bench.test_routing import CONFIG, COST, _conversations, _workload


def test_the_shipped_rules_are_the_simulators_own():
    requests = _conversations(5, 4)
    for balance in (Balance(), Balance(abs_margin=0, rel_margin=1.0)):
        shipped = simulate_routing(_workload(requests), ["kv-prefix", "checkpoint"], 3, COST, CONFIG, balance=balance)
        rules = simulate_routing(_workload(requests), ["kv-prefix", "checkpoint"], 3, COST, CONFIG, balance=balance,
                                 make_router=RuleRouter)
        for name in ("kv-prefix", "checkpoint"):
            assert (rules[name].hit_tokens, rules[name].requests_per_replica) == \
                (shipped[name].hit_tokens, shipped[name].requests_per_replica)


def test_follow_kv_saves_the_branch_point_where_the_prefix_lives():
    """A's chain holds B's and C's 32-token prefix as KV with no state there: the checkpoint rule sends B to the
    idle replica (no usable hit), follow-kv to A's, where B saves a branch point at 32 that C then hits."""
    prefix = tuple(range(1, 33))
    requests = [SimRequest("a", prefix + tuple(range(100, 108)), (7, 8)),
                SimRequest("b", prefix + tuple(range(200, 208)), (7, 8)),
                SimRequest("c", prefix + tuple(range(300, 308)), (7, 8))]
    rules = ["usable-only", "follow-kv", "checkpoint", "usable-only~1"]
    results = simulate_routing(_workload(requests), rules, 2, COST, CONFIG, balance=Balance(abs_margin=100),
                               make_router=RuleRouter)
    assert results["usable-only"].requests_per_replica == (2, 1) and results["usable-only"].hit_tokens == 0
    assert results["follow-kv"].requests_per_replica == (3, 0) and results["follow-kv"].hit_tokens == 32
    # B's 32 tokens are 32 of A's 40-token chain (a later turn): the checkpoint rule follows them too
    assert results["checkpoint"].requests_per_replica == (3, 0) and results["checkpoint"].hit_tokens == 32
    assert sorted(results["usable-only~1"].requests_per_replica) == [1, 2]  # ties at random: a relabelling here


def test_checkpoint_leaves_a_sibling_of_a_longer_chain_to_the_least_loaded():
    """B shares 32 tokens with A's 120-token chain (a sibling, not a later turn): follow-kv piles it on A's
    replica, the checkpoint rule sends it to the idle one."""
    prefix = tuple(range(1, 33))
    requests = [SimRequest("a", prefix + tuple(range(100, 188)), (7, 8)),
                SimRequest("b", prefix + tuple(range(200, 208)), (7, 8))]
    results = simulate_routing(_workload(requests), ["follow-kv", "checkpoint"], 2, COST, CONFIG,
                               balance=Balance(abs_margin=100), make_router=RuleRouter)
    assert results["follow-kv"].requests_per_replica == (2, 0)
    assert results["checkpoint"].requests_per_replica == (1, 1)


def test_unknown_rules_are_refused():
    with pytest.raises(ValueError, match="unknown rule"):
        RuleRouter("nearest", [], Balance())
    with pytest.raises(ValueError, match="unknown rule"):
        RuleRouter("checkpoint~x", [], Balance())
