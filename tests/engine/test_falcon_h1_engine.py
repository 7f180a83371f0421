"""Falcon-H1 (attention and Mamba2 side by side in every layer) through the engine: each decoder layer is two state
layers (its paged KV and its Mamba2 state), and the pools, the checkpoints and the prefix cache need no change for it:
cached and uncached runs compute the same thing, the cache hits at non-block-aligned steps, the split prefill equals
the unsplit one; dummy weights draw its norms around 1; options that do not apply to it (MTP, FP8, images, TP) are
clear errors (`hybrid_family_checks`)."""

from __future__ import annotations

import torch

from hybridcache.config import EngineConfig
from hybridcache.engine.engine import LLMEngine
from hybridcache.models import load_model
from tests.models.falcon_h1_helpers import falcon_model
from tests.models.helpers import PagedRunner, random_tokens

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

# FP8 weights and KV: refused (the shared refusal test checks the model class's `supports_fp8` against it)
SERVES_FP8 = False
model_dir = tiny_model_dir_fixture(falcon_model, ["norm-first", "no-norm"])


def test_the_engine_pools_hold_two_state_layers_a_decoder_layer(model_dir):
    engine = LLMEngine(model_dir, EngineConfig(num_blocks=64))
    pools, layers = engine.runner.pools, engine.runner.model.model.layers
    assert len(pools.layers) == 2 * len(layers)
    assert all(isinstance(pools.layers[2 * i], torch.Tensor) and set(pools.layers[2 * i + 1]) == {"conv", "ssm"}
               for i in range(len(layers)))


def test_dummy_weights_draw_the_norms_around_one(model_dir):
    model = load_model(model_dir, load_format="dummy")
    norms = {name: p for name, p in model.named_parameters() if name.endswith("norm.weight")}
    assert any(".mamba.norm." in name for name in norms) == ("no-norm" not in str(model_dir))
    assert all(0.5 < p.mean().item() < 1.5 for p in norms.values())
    (logits,) = PagedRunner(model, 16, 8).step([(0, random_tokens(50, seed=2))])
    assert torch.isfinite(logits).all() and logits.std() > 0
