"""The command lines refuse bad counts and sizes while parsing their flags (`hybridcache/arg_types.py`): argparse's
error names the flag and exits with status 2, where before some values raised a traceback later
(`simulate --block-size 0`: ZeroDivisionError) or ran silently on nothing (`simulate --num-requests -3` took all
but the last three requests; `bench --num-sessions 0` benchmarked no calls)."""

from __future__ import annotations

import argparse

import pytest

from hybridcache.arg_types import non_negative_int, positive_float, positive_int
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
    assert positive_float("0.25") == 0.25 and positive_float("1e3") == 1000.0
    for parse, bad in ((positive_int, "0"), (positive_int, "-5"), (positive_int, "1.5"), (positive_int, "x"),
                       (non_negative_int, "-1"), (positive_float, "0"), (positive_float, "-0.1"),
                       (positive_float, "inf"), (positive_float, "nan"), (positive_float, "")):
        with pytest.raises(argparse.ArgumentTypeError, match="must be"):
            parse(bad)
