"""`kernels/parallel_compile.py`: inside `parallel_compiles()`, an autotuned kernel's first launch at a new tuning key
warms every candidate (each compile handed to Triton's `AsyncCompileMode` pool) before the autotuner times them;
later launches, warm-ups and single-candidate autotuners go straight through; the patch and the mode end with the
context. Inside `compiles_only()` a plain kernel's launch becomes its warm-up (compiled, not run). No GPU: the
autotuner's and the kernel's own runs (which would launch) are replaced by recorders, so what is checked is the
wrappers' bookkeeping, and the tuning key against Triton's rule."""

from __future__ import annotations

import threading

import pytest
import torch

triton = pytest.importorskip("triton")

from triton.runtime import _async_compile  # noqa: E402
from triton.runtime.autotuner import Autotuner  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from hybridcache.kernels.parallel_compile import (  # noqa: E402
    compile_workers,
    compiles_only,
    parallel_compiles,
    tuning_key,
)

needs_async_mode = pytest.mark.skipif(not hasattr(triton, "AsyncCompileMode"),
                                      reason="this Triton has no AsyncCompileMode")


@triton.jit
def _scale_kernel(x_ptr, n, BLOCK: triton.language.constexpr):
    offsets = triton.language.program_id(0) * BLOCK + triton.language.arange(0, BLOCK)
    mask = offsets < n
    triton.language.store(x_ptr + offsets, triton.language.load(x_ptr + offsets, mask=mask) * 2, mask=mask)


def autotuned(num_configs: int) -> Autotuner:
    configs = [triton.Config({"BLOCK": 32 * 2**i}) for i in range(num_configs)]
    return triton.autotune(configs=configs, key=["n"])(_scale_kernel)


class Recorder:
    """Stands in for `Autotuner.run` (the original, which would time on a GPU) and `Autotuner.warmup`."""

    def __init__(self) -> None:
        self.runs: list[tuple] = []
        self.warmups: list[tuple] = []

    def run(self, autotuner: Autotuner, *args, **kwargs):
        self.runs.append((args, kwargs))
        autotuner.cache[tuning_key(autotuner, args, kwargs)] = autotuner.configs[0]
        return "launched"


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> Recorder:
    rec = Recorder()
    monkeypatch.setattr(Autotuner, "run", lambda self, *args, **kwargs: rec.run(self, *args, **kwargs))
    monkeypatch.setattr(Autotuner, "warmup", lambda self, *args, **kwargs: rec.warmups.append((args, kwargs)))
    return rec


def test_tuning_key_is_the_key_arguments_then_every_tensors_dtype():
    x = torch.zeros(8)
    kernel = autotuned(2)
    assert tuning_key(kernel, (x, 8), {"grid": (1,), "warmup": False}) == (8, "torch.float32")
    assert tuning_key(kernel, (x.half(),), {"n": 16, "grid": (1,)}) == (16, "torch.float16")


@needs_async_mode
def test_the_first_launch_at_a_key_warms_every_candidate_once(recorder: Recorder):
    x = torch.zeros(64)
    kernel, single = autotuned(3), autotuned(1)
    original = Autotuner.run
    with parallel_compiles(workers=2):
        assert _async_compile.active_mode.get() is not None  # compiles go to the pool
        assert Autotuner.run is not original
        assert kernel.run(x, 64, grid=(1,), warmup=False) == "launched"
        assert recorder.warmups == [((x, 64), {"grid": (1,)})]  # every candidate, without the launch's warmup flag
        kernel.run(x, 64, grid=(2,), warmup=False)  # the same key: chosen already, nothing to warm
        kernel.run(x, 32, grid=(1,), warmup=True)  # a warm-up itself is not warmed again
        single.run(x, 64, grid=(1,), warmup=False)  # one candidate: nothing to choose between
        assert len(recorder.warmups) == 1
        kernel.run(x, 128, grid=(1,), warmup=False)  # a new key
        assert [args for args, _ in recorder.warmups] == [(x, 64), (x, 128)]
        other = threading.Thread(target=lambda: kernel.run(x, 256, grid=(1,), warmup=False))
        other.start()  # another thread (outside the pool's mode): launched, nothing warmed
        other.join()
        assert len(recorder.warmups) == 2
    assert len(recorder.runs) == 6  # every launch still ran
    assert Autotuner.run is original
    assert _async_compile.active_mode.get() is None


@needs_async_mode
def test_a_nested_context_and_one_worker_change_nothing(recorder: Recorder):
    x = torch.zeros(64)
    kernel = autotuned(2)
    original = Autotuner.run
    with parallel_compiles(workers=1):
        assert Autotuner.run is original and _async_compile.active_mode.get() is None
        kernel.run(x, 64, grid=(1,), warmup=False)
    assert recorder.warmups == []
    with parallel_compiles(workers=2):
        patched, mode = Autotuner.run, _async_compile.active_mode.get()
        with parallel_compiles(workers=2):
            assert Autotuner.run is patched and _async_compile.active_mode.get() is mode
        assert Autotuner.run is patched  # the inner exit left the outer patch in place
    assert Autotuner.run is original


def test_compile_workers_is_the_usable_cores_capped():
    assert 1 <= compile_workers() <= 16


def test_compiles_only_turns_a_plain_launch_into_its_warm_up(monkeypatch: pytest.MonkeyPatch):
    launches: list[tuple] = []

    def recording_run(self: JITFunction, *args, grid, warmup, **kwargs):
        launches.append((args, grid, warmup, kwargs))

    monkeypatch.setattr(JITFunction, "run", recording_run)
    kernel = JITFunction(_scale_kernel.fn)  # compiled (not interpreted) whatever TRITON_INTERPRET says
    x = torch.zeros(64)
    with compiles_only():
        kernel[(2,)](x, 64, BLOCK=32)
        kernel.warmup(x, 32, grid=(1,), BLOCK=32)  # a warm-up stays one
        with compiles_only():  # nested: still compile-only, and the outer exit ends it
            kernel[(3,)](x, 64, BLOCK=32)
        other = threading.Thread(target=lambda: kernel[(4,)](x, 64, BLOCK=32))
        other.start()  # another thread's launch runs
        other.join()
        kernel[(5,)](x, 64, BLOCK=32)
    kernel[(2,)](x, 64, BLOCK=32)  # after the context: launched again
    assert [(grid, warmup) for _, grid, warmup, _ in launches] == [
        ((2,), True), ((1,), True), ((3,), True), ((4,), False), ((5,), True), ((2,), False)]
    assert launches[0] == ((x, 64), (2,), True, {"BLOCK": 32})
    assert JITFunction.run is recording_run


def test_threads_leaving_in_any_order_restore_the_launch_once(monkeypatch: pytest.MonkeyPatch):
    def original_run(self, *args, grid, warmup, **kwargs):
        return warmup

    monkeypatch.setattr(JITFunction, "run", original_run)
    kernel = JITFunction(_scale_kernel.fn)
    x = torch.zeros(8)
    entered, leave_b = threading.Event(), threading.Event()
    seen: dict[str, bool] = {}

    def thread_b() -> None:
        with compiles_only():
            entered.set()
            leave_b.wait()
            seen["b"] = kernel[(1,)](x, 8, BLOCK=8)

    b = threading.Thread(target=thread_b)
    with compiles_only():  # this thread enters first and leaves first
        b.start()
        entered.wait()
    assert JITFunction.run is not original_run  # b is still inside
    assert kernel[(1,)](x, 8, BLOCK=8) is False  # this thread's launch runs again
    leave_b.set()
    b.join()
    assert seen == {"b": True}  # b's launch inside its context was a warm-up
    assert JITFunction.run is original_run
