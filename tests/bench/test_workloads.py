"""Loaders and generators: lengths, sharing structure, determinism, cuts."""

import json

import pytest

from hybridcache.bench.workloads import ChatOptions, default_trace_path, load_workload
from hybridcache.bench.workloads.mooncake import MOONCAKE_BLOCK_LEN, mooncake_workload
from hybridcache.bench.workloads.text import ChatEncoder


def _shared(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _trace(name):
    """The slice shipped in the package: present in every checkout."""
    path = default_trace_path(name)
    assert path.exists(), f"the shipped trace slice {path} is missing"
    return path


def test_mooncake_lengths_sharing_and_determinism(tmp_path):
    path = tmp_path / "trace.jsonl"
    rows = [
        {"timestamp": 0, "input_length": 700, "output_length": 5, "hash_ids": [0, 1]},
        {"timestamp": 1500, "input_length": 1100, "output_length": 1, "hash_ids": [0, 1, 2]},
        {"timestamp": 3000, "input_length": 600, "output_length": 3, "hash_ids": [0, 3]},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    requests = list(mooncake_workload(path, seed=7, time_scale=2.0))
    assert [r.prompt_len for r in requests] == [700, 1100, 600]
    assert [len(r.output_ids) for r in requests] == [5, 1, 3]
    assert [r.arrival_s for r in requests] == [0.0, 3.0, 6.0]
    # request 1 extends request 0's (partial) block 1, request 2 shares only block 0
    assert requests[1].prompt_ids[:700] == requests[0].prompt_ids
    assert _shared(requests[2].prompt_ids, requests[0].prompt_ids) == MOONCAKE_BLOCK_LEN
    assert [r.prompt_ids for r in mooncake_workload(path, seed=7)] == [r.prompt_ids for r in requests]
    other = list(mooncake_workload(path, seed=8))
    assert other[0].prompt_ids != requests[0].prompt_ids
    # a block depends on its id only, not on the cut
    assert list(mooncake_workload(path, seed=7, num_requests=1))[0].prompt_ids == requests[0].prompt_ids


def test_mooncake_real_trace_first_requests_share_the_system_block():
    requests = list(load_workload("mooncake", trace=_trace("mooncake"), num_requests=20))
    assert len(requests) == 20
    assert all(_shared(r.prompt_ids, requests[0].prompt_ids) >= MOONCAKE_BLOCK_LEN for r in requests[1:])


def test_sharegpt_turns_build_on_the_history(sharegpt_trace):
    encoder = ChatEncoder()
    chat = ChatOptions(num_sessions=5, max_turns=3)
    workload = load_workload("sharegpt", trace=sharegpt_trace, chat=chat)
    assert len(workload.sessions) == 5 and all(1 <= len(s.turns) <= 3 for s in workload.sessions)
    requests = list(workload)
    assert len(requests) == len(workload)
    assert [r.arrival_s for r in requests] == sorted(r.arrival_s for r in requests)
    by_session = {}
    for r in requests:
        by_session.setdefault(r.session_id, []).append(r)
    for turns in by_session.values():
        for prev, nxt in zip(turns, turns[1:]):
            # the next prompt is the previous prompt + the whole reply (end-of-turn token included)
            assert nxt.prompt_ids[: prev.prompt_len + len(prev.output_ids)] == prev.prompt_ids + prev.output_ids
    first = requests[0]
    assert encoder.encode("<|im_start|>")[0] == first.prompt_ids[0]
    assert first.prompt_ids[-len(encoder.encode("<|im_start|>assistant\n")):] == encoder.encode(
        "<|im_start|>assistant\n")
    again = load_workload("sharegpt", trace=sharegpt_trace, chat=chat)
    assert [r.prompt_ids for r in again] == [r.prompt_ids for r in requests]


def test_sharegpt_prompt_cut_and_request_cut(sharegpt_trace):
    chat = ChatOptions(num_sessions=20, max_message_chars=200, max_prompt_len=800)
    workload = load_workload("sharegpt", trace=sharegpt_trace, chat=chat, num_requests=15)
    requests = list(workload)
    assert len(requests) == 15 == sum(len(s.turns) for s in workload.sessions)
    assert all(r.prompt_len + len(r.output_ids) <= 800 for r in requests)


def test_encoder_matches_the_builtin_model_folder_tokenizer():
    from hybridcache.models.builtin import ensure_builtin_model
    from hybridcache.tokenizer import Tokenizer

    messages = [{"role": "user", "content": "héllo"}, {"role": "assistant", "content": "hi"},
                {"role": "user", "content": "again"}]
    tok = Tokenizer(ensure_builtin_model())
    ours = ChatEncoder()
    assert ours.encode(ours.render(messages)) == tuple(tok.encode(tok.apply_chat_template(messages)))


def test_swe_agent_prompts_grow_and_runs_share_system_prompts():
    requests = list(load_workload("swe-agent", trace=_trace("swe-agent")))
    assert len(requests) > 100
    sessions = {}
    for r in requests:
        sessions.setdefault(r.session_id, []).append(r)
    for calls in sessions.values():
        assert [c.turn for c in calls] == list(range(len(calls)))
        for prev, nxt in zip(calls, calls[1:]):
            assert nxt.prompt_ids[: prev.prompt_len] == prev.prompt_ids
    firsts = [calls[0].prompt_ids for calls in sessions.values()]
    assert max(_shared(a, b) for i, a in enumerate(firsts) for b in firsts[i + 1:]) > 1000


def test_shared_prefix_system_prompts_end_off_the_block_grid():
    workload = load_workload("shared-prefix", seed=3)
    requests = list(workload)
    assert len(requests) == 16 * 32
    groups = {}
    for r in requests:
        groups.setdefault(r.session_id, []).append(r)
    assert len(groups) == 16
    for members in groups.values():
        shared = min(_shared(members[0].prompt_ids, m.prompt_ids) for m in members[1:])
        assert shared >= 1000  # at least the system prompt
    assert [r.prompt_ids for r in load_workload("shared-prefix", seed=3)] == [r.prompt_ids for r in requests]
    assert [r.prompt_ids for r in load_workload("shared-prefix", seed=4)] != [r.prompt_ids for r in requests]
    assert len(list(load_workload("shared-prefix", seed=3, num_requests=10))) == 10


def test_shared_prefix_system_lengths_are_moved_off_multiples_of_16():
    from hybridcache.bench.workloads.synthetic import _off_grid, shared_prefix_workload

    assert [_off_grid(n) for n in (15, 16, 17, 64, 528)] == [15, 17, 17, 65, 529]
    requests = list(shared_prefix_workload(seed=0, num_groups=3, questions_per_group=4, system_len=(64, 64)))
    groups = {}
    for r in requests:
        groups.setdefault(r.session_id, []).append(r)
    for members in groups.values():
        assert all(_shared(members[0].prompt_ids, m.prompt_ids) >= 65 for m in members[1:])
    firsts = [members[0].prompt_ids for members in groups.values()]
    assert all(_shared(a, b) < 65 for i, a in enumerate(firsts) for b in firsts[i + 1:])


def test_group_sampling_as_separate_requests_and_as_n():
    separate = list(load_workload("group-sampling"))
    as_n = list(load_workload("group-sampling-n"))
    assert len(separate) == 32 * 8 and len(as_n) == 32
    assert all(r.n == 8 and len(r.outputs()) == 8 for r in as_n)
    assert all(r.arrival_s == 0.0 for r in separate + as_n)
    assert [r.prompt_ids for r in separate[:8]] == [as_n[0].prompt_ids] * 8
    assert [r.output_ids for r in separate[:8]] == list(as_n[0].outputs())


def test_unknown_workload_and_missing_trace_are_errors(tmp_path):
    with pytest.raises(ValueError, match="sharegpt"):
        load_workload("nope")
    with pytest.raises(ValueError, match="--trace"):
        load_workload("sharegpt")  # not shipped
    with pytest.raises(FileNotFoundError, match="--trace"):
        load_workload("mooncake", trace=tmp_path / "missing.jsonl")


def test_shipped_slices_carry_their_licences_and_stay_small():
    from hybridcache.bench.workloads import shipped_traces_dir

    root = shipped_traces_dir()
    assert (root / "mooncake" / "LICENSE-APACHE").is_file() and (root / "swe_agent" / "LICENSE").is_file()
    assert "MIT License" in (root / "swe_agent" / "LICENSE").read_text()
    assert "Apache License" in (root / "mooncake" / "LICENSE-APACHE").read_text()
    assert sum(f.stat().st_size for f in root.rglob("*") if f.is_file()) < 2_000_000


def test_no_code_or_test_reads_outside_the_repository():
    """Nothing may depend on a folder next to the checkout (a fresh clone has none)."""
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    needles = ("shared/" + "traces", "../" + "shared", "parent / " + '"shared"')
    offenders = [str(f.relative_to(repo)) for folder in ("hybridcache", "tests", "scripts")
                 for f in (repo / folder).rglob("*") if f.suffix in (".py", ".sh")
                 and any(n in f.read_text(encoding="utf-8") for n in needles)]
    assert offenders == []


def test_swe_agent_sessions_are_cut_to_max_turns():
    chat = ChatOptions(num_sessions=4, max_turns=2, max_message_chars=100)
    workload = load_workload("swe-agent", chat=chat)
    assert len(workload.sessions) == 4 and all(len(s.turns) == 2 for s in workload.sessions)
