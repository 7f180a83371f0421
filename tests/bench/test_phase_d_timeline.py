"""benchmarks/phase_d_timeline.py's arithmetic on a made-up timeline (the script itself needs a GPU): the union of
the device's busy intervals, the idle time inside each step call, the prefill / decode split and the longest gaps."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from phase_d_timeline import analyse, busy_union, idle_within  # noqa: E402


def test_busy_union_merges_overlapping_and_touching_intervals_in_any_order():
    assert busy_union([(5, 7), (0, 2), (1, 3), (3, 4), (10, 12)]) == [(0, 4), (5, 7), (10, 12)]
    assert busy_union([]) == []


def test_idle_within_counts_only_the_window():
    busy = [(0, 4), (5, 7), (10, 12)]
    assert idle_within(busy, 0, 12) == 1 + 3
    assert idle_within(busy, 3, 6) == 1  # 4..5
    assert idle_within(busy, 7, 10) == 3
    assert idle_within(busy, 12, 15) == 3


def test_analyse_splits_idle_time_by_step_call():
    # us: a prefill call [0, 1000) whose kernels leave 100 us idle at its start; two decode calls of 100 us, the
    # second with a 30 us gap between its kernels
    kernels = [(100, 600, "gemm"), (550, 1000, "fla"), (1000, 1100, "step"), (1100, 1140, "norm"),
               (1170, 1200, "argmax")]
    steps = [(0, 1000, 16384), (1000, 1100, 0), (1100, 1200, 0)]
    result = analyse(kernels, steps)
    assert result["wall_ms"] == pytest.approx(1.2)
    assert result["device_busy_ms"] == pytest.approx(1.07)
    assert result["device_idle_ms"] == pytest.approx(0.13)
    assert [row["idle_ms"] for row in result["per_step"]] == pytest.approx([0.1, 0.0, 0.03])
    assert result["prefill_calls"] == {"n": 1, "wall_ms": 1.0, "idle_ms": 0.1}
    assert result["decode_calls"] == {"n": 2, "wall_ms": 0.2, "idle_ms": 0.03}
    # the gaps between kernels (the idle start of a call before its first kernel is not a gap between two)
    assert result["longest_gaps"] == [{"us": 30, "after": "norm", "before": "argmax", "call": 2}]


def test_kernels_in_sums_by_name_the_kernels_that_start_in_the_window():
    from phase_d_timeline import kernels_in

    kernels = [(100, 600, "gemm"), (550, 1000, "fla"), (700, 800, "gemm"), (1000, 1100, "step"), (990, 1500, "x")]
    assert kernels_in(kernels, 0, 1000) == [{"name": "gemm", "ms": 0.6, "n": 2}, {"name": "x", "ms": 0.51, "n": 1},
                                            {"name": "fla", "ms": 0.45, "n": 1}]
    assert kernels_in(kernels, 0, 1000, top=1) == [{"name": "gemm", "ms": 0.6, "n": 2}]
    assert kernels_in(kernels, 1000, 1200) == [{"name": "step", "ms": 0.1, "n": 1}]
