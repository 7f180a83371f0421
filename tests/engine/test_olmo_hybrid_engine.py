"""OLMo Hybrid (gated DeltaNet + post-norm attention) through the engine: its DeltaNet state is Qwen's (conv + ssm in
the slot), so the pools, the checkpoints and the prefix cache need no change; cached and uncached runs compute the
same thing, the cache hits at non-block-aligned steps; options that do not apply to it (MTP, FP8, images, TP) are
clear errors (`hybrid_family_checks`, run here on OLMo folders)."""

from __future__ import annotations

import torch

from tests.models.olmo_hybrid_helpers import olmo_model

from .hybrid_family_checks import (  # noqa: F401 - collected here, on this file's `model_dir`
    compile_recorder,
    test_cached_run_equals_uncached_run,
    test_cuda_backend_takes_the_folder,
    test_cuda_fp32_cached_run_equals_uncached_run,
    test_llm_generate_with_and_without_the_prefix_cache,
    test_options_that_do_not_apply_are_clear_errors,
    test_serving_compiles_no_kernel_after_start_up,
    test_shared_prefixes_of_unaligned_lengths_hit_at_the_divergence_step,
    test_split_forward_equals_unsplit_on_cpu,
    tiny_model_dir_fixture,
)


def olmo_model_for_kernels(variant: str, seed: int, **kwargs) -> torch.nn.Module:
    """A tiny random OLMo Hybrid (transformers' model: `save_pretrained` writes the conv as the checkpoints' q_conv1d /
    k_conv1d / v_conv1d). The DeltaNet head dims: "nope-gva" 16 and 32 (powers of two), "rope-bias" transformers'
    derived 12 and 24 (not, as the 7B's 96 / 192: the CUDA check here runs the step and verify kernels' padded,
    masked tiles)."""
    dims = {"linear_key_head_dim": 16, "linear_value_head_dim": 32} if variant == "nope-gva" else {}
    return olmo_model(variant, seed, **kwargs, **dims)


# FP8 weights and KV: refused (the shared refusal test checks the model class's `supports_fp8` against it)
SERVES_FP8 = False
model_dir = tiny_model_dir_fixture(olmo_model_for_kernels, ["nope-gva", "rope-bias"])
