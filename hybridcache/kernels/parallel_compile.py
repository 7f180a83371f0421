"""Triton compiles on a thread pool while an engine starts: an autotuned kernel's candidates compiled at once.

On a machine with an empty Triton cache an engine's start-up is mostly compiling (docs/bench.md, "Start-up
compiles"). An autotuned kernel (flash-linear-attention's chunked kernels) compiles each candidate
config when its autotuner first times it at a new tuning key, one after another. Inside `parallel_compiles()`, that
first launch first warms every candidate (`Autotuner.warmup`) under Triton's `AsyncCompileMode`, which hands each
compile to a thread pool (Triton's passes and ptxas release the GIL), so the autotuner's timings wait only for the
candidate they time while the others compile beside it. Nothing else changes: a plain launch compiles before it runs
(on the pool, waited for), and the autotuner times the same candidates and keeps the same choice.

    with parallel_compiles():       # the engine's start-up on CUDA (`engine/rank_runner.build_runner`)
        ...                         # profiling forward, compiles, graph captures

Our own start-up helpers that compile several variants of a plain kernel one launch after another (the skinny
GEMM's candidates in `gemm/dense.decide`, the MoE sort's buckets in `moe/grouped.compile_tiles`) run those
launches under `compiles_only()` first: each launch then hands its compile to the pool and returns at once, so the
variants compile side by side; a later launch of one waits for its compile and runs.

Without Triton, with a Triton that has no `AsyncCompileMode` (it came in Triton 3.5), or with one usable core, the
context does nothing.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

MAX_WORKERS = 16


def compile_workers() -> int:
    """Threads for the pool: the cores this process may run on, at most `MAX_WORKERS`."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # (not on Linux)
        cores = os.cpu_count() or 1
    return max(1, min(MAX_WORKERS, cores))


def tuning_key(autotuner: Any, args: tuple, kwargs: dict) -> tuple:
    """The key Triton's `Autotuner.run` caches its choice under (its `keys` arguments, then every tensor's dtype)."""
    named = {**dict(zip(autotuner.arg_names, args)), **kwargs}
    named = {name: value for name, value in named.items() if name in autotuner.arg_names}
    key = [named[name] for name in autotuner.keys if name in named]
    key += [str(value.dtype) for value in named.values() if hasattr(value, "dtype")]
    return tuple(key)


# Per thread (each thread starts with an empty context): the autotuners' keys warmed inside this thread's
# `parallel_compiles` (None outside it), and whether this thread is inside `compiles_only`.
_WARMED: contextvars.ContextVar[set[tuple[int, tuple]] | None] = contextvars.ContextVar("warmed", default=None)
_COMPILE_ONLY: contextvars.ContextVar[bool] = contextvars.ContextVar("compile_only", default=False)
_PATCH_LOCK = threading.Lock()
_PATCH_USERS: dict[tuple[type, str], int] = {}  # contexts inside `_patched(owner, name, ...)`, all threads


@contextlib.contextmanager
def _patched(owner: type, name: str, wrap: Callable[[Callable], Callable], var: contextvars.ContextVar,
             value: Any) -> Iterator[None]:
    """`owner.name` is `wrap(original)` while any thread is inside a `_patched` of it (counted, so threads that
    enter and leave in any order restore the original once, when the last leaves), and this thread's `var` is
    `value` (restored on exit). The wrapper is shared by every thread: it must act only where `var` says so and
    call the original otherwise."""
    key = (owner, name)
    with _PATCH_LOCK:
        if not _PATCH_USERS.get(key):
            original = getattr(owner, name)
            wrapper = wrap(original)
            wrapper.original = original  # type: ignore[attr-defined]
            setattr(owner, name, wrapper)
        _PATCH_USERS[key] = _PATCH_USERS.get(key, 0) + 1
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)
        with _PATCH_LOCK:
            _PATCH_USERS[key] -= 1
            if not _PATCH_USERS[key]:
                setattr(owner, name, getattr(owner, name).original)


def _warming_first(run: Callable) -> Callable:
    """`Autotuner.run` that, inside this thread's `parallel_compiles`, warms every candidate at a new tuning key
    before `run` times them."""

    def run_after_warming(self: Any, *args: Any, **kwargs: Any) -> Any:
        warmed = _WARMED.get()
        if warmed is not None and len(self.configs) > 1 and not kwargs.get("warmup"):
            key = tuning_key(self, args, kwargs)
            if key not in self.cache and (id(self), key) not in warmed:
                warmed.add((id(self), key))
                self.warmup(*args, **{name: value for name, value in kwargs.items() if name != "warmup"})
        return run(self, *args, **kwargs)

    return run_after_warming


def _compiling_only(run: Callable) -> Callable:
    """`JITFunction.run` that, inside this thread's `compiles_only`, warms up (compiles) instead of launching."""

    def maybe_compile_only(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
        return run(self, *args, grid=grid, warmup=warmup or _COMPILE_ONLY.get(), **kwargs)

    return maybe_compile_only


@contextlib.contextmanager
def parallel_compiles(workers: int | None = None) -> Iterator[None]:
    """While entered, this thread's autotuned Triton kernels compile their candidates on a pool of `workers`
    threads (None: `compile_workers()`); on exit every compile it started has finished. Not reentrant (Triton
    allows one `AsyncCompileMode` at a time per thread): a nested use does nothing."""
    workers = compile_workers() if workers is None else workers
    try:
        import triton
        from triton.runtime import _async_compile
        from triton.runtime.autotuner import Autotuner
    except ImportError:
        yield
        return
    mode_type = getattr(triton, "AsyncCompileMode", None)
    if mode_type is None or workers < 2 or _async_compile.active_mode.get() is not None:
        yield
        return
    with ThreadPoolExecutor(workers, thread_name_prefix="triton-compile") as pool:
        # a candidate that cannot compile (too much shared memory) fails when the autotuner times it, as without
        # the pool; ignore_errors keeps the exit's wait from raising it a second time (a Triton without it: no pool)
        try:
            mode = mode_type(pool, ignore_errors=True)
        except TypeError:
            yield
            return
        with mode, _patched(Autotuner, "run", _warming_first, _WARMED, set()):
            yield


@contextlib.contextmanager
def compiles_only() -> Iterator[None]:
    """While entered, a launch of a plain `@triton.jit` kernel by this thread compiles it and does not run it
    (Triton's `warmup`): the launch's outputs are left unwritten. Inside `parallel_compiles` the compile goes to its
    pool and the launch returns at once; outside it the launch compiles before it returns, as a first launch would.
    Other threads' launches run as usual. For loops of independent launches on valid inputs whose outputs nobody
    reads (compiling a kernel's variants), never around an autotuned kernel (its timings would time nothing) or
    code that reads a launch's output."""
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:
        yield
        return
    with _patched(JITFunction, "run", _compiling_only, _COMPILE_ONLY, True):
        yield
