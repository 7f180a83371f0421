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


def test_engine_bench_modes_agree_and_the_cache_hits(tmp_path):
    pytest.importorskip("torch")
    from hybridcache.bench.engine_bench import BenchConfig, run_bench
    from hybridcache.bench.workloads import ChatOptions, default_trace_path, load_workload

    if not default_trace_path("sharegpt").exists():
        pytest.skip("sharegpt trace absent")
    workload = load_workload("sharegpt", chat=ChatOptions(num_sessions=3, max_turns=2, max_message_chars=300))
    result = run_bench(None, workload, BenchConfig(("none", "hybridcache"), max_reply_tokens=8))
    assert result.outputs_identical
    none, cached = result.modes["none"], result.modes["hybridcache"]
    assert none.token_hit_rate == 0.0 and cached.token_hit_rate > 0.2
    assert cached.prefill_tokens_computed < none.prefill_tokens_computed
    assert cached.hit_rate_by_turn[0] == 0.0 and cached.hit_rate_by_turn[1] > 0.5
    assert none.num_calls == cached.num_calls == len(workload)


def test_bench_server_mode_is_a_clear_error(capsys):
    assert main(["bench", "--server", "http://localhost:8000"]) == 2
    assert "not supported yet" in capsys.readouterr().err
