"""OLMo Hybrid (gated DeltaNet + post-norm attention) through the engine: its DeltaNet state is Qwen's (conv + ssm in
the slot), so the pools, the checkpoints and the prefix cache need no change; cached and uncached runs compute the
same thing, the cache hits at non-block-aligned steps; options that do not apply to it (MTP, FP8, images, TP) are
clear errors (`mamba2_hybrid_engine_checks`, run here on OLMo folders)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.models.olmo_hybrid_helpers import olmo_model

from .mamba2_hybrid_engine_checks import (  # noqa: F401 - collected here, on this file's `model_dir`
    test_cached_run_equals_uncached_run,
    test_cuda_fp32_cached_run_equals_uncached_run,
    test_llm_generate_with_and_without_the_prefix_cache,
    test_options_that_do_not_apply_are_clear_errors,
    test_shared_prefixes_of_unaligned_lengths_hit_at_the_divergence_step,
    test_split_forward_equals_unsplit_on_cpu,
    write_tiny_folder,
)


def write_tiny_olmo(path: Path, variant: str, seed: int = 0) -> Path:
    """A tiny random OLMo Hybrid folder over the byte tokenizer's 320 ids (transformers `save_pretrained`, which writes
    the conv as the checkpoints' q_conv1d / k_conv1d / v_conv1d). The DeltaNet head dims: "nope-gva" 16 and 32
    (powers of two), "rope-bias" transformers' derived 12 and 24 (not, as the 7B's 96 / 192: the CUDA check here runs
    the step and verify kernels' padded, masked tiles)."""
    dims = {"linear_key_head_dim": 16, "linear_value_head_dim": 32} if variant == "nope-gva" else {}
    return write_tiny_folder(olmo_model(variant, seed, vocab_size=320, eos_token_id=258, **dims), path)


@pytest.fixture(scope="module", params=["nope-gva", "rope-bias"])
def model_dir(request, tmp_path_factory):
    return write_tiny_olmo(tmp_path_factory.mktemp(request.param), request.param)
