"""FP8 checkpoints of the Mamba2 hybrids through the engine on the CPU (fp32 compute): Nemotron-H in NVIDIA ModelOpt
FP8 and Granite-4.0-H in llm-compressor's FP8_DYNAMIC layout (`fp8_folders.write_fp8_folder`; their logits against
transformers: tests/models/test_fp8_mamba2_hybrids.py). Cached and uncached runs compute the same tokens and logits
with `check_integrity()` at every step, with the model-dtype KV and with FP8 KV (`kv_cache_dtype="fp8"`, the
checkpoint's KV scales); the startup state names the format. On CUDA (skipped without one) both folders serve
cached == uncached on the FP8 GEMMs and grouped experts: Granite's SiLU-gated experts, Nemotron-H's relu^2 ones
(the FP8 expert GEMM's relu^2 epilogue) beside its shared expert's dense FP8 linears; in fp32, the engine's exact
mode, without quantising activations (the dense FP8 linears dequantise, the experts run W8A16:
`triton_fp8_moe.fp8_exact`; their W8A8 e4m3 rounding of x is a step function that a cached and an uncached run
could land on either side of, which failed the Granite case)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hybridcache.models.fp8_folders import write_fp8_folder
from hybridcache.server.engine_state import read_engine_state
from tests.models.granite_helpers import granite_model
from tests.models.nemotron_helpers import nemotron_model

from .hybrid_family_checks import (
    test_cached_run_equals_uncached_run,  # noqa: F401 - on `model_dir` here
    test_cuda_backend_takes_the_folder,  # noqa: F401 - on `model_dir` here
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
@pytest.mark.parametrize("case", list(FOLDERS))
def test_cuda_fp8_hybrid_serves_cached_equal_to_uncached(case, tmp_path):
    """On CUDA each FP8 folder serves cached == uncached with `check_integrity()` at every step, its MoE layers on
    the CUDA backend's FP8 grouped experts (their stack's activation: Granite's SiLU-gated, Nemotron-H's relu^2,
    which the CUDA backend refused before it had the relu^2 epilogue), some tokens served from the cache."""
    folder = write_fp8_hybrid(tmp_path, case)
    uncached, cached = make_engine(folder, caching=False, **CUDA_FP32), make_engine(folder, **CUDA_FP32)
    out_cached = run_workload(cached, check_every_step=True)
    assert_same(cached, uncached, out_cached, run_workload(uncached))
    assert sum(o.num_cached_tokens for o in out_cached.values()) > 0
    from hybridcache.kernels.gemm.triton_fp8_moe import Fp8ExpertWeights

    stacks = list(cached.runner.backend._experts.values())
    assert stacks and all(isinstance(stack, Fp8ExpertWeights) for stack in stacks)
    assert {stack.activation for stack in stacks} == {"relu2" if "nemotron" in case else "silu_gated"}
