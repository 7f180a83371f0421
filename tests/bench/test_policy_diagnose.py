"""benchmarks/policy_diagnose.py: its per-policy figures agree with the simulator's own run, and its gap
classes account for every token the yardstick skipped beyond the diagnosed policy."""

from __future__ import annotations

import json
from collections import Counter

from benchmarks.policy_diagnose import diagnose
from hybridcache.bench.replay import CacheReplay
from hybridcache.bench.simulator import GIB, SimConfig, parse_policies, simulate
from hybridcache.bench.workloads import load_workload
from hybridcache.engine.cost_model import load_model_cost


def test_diagnose_matches_the_simulator_and_accounts_for_the_gap(monkeypatch):
    workload = load_workload("mooncake", num_requests=120)  # the slice shipped in the repository
    requests = list(workload)
    config = SimConfig(int(GIB // 16))  # tight: both policies evict
    cost = load_model_cost(None)
    report = diagnose(requests, config, "hybridcache,bounded-oracle", cost)
    # the report's hits by reason are the cache's (every admission with a hit); the simulator's leave out the
    # sequences admitted with a hit and then run without the cache (no room for their blocks): count those
    dropped: dict[str, Counter[str]] = {"hybridcache": Counter(), "bounded-oracle": Counter()}
    drop = CacheReplay._drop

    def counting_drop(self, request, seq, active):
        if seq.hit_reason is not None:
            dropped[self.spec.name][seq.hit_reason] += 1
        drop(self, request, seq, active)

    monkeypatch.setattr(CacheReplay, "_drop", counting_drop)
    sim = simulate(workload, parse_policies("hybridcache,bounded-oracle", 64), cost, config)
    assert sum(dropped["hybridcache"].values()) > 0, "the budget must drop a sequence after its hit"
    for name in ("hybridcache", "bounded-oracle"):
        mine, theirs = report[name], sim.policies[name]
        assert mine["hit_rate"] == round(theirs.token_hit_rate, 4)
        assert Counter(mine["hits_by_reason"]) == Counter(theirs.hits_by_reason) + dropped[name]
        assert mine["evictions_by_kind"] == theirs.evictions_by_kind
        assert sum(mine["hit_tokens_by_reason"].values()) == theirs.hit_tokens
        for reason, unhit in mine["released_unhit_by_reason"].items():
            assert unhit <= mine["released_by_reason"][reason]
        assert sum(theirs.evictions_by_kind.values()) > 0
        assert mine["avg_kv_mib"] > 0
    gap = report["gap"]
    assert sum(gap["tokens"].values()) == sum(gap["tokens_by_oracle_reason"].values())
    skipped_more = report["bounded-oracle"]["hit_rate"] > report["hybridcache"]["hit_rate"]
    assert not skipped_more or sum(gap["tokens"].values()) > 0


def test_mooncake_reuse_distances(tmp_path):
    from benchmarks.policy_diagnose import mooncake_reuse

    lines = [  # request 2 reuses request 0's first three blocks, request 3 the same prefix again
        {"timestamp": 0, "input_length": 1500, "output_length": 10, "hash_ids": [0, 1, 2]},
        {"timestamp": 1, "input_length": 600, "output_length": 20, "hash_ids": [0, 9]},
        {"timestamp": 2, "input_length": 2000, "output_length": 5, "hash_ids": [0, 1, 2, 3]},
        {"timestamp": 3, "input_length": 1536, "output_length": 5, "hash_ids": [0, 1, 2]},
    ]
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps(line) + "\n" for line in lines))
    report = mooncake_reuse(str(trace), None)
    assert report["reuses"] == 2
    assert report["reused_tokens"] == 1536 + 1536
    assert report["reuses_of_a_reused_prefix"] == 1  # request 3: the prefix [0, 1, 2] was reused by request 2
    # request 2: 620 tokens since request 0; request 3: 0 since request 2 (no request in between)
    assert report["token_weighted_distance_quantiles"]["0.1"] == {"traffic_tokens": 0, "requests": 1}
    assert report["token_weighted_distance_quantiles"]["0.9"] == {"traffic_tokens": 620, "requests": 2}
