"""FP8 checkpoints of the Mamba2 hybrids through the engine on the CPU (fp32 compute): Nemotron-H in NVIDIA ModelOpt
FP8 and Granite-4.0-H in llm-compressor's FP8_DYNAMIC layout (`fp8_folders.write_fp8_folder`; their logits against
transformers: tests/models/test_fp8_mamba2_hybrids.py). Cached and uncached runs compute the same tokens and logits
with `check_integrity()` at every step, with the model-dtype KV and with FP8 KV (`kv_cache_dtype="fp8"`, the
checkpoint's KV scales); the startup state names the format. On CUDA (skipped without one) Granite's FP8 runs the
FP8 GEMMs and grouped experts; Nemotron-H's FP8 relu^2 experts are refused by the CUDA backend with a clear error
(its FP8 grouped GEMM is SiLU-gated only)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hybridcache.models.fp8_folders import write_fp8_folder
from hybridcache.server.engine_state import read_engine_state
from tests.models.granite_helpers import granite_model
from tests.models.nemotron_helpers import nemotron_model

from .mamba2_hybrid_engine_checks import (
    test_cached_run_equals_uncached_run,  # noqa: F401 - on `model_dir` here
    write_tiny_folder,
)
from .markers import needs_cuda_engine
from .test_cache_equivalence import CUDA_FP32, assert_same, make_engine, run_workload

FOLDERS = {"nemotron-moe-modelopt": (nemotron_model, "moe-groups", "modelopt"),
           "granite-moe-channel": (granite_model, "moe-nope", "channel")}


def write_fp8_hybrid(path: Path, case: str) -> Path:
    """A tiny random folder of the case's family over the byte tokenizer's 320 ids, in the case's FP8 layout."""
    make, variant, kind = FOLDERS[case]
    dense = write_tiny_folder(make(variant, 0, vocab_size=320, eos_token_id=258), path / "dense")
    return write_fp8_folder(dense, path / kind, kind)


@pytest.fixture(scope="module", params=list(FOLDERS))
def model_dir(request, tmp_path_factory):
    return write_fp8_hybrid(tmp_path_factory.mktemp(request.param), request.param)


def test_fp8_kv_cached_run_equals_uncached_run(model_dir):
    """With FP8 KV the pools are e4m3 and the cache copies them as bytes: cached == uncached, token for token and
    logit for logit, integrity checked at every step; the state names the weight format and the KV dtype."""
    uncached = make_engine(model_dir, caching=False, kv_cache_dtype="fp8")
    cached = make_engine(model_dir, kv_cache_dtype="fp8")
    assert all(pool.dtype == torch.float8_e4m3fn for pool in cached.runner.pools.kv_groups)
    out_uncached = run_workload(uncached)
    out_cached = run_workload(cached, check_every_step=True)
    assert_same(cached, uncached, out_cached, out_uncached)
    assert sum(o.num_cached_tokens for o in out_cached.values()) > 0
    state = read_engine_state(cached)
    assert state.kv_cache_dtype == "fp8_e4m3"
    assert state.weights == ("fp8-channel (modelopt)" if "modelopt" in str(model_dir) else "fp8-channel")


@needs_cuda_engine
def test_cuda_fp8_granite_runs_and_nemotrons_fp8_experts_are_refused(tmp_path):
    """On CUDA: Granite's FP8 folder serves cached == uncached (FP8 GEMMs, SiLU-gated FP8 grouped experts); a
    Nemotron-H FP8 MoE folder stops at the engine's first forward with the backend's ValueError naming relu2."""
    granite = write_fp8_hybrid(tmp_path / "granite", "granite-moe-channel")
    uncached, cached = make_engine(granite, caching=False, **CUDA_FP32), make_engine(granite, **CUDA_FP32)
    assert_same(cached, uncached, run_workload(cached, check_every_step=True), run_workload(uncached))
    nemotron = write_fp8_hybrid(tmp_path / "nemotron", "nemotron-moe-modelopt")
    with pytest.raises(ValueError, match="FP8 experts run the SiLU-gated activation only, not 'relu2'"):
        run_workload(make_engine(nemotron, **CUDA_FP32))
