"""`hybridcache simulate` output and the engine benchmark on the built-in model."""

import json

import pytest

from hybridcache.cli import main


def test_simulate_cli_writes_the_documented_json_and_a_plot(tmp_path, capsys):
    out, png = tmp_path / "sim.json", tmp_path / "sim.png"
    code = main(["simulate", "--workload", "shared-prefix", "--num-requests", "200", "--memory-gib", "0.2",
                 "--policies", "none,seed,hybridcache,oracle", "--json", str(out), "--plot", str(png),
                 "--sweep", "0.1,0.2", "--jobs", "2", "--no-progress"])
    assert code == 0
    record = json.loads(out.read_text())
    assert record["workload"] == "shared-prefix"
    assert set(record["policies"]) == {"none", "seed", "hybridcache", "oracle"}
    keys = {"token_hit_rate", "prefill_tokens_computed", "flops_saved", "checkpoints_saved", "evictions",
            "bytes_peak"}
    assert all(keys <= set(p) for p in record["policies"].values())
    rates = {name: p["token_hit_rate"] for name, p in record["policies"].items()}
    assert rates["none"] == 0.0 and rates["hybridcache"] > rates["seed"] and rates["oracle"] >= rates["hybridcache"]
    assert [s["memory_gib"] for s in record["sweep"]] == pytest.approx([0.1, 0.2], rel=1e-6)
    assert png.stat().st_size > 1000
    assert "hybridcache" in capsys.readouterr().out


def test_simulate_does_not_import_torch():
    import subprocess
    import sys

    code = ("import sys; from hybridcache.cli import main; "
            "main(['simulate', '--workload', 'group-sampling', '--num-requests', '20', '--no-progress',"
            " '--jobs', '1']);"
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


def test_engine_bench_modes_agree_and_the_cache_hits(tmp_path, sharegpt_trace):
    pytest.importorskip("torch")
    from hybridcache.bench.engine_bench import BenchConfig, run_bench
    from hybridcache.bench.workloads import ChatOptions, load_workload

    workload = load_workload("sharegpt", trace=sharegpt_trace,
                             chat=ChatOptions(num_sessions=3, max_turns=2, max_message_chars=300))
    result = run_bench(None, workload, BenchConfig(("none", "hybridcache"), max_reply_tokens=8))
    assert result.outputs_identical
    none, cached = result.modes["none"], result.modes["hybridcache"]
    assert none.token_hit_rate == 0.0 and cached.token_hit_rate > 0.2
    assert cached.prefill_tokens_computed < none.prefill_tokens_computed
    assert cached.hit_rate_by_turn[0] == 0.0 and cached.hit_rate_by_turn[1] > 0.5
    assert none.num_calls == cached.num_calls == len(workload)


def test_server_bench_matches_the_offline_engine_and_reports_hits(tmp_path, sharegpt_trace):
    """`hybridcache bench --server` against a real server: same greedy tokens as the offline engine in the same
    mode, and cached_tokens from the responses' usage."""
    pytest.importorskip("torch")
    from hybridcache.bench.engine_bench import BenchConfig, run_bench
    from hybridcache.bench.server_bench import run_server_bench
    from hybridcache.bench.workloads import ChatOptions, load_workload
    from tests.server.server_process import running_servers

    workload = load_workload("sharegpt", trace=sharegpt_trace,
                             chat=ChatOptions(num_sessions=3, max_turns=2, max_message_chars=100))
    config = BenchConfig(("hybridcache",), max_reply_tokens=6, engine_options=dict(
        block_size=16, max_model_len=2048, num_blocks=1024))
    offline = run_bench(None, workload, config)
    server_args = ("--block-size", "16", "--max-model-len", "2048", "--num-blocks", "1024")
    with running_servers(server_args, tmp_dir=tmp_path) as (server,):
        online = run_server_bench(server.base_url, workload, config, concurrency=8)
    served = online.modes["server"]
    assert served.num_calls == offline.modes["hybridcache"].num_calls == len(workload)
    assert served.hit_rate_by_turn[1] > 0.5
    assert served.ttft_p50_s > 0 and served.e2e_p50_s >= served.ttft_p50_s
    assert served.token_hit_rate == pytest.approx(offline.modes["hybridcache"].token_hit_rate)
    # turn 1's prompts hold turn 0's generated ids, joined from the streamed chunks (each carries its new ids)
    assert served.prefill_tokens_computed == offline.modes["hybridcache"].prefill_tokens_computed


def test_server_bench_names_an_unreachable_server(capsys):
    assert main(["bench", "--server", "http://127.0.0.1:9", "--num-sessions", "1", "--no-progress"]) != 0
    assert "127.0.0.1:9" in capsys.readouterr().err


def test_bench_model_takes_a_hub_id_from_the_local_cache(tmp_path, monkeypatch, capsys):
    """`bench --model org/name` resolves like `serve MODEL`: the snapshot the local Hugging Face cache holds."""
    from tests.engine.test_model_path import fake_hub_cache

    fake_hub_cache(tmp_path / "hub", "acme/tiny-hybrid")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    args = ["bench", "--workload", "shared-prefix", "--num-requests", "4", "--modes", "none", "--block-size", "16",
            "--max-reply-tokens", "2", "--out-dir", str(tmp_path / "out"), "--no-progress"]
    assert main([*args, "--model", "acme/tiny-hybrid"]) == 0
    assert "model acme/tiny-hybrid" in capsys.readouterr().out
    assert main([*args, "--model", "acme/not-cached"]) == 2
    assert "holds no snapshot of it" in capsys.readouterr().err


def test_simulate_sizes_checkpoints_by_the_state_dtype(tmp_path):
    """--mamba-ssm-cache-dtype sizes each checkpoint as the engine would store it: the recurrent state in that
    dtype (the conv state stays in the model's dtype), so the same budget holds more checkpoints in bf16 (two
    pools: more slots; paged: fewer blocks per state, at a block size where the rounding up to whole blocks
    shows it: B = 16, 8 blocks in fp32 and 5 in bf16)."""
    from hybridcache.bench.specs import GIB, cache_sizing
    from hybridcache.engine.cost_model import load_model_cost
    from hybridcache.models.builtin import ensure_builtin_model
    from hybridcache.models.config import ModelConfig

    config = ModelConfig.from_model_dir(ensure_builtin_model())
    delta = config.gated_delta
    recurrent = config.num_linear_layers * delta.num_v_heads * delta.k_head_dim * delta.v_head_dim
    fp32, bf16 = load_model_cost(), load_model_cost(None, "bfloat16")
    assert fp32.state_bytes - bf16.state_bytes == recurrent * 2  # 4 -> 2 bytes per recurrent-state element
    assert load_model_cost(None, "auto").state_bytes == fp32.state_bytes  # the built-in config names no dtype
    assert cache_sizing(GIB, bf16, 64, 2048)[1] > cache_sizing(GIB, fp32, 64, 2048)[1]
    records = {}
    for dtype in ("float32", "bfloat16"):
        out = tmp_path / f"{dtype}.json"
        assert main(["simulate", "--workload", "shared-prefix", "--num-requests", "120", "--memory-gib", "0.02",
                     "--policies", "hybridcache", "--mamba-ssm-cache-dtype", dtype, "--json", str(out),
                     "--block-size", "16",
                     "--no-progress", "--jobs", "1"]) == 0
        records[dtype] = json.loads(out.read_text())
    assert records["bfloat16"]["mamba_ssm_cache_dtype"] == "bfloat16"
    assert records["bfloat16"]["state_bytes"] == bf16.state_bytes
    pages = {dtype: r["policies"]["hybridcache"]["state_pages"] for dtype, r in records.items()}
    assert pages == {"float32": -(-fp32.state_bytes // (16 * 1024)), "bfloat16": -(-bf16.state_bytes // (16 * 1024))}
    assert pages["bfloat16"] < pages["float32"], pages
