"""Plots: integer turn ticks, a log TTFT axis when one mode squeezes the others; runs never overwrite."""

import pytest

from hybridcache.bench.cli import fresh_paths


def test_a_later_run_gets_fresh_paths_and_says_so(tmp_path, capsys):
    first = fresh_paths(tmp_path / "bench_x.json", tmp_path / "bench_x_cdf.png", None)
    assert first == (tmp_path / "bench_x.json", tmp_path / "bench_x_cdf.png", None)
    assert capsys.readouterr().out == ""
    first[0].write_text("{}")
    second = fresh_paths(tmp_path / "bench_x.json", tmp_path / "bench_x_cdf.png")
    assert second == (tmp_path / "bench_x-2.json", tmp_path / "bench_x_cdf-2.png")
    assert "bench_x-2.json" in capsys.readouterr().out
    second[1].write_bytes(b"png")  # a -2 plot alone also takes the -2 suffix
    assert fresh_paths(tmp_path / "bench_x.json", tmp_path / "bench_x_cdf.png")[0] == tmp_path / "bench_x-3.json"


def test_ttft_axis_turns_log_only_when_medians_spread():
    from hybridcache.bench.plots import ttft_axis_is_log

    assert ttft_axis_is_log({"none": [0.9, 1.0, 1.1], "hybridcache": [0.03, 0.04, 0.05]})
    assert not ttft_axis_is_log({"none": [0.2, 0.3], "hybridcache": [0.1, 0.1]})
    assert not ttft_axis_is_log({"server": [0.01, 5.0]})


def test_plots_have_integer_turn_ticks_and_a_log_ttft_axis(tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from hybridcache.bench import plots

    saved = {}
    real_save = plots._save

    def keep(fig, path):
        saved[str(path)] = fig.axes[0]
        return real_save(fig, path)

    plots._save = keep
    try:
        plots.plot_hit_rate_by_turn(tmp_path / "turn.png", "t", {"a": {0: 0.0, 1: 0.5, 2: 0.7}})
        plots.plot_ttft_cdf(tmp_path / "cdf.png", "t", {"none": [1.0, 2.0], "hybridcache": [0.01, 0.02]})
    finally:
        plots._save = real_save
    turn_ax, cdf_ax = saved[str(tmp_path / "turn.png")], saved[str(tmp_path / "cdf.png")]
    ticks = [t for t in turn_ax.get_xticks() if 0 <= t <= 2]
    assert ticks and all(float(t).is_integer() for t in ticks)
    assert cdf_ax.get_xscale() == "log"
    plt.close("all")


@pytest.mark.parametrize(("flag", "target", "message"), [
    ("--json", "afile/sim.json", "--json '{}/afile/sim.json': its folder '{}/afile' is a file, not a folder"),
    ("--json", "outdir", "--json '{}/outdir' is a folder; give a file path"),
    ("--plot", "outdir", "--plot '{}/outdir' is a folder; give a file path"),
], ids=["json-under-a-file", "json-a-folder", "plot-a-folder"])
@pytest.mark.parametrize("replicas", [(), ("--replicas", "2", "--routing", "session")], ids=["one-cache", "replicas"])
def test_simulate_checks_its_output_paths_before_the_replay(tmp_path, monkeypatch, capsys, flag, target, message,
                                                             replicas):
    """A --json or --plot path that cannot be written (under a file) or that is a folder is refused before the
    replay (it failed after it with a bare "[Errno 17] File exists", or wrote FOLDER-2 beside the folder)."""
    import hybridcache.bench.routing
    import hybridcache.bench.simulator
    from hybridcache.cli import main

    if replicas and flag == "--plot":
        pytest.skip("--replicas refuses --plot")
    (tmp_path / "afile").write_text("")
    (tmp_path / "outdir").mkdir()

    def replayed(*args, **kwargs):
        raise AssertionError("the replay ran")

    monkeypatch.setattr(hybridcache.bench.simulator, "simulate_many", replayed)
    monkeypatch.setattr(hybridcache.bench.routing, "simulate_routing", replayed)
    jobs = () if replicas else ("--jobs", "1")  # (--replicas refuses --jobs)
    code = main(["simulate", "--workload", "shared-prefix", "--num-requests", "20", "--no-progress", *jobs, *replicas,
                 flag, str(tmp_path / target)])
    assert code == 2
    assert message.format(tmp_path, tmp_path) in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "outdir"]  # nothing written beside them
