"""The CUDA backend keeps Triton's autotuning results on disk (`cuda_backend.keep_autotuning`): a restart that keeps
the Triton cache folder loads fla's tuned configs instead of timing every candidate again."""

from __future__ import annotations

import os

import pytest


def test_the_backend_turns_autotuning_results_on_disk_on_unless_the_environment_says(monkeypatch):
    from hybridcache.kernels.attention.reference_backend import ReferenceAttention
    from hybridcache.kernels.cuda_backend import CudaBackend

    monkeypatch.setenv("TRITON_CACHE_AUTOTUNING", "")  # (so that monkeypatch restores the variable's first state)
    monkeypatch.delenv("TRITON_CACHE_AUTOTUNING")
    CudaBackend(ReferenceAttention())
    assert os.environ["TRITON_CACHE_AUTOTUNING"] == "1"
    monkeypatch.setenv("TRITON_CACHE_AUTOTUNING", "0")  # a user's choice stands
    CudaBackend(ReferenceAttention())
    assert os.environ["TRITON_CACHE_AUTOTUNING"] == "0"


def test_an_autotuned_kernel_defined_after_it_caches_its_results(monkeypatch):
    """What the setting does in this Triton: an autotuner made after it (as fla's are, on their first import)
    writes its timings to the cache folder; one made with it off does not."""
    triton = pytest.importorskip("triton")
    knobs = pytest.importorskip("triton.knobs")

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    if knobs.runtime.interpret:
        pytest.skip("the interpreter never caches autotuning results")

    def make():
        @triton.autotune(configs=[triton.Config({}, num_warps=4)], key=[])
        @triton.jit
        def kernel(x_ptr):
            pass

        return kernel

    monkeypatch.setenv("TRITON_CACHE_AUTOTUNING", "1")
    assert make().cache_results
    monkeypatch.setenv("TRITON_CACHE_AUTOTUNING", "0")
    assert not make().cache_results
