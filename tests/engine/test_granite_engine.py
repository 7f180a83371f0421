"""Granite-4.0-H (Mamba2 + attention) through the engine: prefix caching needs no change for a new recurrent family
(its conv and ssm state join the slot like DeltaNet's), so cached and uncached runs compute the same thing, and the
cache hits at non-block-aligned steps; options that do not apply to it (MTP, images, TP) are clear errors (FP8:
test_fp8_mamba2_hybrids_engine.py)."""

from __future__ import annotations

from tests.models.granite_helpers import granite_model

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

# FP8 weights and KV: served (the shared refusal test checks the model class's `supports_fp8` against it)
SERVES_FP8 = True
model_dir = tiny_model_dir_fixture(granite_model, ["moe-nope", "dense-rope"])
