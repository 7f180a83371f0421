"""The command lines (generate, serve, simulate, bench, router) refuse bad counts, sizes and ports while parsing
their flags (`hybridcache/arg_types.py`): argparse's error names the flag and exits with status 2, where before some
values raised a traceback later (`simulate --block-size 0`: ZeroDivisionError; `router --port -1`: OverflowError)
or ran silently on nothing (`simulate --num-requests -3` took all but the last three requests; `bench
--num-sessions 0` benchmarked no calls)."""

from __future__ import annotations

import argparse

import pytest

from hybridcache.arg_types import (
    human_readable_int,
    model_len,
    non_negative_int,
    port_number,
    positive_float,
    positive_int,
)
from hybridcache.cli import main

SIMULATE = ["simulate", "--workload", "swe-agent", "--no-progress"]
BENCH = ["bench", "--no-progress"]

REFUSED = [
    (SIMULATE, "--num-requests", "-3"),
    (SIMULATE, "--num-requests", "0"),
    (SIMULATE, "--block-size", "0"),
    (SIMULATE, "--memory-gib", "-1"),
    (SIMULATE, "--memory-gib", "nan"),
    (SIMULATE, "--host-bandwidth-gbs", "0"),
    (SIMULATE, "--device-tflops", "-400"),
    (SIMULATE, "--chunk-budget", "0"),
    (SIMULATE, "--kv-tokens-per-slot", "-1"),
    (SIMULATE, "--seed", "-1"),
    (SIMULATE, "--jobs", "0"),
    (SIMULATE, "--replicas", "0"),
    (SIMULATE, "--sweep", "0.5,abc"),
    (SIMULATE, "--sweep", "0,1"),
    (SIMULATE, "--host-memory-gib", "abc"),
    (SIMULATE, "--host-memory-gib", "infx"),
    (BENCH, "--num-sessions", "0"),
    (BENCH, "--max-turns", "-1"),
    (BENCH, "--max-message-chars", "0"),
    (BENCH, "--max-prompt-len", "0"),
    (BENCH, "--num-requests", "-1"),
    (BENCH, "--max-reply-tokens", "0"),
    (BENCH, "--seed", "-2"),
    (BENCH, "--block-size", "0"),
    (BENCH, "--concurrency", "0"),
    (["generate"], "--disk-cache-gib", "-1"),
    (["serve"], "--log-stats-interval", "-1"),
    (["router", "--replica", "http://127.0.0.1:9"], "--port", "-1"),
    (["router", "--replica", "http://127.0.0.1:9"], "--port", "65536"),
    # flags whose errors named an internal field (or a converted value), or that were taken
    (["generate"], "--hicache-size", "-3"),  # said host_cache_gib ... -2.79
    (["generate"], "--host-cache-gib", "nan"),
    (["serve"], "--shutdown-timeout", "-5"),  # said shutdown_timeout_s
    (["serve"], "--port", "70000"),
    (["serve"], "--max-request-bytes", "0"),
    (["router", "--replica", "http://127.0.0.1:9"], "--cache-threshold", "2"),  # said min_hit_fraction
    (["router", "--replica", "http://127.0.0.1:9"], "--balance-abs-threshold", "-1"),
    (["router", "--replica", "http://127.0.0.1:9"], "--balance-rel-threshold", "nan"),  # was taken
    (["router", "--replica", "http://127.0.0.1:9"], "--balance-rel-threshold", "0.5"),
    (["router", "--port", "0"], "--replica", "notaurl"),  # started, and answered 503 to everything
    (["router", "--port", "0"], "--replica", "ftp://host:1"),
    (BENCH, "--modes", ","),  # IndexError after loading the model
    (BENCH, "--modes", ""),
    (BENCH, "--modes", "none,none"),  # ran one row
    (BENCH, "--modes", "none,foo"),
]


@pytest.mark.parametrize("command, flag, value", REFUSED, ids=[f"{c[0]}{f}={v}" for c, f, v in REFUSED])
def test_a_bad_count_or_size_is_refused_naming_its_flag(command, flag, value, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([*command, flag, value])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}" in err and "must be" in err and repr(value) in err, err


def test_the_types_take_good_values_and_refuse_the_rest():
    assert positive_int("1") == 1 and positive_int("64") == 64
    assert non_negative_int("0") == 0
    assert port_number("0") == 0 and port_number("65535") == 65535
    assert positive_float("0.25") == 0.25 and positive_float("1e3") == 1000.0
    for parse, bad in ((positive_int, "0"), (positive_int, "-5"), (positive_int, "1.5"), (positive_int, "x"),
                       (non_negative_int, "-1"), (positive_float, "0"), (positive_float, "-0.1"),
                       (positive_float, "inf"), (positive_float, "nan"), (positive_float, ""),
                       (port_number, "-1"), (port_number, "65536")):
        with pytest.raises(argparse.ArgumentTypeError, match="must be"):
            parse(bad)


def test_token_counts_take_vllms_human_readable_forms():
    """vLLM parses --max-model-len and --max-num-batched-tokens with its human_readable_int: a copied `32k` was
    refused here ("invalid int value")."""
    from hybridcache.engine_args import add_engine_args

    assert [human_readable_int(t) for t in ("512", "32k", "32K", "25.6k", "1m", "1M", "2g")] == \
        [512, 32_000, 32_768, 25_600, 10**6, 2**20, 2 * 10**9]
    assert [model_len(t) for t in ("auto", "-1", "8K")] == [None, None, 8192]
    for bad in ("0", "1.5K", "0.0001k", "k", "32kb", "-3"):
        with pytest.raises(argparse.ArgumentTypeError):
            human_readable_int(bad)
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--max-model-len", "32k", "--max-num-batched-tokens", "8K"])
    assert (args.max_model_len, args.max_num_batched_tokens) == (32_000, 8192)
    assert parser.parse_args(["--max-model-len", "auto"]).max_model_len is None


@pytest.mark.parametrize("flag, value", [("--router-poll-interval", "0"), ("--router-poll-interval", "-1"),
                                         ("--max-request-bytes", "0")])
def test_the_router_refuses_a_busy_poll_or_an_empty_body_limit(flag, value, capsys):
    """Before, a poll interval of 0 or below polled the replicas in a busy loop and a 0-byte limit refused every
    request: the router now stops before it binds, naming the flag (it named the field, poll_interval_s)."""
    with pytest.raises(SystemExit) as exit_info:
        main(["router", "--replica", "http://127.0.0.1:9", "--port", "0", flag, value])
    assert exit_info.value.code == 2
    assert f"argument {flag}: must be" in capsys.readouterr().err


def test_python_dash_m_runs_the_command():
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "hybridcache", "simulate", "--workload", "group-sampling",
                           "--num-requests", "10", "--policies", "hybridcache", "--no-progress", "--jobs", "1"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "hybridcache" in done.stdout and "hit rate" in done.stdout


def test_a_policy_s_own_block_size_must_be_a_positive_integer(capsys):
    """`NAME:B` sets one policy's block size; `hybridcache:0` raised ZeroDivisionError before."""
    for policies in ("hybridcache:0", "hybridcache:x", "seed:-64"):
        assert main([*SIMULATE, "--num-requests", "5", "--policies", policies]) == 2
        assert "block size after ':' must be an integer >= 1" in capsys.readouterr().err


@pytest.mark.parametrize("argv, flag", [
    (["generate", "--host", "0.0.0.0"], "--host"),  # an abbreviation of --host-cache-gib before
    (["generate", "--max-tok", "3"], "--max-tok"),
    ([*SIMULATE, "--mem", "1"], "--mem"),
    ([*BENCH, "--work", "mooncake"], "--work"),
])
def test_subcommands_take_no_abbreviated_flags(argv, flag, capsys):
    """generate, simulate and bench took a prefix of a flag for the flag (`generate --host 0.0.0.0` set the host
    tier and failed on '0.0.0.0' as GiB); like the top-level parser and serve they now refuse it."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert f"unrecognized arguments: {flag}" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["simulate", "--workload", "mooncake", "--no-progress"], "the workload 'mooncake' has no requests"),
    (["simulate", "--workload", "shared-prefix", "--no-progress"], "workload 'shared-prefix' is generated and reads "
                                                                     "no trace"),
    (["simulate", "--workload", "group-sampling", "--no-progress"], "workload 'group-sampling' is generated"),
])
def test_an_empty_trace_or_a_trace_for_a_generated_workload_is_refused(tmp_path, argv, message, capsys):
    """An empty trace ran, printed a table of zeros and exited 0; a --trace given to a generated workload was
    ignored without a word."""
    trace = tmp_path / "empty.jsonl"
    trace.write_text("")
    assert main([*argv, "--trace", str(trace)]) == 2
    assert message in capsys.readouterr().err


def test_bench_refuses_a_workload_its_cuts_leave_empty_before_loading_the_model(tmp_path, capsys):
    """--max-prompt-len 10 cuts every swe-agent call: the benchmark ran no call and exited 0."""
    out = tmp_path / "res"
    assert main([*BENCH, "--workload", "swe-agent", "--num-sessions", "1", "--max-turns", "1", "--modes", "none",
                 "--max-prompt-len", "10", "--out-dir", str(out)]) == 2
    assert "the workload 'swe-agent' has no requests" in capsys.readouterr().err


def test_bench_checks_its_out_dir_before_the_run(tmp_path, capsys):
    """--out-dir naming a file failed when the results were written, after the whole run."""
    a_file = tmp_path / "file"
    a_file.write_text("x")
    for out_dir, message in ((a_file, "is a file, not a folder"), (a_file / "sub", "cannot be created")):
        assert main([*BENCH, "--modes", "none", "--num-sessions", "1", "--max-turns", "1",
                     "--out-dir", str(out_dir)]) == 2
        assert f"--out-dir {str(out_dir)!r} {message}" in capsys.readouterr().err


def test_the_command_line_parses_without_the_serve_extra():
    """The Quickstart installs only the `bench` extra: building the parser (which registers `serve`) must not
    import fastapi, starlette, uvicorn or httpx (a module-level starlette import in server/errors.py broke it)."""
    import subprocess
    import sys

    script = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"fastapi", "starlette", "uvicorn", "httpx", "prometheus_client"}:
            raise ModuleNotFoundError(f"No module named {name!r}")
sys.meta_path.insert(0, Block())
from hybridcache.cli import build_parser
args = build_parser().parse_args(["simulate", "--workload", "swe-agent"])
print(args.command if hasattr(args, "command") else "parsed")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
