"""`benchmarks/fp8_profile.py`: its device-time groups from a profile's kernels (made-up events in torch.profiler's
shape; no kernel runs) and its part names."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.autograd import DeviceType

from benchmarks.fp8_profile import kernel_groups, parse_parts


def event(key: str, us: float, count: int, device: DeviceType = DeviceType.CUDA) -> SimpleNamespace:
    return SimpleNamespace(key=key, self_device_time_total=us, count=count, device_type=device)


def test_kernels_are_grouped_per_step_with_the_fp8_quantisation_a_group_of_its_own() -> None:
    prof = SimpleNamespace(key_averages=lambda: [
        event("_quantize_groups_kernel", 40.0, 8), event("_fp8_expert_gemm_kernel", 400.0, 4),
        event("_expert_gemm_kernel", 100.0, 2), event("nvjet_sm90_qqtst_128x128_128x6", 60.0, 4),
        event("_fp8_gemm_kernel", 20.0, 2), event("_gdn_step_kernel", 30.0, 2), event("_rms_norm_kernel", 10.0, 4),
        event("aten::_scaled_mm_v2", 999.0, 4, DeviceType.CPU),  # a host operator: its kernels count as themselves
        event("idle", 0.0, 1)])
    found = kernel_groups(prof, steps=2)
    groups = {name: (round(v["ms"], 6), v["launches"]) for name, v in found["groups"].items()}
    assert groups == {"routed-expert GEMMs": (0.25, 3.0), "other GEMMs": (0.04, 3.0),
                      "FP8 activation quantisation": (0.02, 4.0), "DeltaNet step kernel": (0.015, 1.0),
                      "everything else": (0.005, 2.0)}
    assert list(found["groups"]) == sorted(found["groups"], key=lambda g: -found["groups"][g]["ms"])
    assert round(found["total"]["ms"], 6) == 0.33 and found["total"]["launches"] == 13.0
    assert found["families"]["FP8 activation quantisation"]["launches"] == 4.0


def test_profile_parts_are_named_or_refused() -> None:
    assert parse_parts("decode, small") == ["decode", "small"]
    assert parse_parts("") == []
    with pytest.raises(ValueError, match="prefil"):
        parse_parts("decode,prefil")


class _Runner:
    def _copy(self, op: object) -> object:
        return op


def test_copy_logging_unwraps_without_leaving_a_reference_cycle() -> None:
    """The decode profile wraps `runner._copy`; unwrapped, the runner must be freed by reference counting alone (a
    CUDA engine's heap is frozen, so a cycle through the runner kept its pools allocated: fp8_bench's second run
    ran out of memory)."""
    import weakref

    from benchmarks.step_profile import log_copies

    runner = _Runner()
    log: list[list[str]] = [[]]
    unwrap = log_copies(runner, log)
    assert runner._copy(SimpleNamespace(kind=SimpleNamespace(name="D2D"), src_ids=torch.arange(3))) is not None
    assert log == [["D2D x3"]]
    unwrap()
    assert "_copy" not in vars(runner) and runner._copy.__func__ is _Runner._copy
    ref = weakref.ref(runner)
    del runner, unwrap
    assert ref() is None


def test_release_engines_collects_a_cycle_through_a_frozen_heap() -> None:
    """`fp8_bench.release_engines` unfreezes before it collects: a cycle from an object frozen at an engine's
    start-up (`gc.freeze`) is freed, which `gc.collect()` alone leaves."""
    import gc
    import weakref

    from benchmarks.fp8_bench import release_engines

    runner = _Runner()
    gc.freeze()
    try:
        runner.cycle = runner._copy  # made after the freeze, through a frozen object
        ref = weakref.ref(runner)
        del runner
        gc.collect()
        assert ref() is not None  # what fp8_bench's `gc.collect()` left
        release_engines(cuda=False)
        assert ref() is None
    finally:
        gc.unfreeze()
