"""Jamba (Mamba1, attention, dense and MoE feed-forward blocks) through the engine: a Mamba1 layer's conv [I, K-1]
and ssm [I, N] state join the slot like any recurrent layer's, so the pools, the checkpoints and the prefix cache need
no change; cached and uncached runs compute the same thing, the cache hits at non-block-aligned steps; options that
do not apply to it (MTP, FP8, images, TP) are clear errors (`hybrid_family_checks`)."""

from __future__ import annotations

import torch

from hybridcache.config import EngineConfig
from hybridcache.engine.engine import LLMEngine
from tests.models.jamba_helpers import jamba_model

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
from .test_cache_equivalence import finish_one, make_engine

# (transformers `save_pretrained` writes the hub checkpoints' names: model.final_layernorm, the experts one by one)
# FP8 weights and KV: refused (the shared refusal test checks the model class's `supports_fp8` against it)
SERVES_FP8 = False
model_dir = tiny_model_dir_fixture(jamba_model, ["moe", "dense"])


def test_the_mamba1_state_pools_follow_the_ssm_cache_dtype(model_dir):
    """The Mamba1 layers' state: conv [I, K-1] in the model dtype, ssm [I, N] in `mamba_ssm_cache_dtype`."""
    engine = LLMEngine(model_dir, EngineConfig(mamba_ssm_cache_dtype="bfloat16", num_blocks=64))
    states = [state for state in engine.runner.pools.layers if isinstance(state, dict) and state]
    config = engine.model_config
    assert len(states) == len(config.mamba1_layer_ids) == 4
    m = config.mamba1
    for state in states:
        assert state["ssm"].shape[1:] == (m.intermediate_size, m.state_size) and state["ssm"].dtype == torch.bfloat16
        assert state["conv"].shape[1:] == (m.intermediate_size, m.conv_width) and state["conv"].dtype == torch.float32
    assert len(finish_one(engine, "r", [5, 6, 7], 3).outputs[0].token_ids) == 3


def test_dummy_weights_serve(model_dir):
    """`load_format="dummy"` draws every weight (the Mamba1 layers' A_log, D, dt_proj and their norms around 1): the
    engine generates finite logits and the cached run equals the uncached one."""
    engine, reference = (make_engine(model_dir, load_format="dummy", caching=caching) for caching in (True, False))
    for name, param in engine.runner.model.named_parameters():
        if name.endswith("layernorm.weight"):
            assert 0.5 < param.mean().item() < 1.5, name
    prompt = list(range(40, 140))
    first = finish_one(engine, "a", prompt, 4)
    assert finish_one(engine, "b", prompt + [7], 4).num_cached_tokens > 0
    assert first.outputs[0].token_ids == finish_one(reference, "a", prompt, 4).outputs[0].token_ids
    engine.check_integrity()
