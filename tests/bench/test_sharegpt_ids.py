"""ShareGPT records that share an id (or lack one) still make sessions of distinct ids: `bench` died with "request
id 'sharegpt-abc/0' is already in use" on two records of id "abc" (hunt 129)."""

import json

import pytest

from hybridcache.bench.workloads import ChatOptions, load_workload
from hybridcache.bench.workloads.sharegpt import read_conversations


def _conversation(question, **fields):
    return {**fields, "conversations": [{"from": "human", "value": question}, {"from": "gpt", "value": "Four."}]}


@pytest.fixture
def trace(tmp_path):
    records = [_conversation("Hello there?", id="abc"), _conversation("Two plus two?", id="abc"),
               _conversation("And three?", id="abc~2"), _conversation("No id?"), _conversation("Id 3?", id="3")]
    path = tmp_path / "dup.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_repeated_and_missing_ids_are_made_unique(trace):
    ids = [conv_id for conv_id, _ in read_conversations(trace)]
    assert ids == ["abc", "abc~2", "abc~2~2", "3", "3~2"]
    sessions = load_workload("sharegpt", trace=trace).sessions
    assert len({s.session_id for s in sessions}) == len(sessions) == 5


def test_bench_runs_conversations_of_one_id(trace):
    pytest.importorskip("torch")
    from hybridcache.bench.engine_bench import BenchConfig, run_bench

    workload = load_workload("sharegpt", trace=trace, chat=ChatOptions(num_sessions=2))
    result = run_bench(None, workload, BenchConfig(("hybridcache",), max_reply_tokens=2))
    assert result.modes["hybridcache"].num_calls == 2
