"""`hybridcache simulate` takes every flag it is given or refuses it: --sweep runs a sweep without --plot, and
--replicas takes the host tier and refuses the flags of a one-cache run it does not take."""

import json

import pytest

from hybridcache.cli import main


def _simulate(tmp_path, *flags):
    out = tmp_path / "out.json"
    code = main(["simulate", "--workload", "swe-agent", "--num-requests", "30", "--no-progress", "--json", str(out),
                 *flags])
    return code, (json.loads(out.read_text()) if out.exists() else None)


def test_sweep_without_plot_runs_the_sweep(tmp_path):
    code, record = _simulate(tmp_path, "--policies", "hybridcache", "--memory-gib", "0.02", "--sweep", "0.01,0.04",
                             "--jobs", "1")
    assert code == 0
    assert [point["memory_gib"] for point in record["sweep"]] == pytest.approx([0.01, 0.02, 0.04])
    rates = [point["token_hit_rate"]["hybridcache"] for point in record["sweep"]]
    assert rates[1] == record["policies"]["hybridcache"]["token_hit_rate"] and rates[0] < rates[2]


def test_replicas_take_the_host_tier(tmp_path):
    flags = ("--memory-gib", "0.01", "--replicas", "2", "--routing", "session")
    code, alone = _simulate(tmp_path / "a", *flags)
    code_host, with_host = _simulate(tmp_path / "b", *flags, "--host-memory-gib", "4x")
    assert code == code_host == 0
    assert alone["host_memory_bytes_per_replica"] == 0
    assert with_host["host_memory_bytes_per_replica"] == int(4 * 0.01 * (1 << 30))
    assert with_host["routing"]["session"]["hit_tokens"] > alone["routing"]["session"]["hit_tokens"]


@pytest.mark.parametrize("flags", [("--plot", "x.png"), ("--sweep", "0.5,1"), ("--jobs", "2")])
def test_replicas_refuse_the_flags_of_a_one_cache_run(tmp_path, capsys, flags):
    code, record = _simulate(tmp_path, "--replicas", "2", *flags)
    assert code == 2 and record is None
    assert f"{flags[0]}: not with --replicas" in capsys.readouterr().err
