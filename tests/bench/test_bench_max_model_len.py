"""`hybridcache bench` drops the calls whose prompt + max_tokens pass the engine's max_model_len and says how many
(`--max-model-len`); `bench --workload mooncake` on the shipped slice stopped before its first request: half its
prompts pass the CPU's 8,192 tokens, and every request was queued unfiltered (hunt 129)."""

import json

import pytest

from hybridcache.cli import main

# prompt lengths: 600 (kept), 2,047 + max_tokens 2 = 2,049 (dropped), 2,046 + 2 = 2,048 (kept, exactly the limit)
LINES = [{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]},
         {"timestamp": 10, "input_length": 2047, "output_length": 5, "hash_ids": [1, 2, 3, 4]},
         {"timestamp": 20, "input_length": 2046, "output_length": 5, "hash_ids": [1, 2, 3, 5]}]
ENGINE = ("--block-size", "16", "--max-model-len", "2048", "--num-blocks", "1024")


@pytest.fixture
def trace(tmp_path):
    path = tmp_path / "mooncake.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in LINES))
    return path


def test_fits_counts_the_reply():
    from hybridcache.bench.engine_bench import fits

    assert fits(2046, 2, 2048) and not fits(2047, 2, 2048) and fits(10**6, 2, None)


def test_bench_drops_the_calls_over_max_model_len_and_says_how_many(tmp_path, trace, capsys):
    pytest.importorskip("torch")
    out = tmp_path / "out"
    code = main(["bench", "--workload", "mooncake", "--trace", str(trace), "--modes", "none,hybridcache",
                 *ENGINE, "--max-reply-tokens", "2", "--out-dir", str(out), "--no-progress"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "none: 1 of 3 requests dropped: prompt + max_tokens over max_model_len 2,048" in printed
    record = json.loads((out / "bench_mooncake.json").read_text())
    for mode in ("none", "hybridcache"):
        assert record["modes"][mode]["num_dropped"] == 1 and record["modes"][mode]["max_model_len"] == 2048
        assert record["modes"][mode]["num_calls"] == 2
    assert record["modes"]["hybridcache"]["token_hit_rate"] > 0  # the third request shares 1,536 tokens


def test_server_bench_drops_what_the_server_would_refuse(tmp_path, trace):
    pytest.importorskip("torch")
    from hybridcache.bench.engine_bench import BenchConfig
    from hybridcache.bench.server_bench import run_server_bench
    from hybridcache.bench.workloads import load_workload
    from tests.server.server_process import running_servers

    workload = load_workload("mooncake", trace=trace)
    with running_servers(ENGINE, tmp_dir=tmp_path) as (server,):
        served = run_server_bench(server.base_url, workload, BenchConfig(max_reply_tokens=2)).modes["server"]
    assert (served.num_calls, served.num_dropped, served.max_model_len) == (2, 1, 2048)


def test_a_session_ends_before_the_turn_that_passes_max_model_len(sharegpt_trace):
    pytest.importorskip("torch")
    from hybridcache.bench.engine_bench import BenchConfig, run_bench
    from hybridcache.bench.workloads import ChatOptions, load_workload

    workload = load_workload("sharegpt", trace=sharegpt_trace,
                             chat=ChatOptions(num_sessions=3, max_turns=4, max_message_chars=400, max_prompt_len=4096))
    # the longest last prompt, with the generated replies of 4 tokens (ignore_eos) before it; one token too long
    longest = max(len(s.first_prompt_ids) + sum(4 + len(t.after_ids) for t in s.turns[:-1]) for s in workload.sessions)
    config = BenchConfig(("hybridcache",), max_reply_tokens=4, engine_options=dict(
        block_size=16, max_model_len=longest + 4 - 1, num_blocks=1024))
    result = run_bench(None, workload, config).modes["hybridcache"]
    assert result.num_dropped >= 1
    assert result.num_calls + result.num_dropped == len(workload)


def test_bench_takes_serves_spellings_of_token_counts():
    """`bench --max-model-len 8k` / `--max-num-batched-tokens 1K` were refused (plain integers only) while `serve`
    takes them, as vLLM's flags do."""
    from hybridcache.cli import build_parser

    args = build_parser().parse_args(["bench", "--max-model-len", "8k", "--max-num-batched-tokens", "1K"])
    assert (args.max_model_len, args.max_num_batched_tokens) == (8000, 1024)
    assert build_parser().parse_args(["bench", "--max-model-len", "auto"]).max_model_len is None
