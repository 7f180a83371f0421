"""LFM2 and LFM2-MoE (gated short convolutions + attention; MoE blocks) through the engine: a short-conv layer's
state is one tensor, its conv's last inputs, which joins the slot like DeltaNet's and Mamba2's, so the pools, the
checkpoints and the prefix cache need no change; cached and uncached runs compute the same thing, the cache hits at
non-block-aligned steps; options that do not apply to it (MTP, FP8, images, TP) are clear errors
(`hybrid_family_checks`, run here on LFM2 folders)."""

from __future__ import annotations

from tests.models.lfm2_helpers import lfm2_model

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

# LFM2 and LFM2-MoE (transformers `save_pretrained` writes LFM2's own tensor names, the experts one by one)
# FP8 weights and KV: refused (the shared refusal test checks the model class's `supports_fp8` against it)
SERVES_FP8 = False
model_dir = tiny_model_dir_fixture(lfm2_model, ["bias-k3", "idxs-k4", "moe-norm"])
