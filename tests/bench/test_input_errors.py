"""Bad inputs to the simulator are ValueErrors that say where and what: malformed trace lines name their file and
line, empty policy lists and memory beyond what can be simulated are refused, and a worker's ValueError keeps its
type and message."""

import json

import pytest

from hybridcache.bench.routing import simulate_routing
from hybridcache.bench.simulator import GIB, SimConfig, make_replay, parse_policies, simulate_many
from hybridcache.bench.specs import MAX_SIM_BLOCKS
from hybridcache.bench.workloads import SimRequest, Workload
from hybridcache.bench.workloads.mooncake import mooncake_workload
from hybridcache.bench.workloads.sharegpt import read_conversations
from hybridcache.bench.workloads.swe_agent import load_swe_agent
from hybridcache.bench.workloads.text import ChatEncoder
from hybridcache.engine.cost_model import load_model_cost

GOOD = json.dumps({"timestamp": 0, "input_length": 700, "output_length": 5, "hash_ids": [0, 1]})


@pytest.mark.parametrize(("line", "message"), [
    ('{"timestamp": 1, "input_length": 10, "output_length": 2}', r"trace.jsonl:3: missing 'hash_ids'"),
    ("[1, 2, 3]", r"trace.jsonl:3: expected a JSON object, got list"),
    ('{"timestamp": 1, "input_length": 10', r"trace.jsonl:3: not a JSON line"),
    ('{"timestamp": 1, "input_length": 10, "output_length": 2, "hash_ids": [0, "x"]}',
     r"trace.jsonl:3: hash ids must be integers, got 'x'"),
    ('{"timestamp": 1, "input_length": 10, "output_length": 2, "hash_ids": [-1]}',
     r"trace.jsonl:3: hash ids must be non-negative, got -1"),  # (numpy's "expected non-negative integer")
    ('{"timestamp": 1, "input_length": 100.5, "output_length": 2, "hash_ids": [0]}',
     r"trace.jsonl:3: 'input_length' must be an integer, got 100.5"),
    ('{"timestamp": 1, "input_length": 2000, "output_length": 2, "hash_ids": [0]}',
     r"trace.jsonl:3: input_length 2000 does not fit 1 blocks"),
])
def test_a_malformed_mooncake_line_names_its_file_and_line(tmp_path, line, message):
    path = tmp_path / "trace.jsonl"
    path.write_text(f"{GOOD}\n\n{line}\n")  # line 2 is blank
    with pytest.raises(ValueError, match=message):
        mooncake_workload(path)


def test_sharegpt_reads_a_json_array_and_names_a_bad_record(tmp_path):
    conversation = {"id": "a", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}
    array = tmp_path / "sharegpt.json"  # the ShareGPT V3 download: one JSON array
    array.write_text(json.dumps([conversation, conversation]))
    lines = tmp_path / "sharegpt.jsonl"
    lines.write_text(json.dumps(conversation) + "\n")
    ((conv_id, messages),) = read_conversations(lines)
    assert read_conversations(array) == [(conv_id, messages), (f"{conv_id}~2", messages)]  # ids kept unique
    lines.write_text(json.dumps(conversation) + "\n" + json.dumps({"id": "b", "conversations": "oops"}) + "\n")
    with pytest.raises(ValueError, match=r"sharegpt.jsonl:2: 'conversations' must be a list, got str"):
        read_conversations(lines)
    array.write_text(json.dumps([conversation, {"conversations": ["oops"]}]))
    with pytest.raises(ValueError, match=r"sharegpt.json:1: record 1: 'conversations' must hold message objects"):
        read_conversations(array)


def test_a_trajectory_that_is_not_json_names_its_file(tmp_path):
    (tmp_path / "a.traj").write_text(json.dumps({"history": [{"role": "user", "content": "x"}]}))
    (tmp_path / "b.traj").write_text("{'history': []}")
    with pytest.raises(ValueError, match=r"b.traj:1: not JSON"):
        load_swe_agent(tmp_path, ChatEncoder())


def test_empty_policy_lists_are_refused():
    with pytest.raises(ValueError, match="no policy given"):
        parse_policies(" , ", 64)
    workload = Workload("toy", 1, lambda: iter([SimRequest("r", (1, 2, 3), (4,))]))
    with pytest.raises(ValueError, match="no routing policy given"):
        simulate_routing(workload, [], 2, load_model_cost(None), SimConfig(GIB))


@pytest.mark.parametrize(("memory", "host"), [(10**6 * GIB, 0), (GIB, 10**9 * GIB)])
def test_memory_beyond_what_can_be_simulated_is_refused(memory, host):
    cost = load_model_cost(None)
    for spec in parse_policies("seed,hybridcache", 64):
        if host and not spec.one_budget:
            continue  # the host tier is the one-pool policies'
        with pytest.raises(ValueError, match=f"makes .* blocks of 64 tokens; the simulator holds at most "
                                             f"{MAX_SIM_BLOCKS:,}"):
            make_replay(spec, cost, SimConfig(memory, 64, host_memory_bytes=host))


def test_a_workers_value_error_keeps_its_type_and_message():
    workload = Workload("toy", 1, lambda: iter([SimRequest("r", (1, 2, 3), (4,))]))
    specs = parse_policies("hybridcache,seed", 64)
    jobs = [(spec, SimConfig(10**6 * GIB, 64)) for spec in specs]
    with pytest.raises(ValueError, match=r"simulating (hybridcache|seed): --memory-gib makes"):
        simulate_many(workload, jobs, load_model_cost(None), num_workers=2)
