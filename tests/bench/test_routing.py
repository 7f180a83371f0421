"""The simulator's replicas and routing policies: turns of a conversation follow their checkpoints, the
balance margin bounds the load, the CLI writes its table and JSON."""

from __future__ import annotations

import json

import pytest

from hybridcache.bench.routing import Balance, simulate_routing
from hybridcache.bench.simulator import SimConfig, parse_policies, simulate
from hybridcache.bench.workloads import SimRequest, Workload
from hybridcache.engine.cost_model import ModelCost

COST = ModelCost("toy", kv_bytes_per_token=16, state_bytes=256, flops_per_token=10.0, attn_flops_per_token_pair=1.0)
CONFIG = SimConfig(1 << 20, block_size=4, chunk_budget=100, kv_tokens_per_slot=16, check_integrity=True)


def _workload(requests) -> Workload:
    requests = tuple(requests)
    return Workload("toy", len(requests), lambda: iter(requests))


def _conversations(num_sessions: int, num_turns: int) -> list[SimRequest]:
    """Interleaved sessions: turn k+1's prompt is turn k's prompt, its output and 3 new tokens."""
    prompts = {s: tuple(range(100 * s + 1, 100 * s + 11)) for s in range(num_sessions)}
    requests = []
    for turn in range(num_turns):
        for s in range(num_sessions):
            output = (1000 + 10 * s + turn, 2000)
            requests.append(SimRequest(f"s{s}t{turn}", prompts[s], output, session_id=f"s{s}", turn=turn))
            prompts[s] = prompts[s] + output[:1] + (3000 + s, 3001, 3002)
    return requests


def test_checkpoint_routing_hits_like_one_cache_and_round_robin_does_not():
    """Three sessions over two replicas with room to spare: the checkpoint router sends every turn where
    its history is, so it hits exactly what one big cache hits; round-robin alternates replicas and loses
    turns; kv-prefix lies in between or equal."""
    requests = _conversations(3, 4)
    one = simulate(_workload(requests), parse_policies("hybridcache", 4), COST, CONFIG).policies["hybridcache"]
    results = simulate_routing(_workload(requests), ["round-robin", "session", "kv-prefix", "checkpoint"], 2,
                               COST, CONFIG, balance=Balance(abs_margin=100))
    hits = {name: r.hit_tokens for name, r in results.items()}
    assert hits["checkpoint"] == hits["session"] == one.hit_tokens > 0
    assert hits["round-robin"] < hits["kv-prefix"] <= hits["checkpoint"]
    assert all(r.prompt_tokens == one.prompt_tokens for r in results.values())
    assert results["round-robin"].requests_per_replica == (6, 6)
    assert sum(results["checkpoint"].requests_per_replica) == 12


@pytest.mark.parametrize("abs_margin,rel_margin", [(0, 1.0), (2, 1.5), (4, 1.2)])
def test_balance_margin_bounds_the_load(abs_margin, rel_margin):
    """Every request shares one long prefix, so the best replica is always the same one: the margin alone
    spreads the load, and no replica ever passes the least-loaded one by more than it allows."""
    shared = tuple(range(1, 40))
    requests = [SimRequest(f"r{i}", shared + (500 + i,), (7, 8)) for i in range(40)]
    balance = Balance(abs_margin, rel_margin)
    result = simulate_routing(_workload(requests), ["checkpoint"], 4, COST, CONFIG, balance=balance)["checkpoint"]
    loads = result.requests_per_replica
    assert sum(loads) == 40
    assert max(loads) - min(loads) <= abs_margin + 1 or max(loads) <= rel_margin * min(loads) + 1
    assert result.max_over_mean == max(loads) / 10
    assert result.hit_tokens > 0


def test_unknown_routing_policy_is_refused():
    with pytest.raises(ValueError, match="unknown routing policy 'nearest'"):
        simulate_routing(_workload(_conversations(1, 1)), ["nearest"], 2, COST, CONFIG)
    with pytest.raises(ValueError, match="replicas must be >= 1"):
        simulate_routing(_workload(_conversations(1, 1)), ["checkpoint"], 0, COST, CONFIG)


def test_cli_routes_the_shipped_swe_agent_slice(tmp_path, capsys):
    from hybridcache.cli import main

    out = tmp_path / "routing.json"
    assert main(["simulate", "--workload", "swe-agent", "--num-requests", "40", "--replicas", "2",
                 "--memory-gib", "0.05", "--json", str(out), "--no-progress"]) == 0
    table = capsys.readouterr().out
    assert "2 replicas" in table and "checkpoint" in table
    record = json.loads(out.read_text())
    routing = record["routing"]
    assert set(routing) == {"round-robin", "session", "kv-prefix", "checkpoint"}
    assert all(sum(r["requests_per_replica"]) == 40 for r in routing.values())
    assert routing["checkpoint"]["token_hit_rate"] >= routing["round-robin"]["token_hit_rate"]


def test_cache_threshold_above_every_hit_routes_by_load_alone():
    """No hit covers the whole prompt (one token is always computed), so with min_hit_fraction = 1 every request
    goes to the least-loaded replica: loads stay equal, and conversations lose the turns that moved."""
    requests = _conversations(3, 4)
    balance = Balance(abs_margin=100, min_hit_fraction=1.0)
    by_load = simulate_routing(_workload(requests), ["checkpoint"], 2, COST, CONFIG, balance=balance)["checkpoint"]
    by_hit = simulate_routing(_workload(requests), ["checkpoint"], 2, COST, CONFIG,
                              balance=Balance(abs_margin=100))["checkpoint"]
    assert by_load.requests_per_replica == (6, 6)
    assert by_load.hit_tokens < by_hit.hit_tokens
