"""Granite-4.0-H (`GraniteMoeHybridForCausalLM`) vs transformers on tiny random models (dense with RoPE, MoE without
it; multipliers away from 1), fp32, and its config parsing and refusals.

Every comparison: rel_err = max|ours - hf| / max|hf| <= 1e-4, with hf = transformers' full forward over the whole
sequence (explicit position_ids), read at the positions our step computed.
"""

from __future__ import annotations

import json

import pytest
import torch

from hybridcache.layers.parallel import TensorParallel
from hybridcache.models import ModelConfig, get_model_class, load_model
from hybridcache.models.config import LayerKind

from .granite_helpers import VARIANTS, granite_config, granite_model, make_granite_pair
from .helpers import TOLERANCE, PagedRunner, random_tokens, rel_err
from .hybrid_family_checks import (  # noqa: F401 - collected here, on this file's `pair`
    test_decode_after_prefill_matches_full_and_incremental_forward,
    test_mixed_batch_of_prefill_chunks_and_decodes,
    test_single_prefill_and_chunked_prefill,
    test_the_comparison_notices_a_lost_recurrent_state,
)


@pytest.fixture(scope="module", params=list(VARIANTS), ids=list(VARIANTS))
def pair(request):
    return make_granite_pair(request.param)


def test_config_reads_the_granite_fields():
    config = ModelConfig.from_dict(granite_config("moe-nope").to_dict())
    assert config.layer_types == (LayerKind.MAMBA2, LayerKind.MAMBA2, LayerKind.FULL_ATTENTION, LayerKind.MAMBA2,
                                  LayerKind.FULL_ATTENTION)
    assert config.mamba2_layer_ids == (0, 1, 3) and config.recurrent_layer_ids == (0, 1, 3)
    assert config.linear_layer_ids == ()  # no gated DeltaNet layer
    m = config.mamba2
    assert (m.num_heads, m.head_dim, m.num_groups, m.state_size, m.conv_dim) == (8, 16, 2, 16, 128 + 2 * 2 * 16)
    assert not config.attention.use_rope and config.attention.softmax_scale == 0.2
    assert (config.multipliers.embedding, config.multipliers.residual, config.multipliers.logits_scaling) == (
        2.0, 0.5, 3.0)
    assert (config.mlp.num_experts, config.mlp.moe_intermediate_size, config.mlp.shared_expert_intermediate_size) == (
        4, 32, 96)
    dense = ModelConfig.from_dict(granite_config("dense-rope").to_dict())
    assert dense.attention.use_rope and dense.attention.rotary_dim == 16 and dense.mlp.num_experts == 0
    assert dense.mlp.intermediate_size == 96  # the shared MLP is the dense MLP


def test_config_reads_hub_spellings():
    """As the published config.json files write them: "mamba" / "attention" layer names (or the older
    layers_block_type key), mamba_d_head "auto", time_step_limit with an infinite bound."""
    raw = granite_config("moe-nope").to_dict()
    raw["layers_block_type"] = raw.pop("layer_types")
    raw.update(mamba_d_head="auto", time_step_limit=[0.0, {"__float__": "Infinity"}])
    config = ModelConfig.from_dict(raw)
    assert config.layer_types[2] is LayerKind.FULL_ATTENTION and config.mamba2.head_dim == 16
    assert config.mamba2.time_step_limit == (0.0, float("inf"))
    raw.update(time_step_limit=[0.001, 100.0])
    assert ModelConfig.from_dict(raw).mamba2.time_step_limit == (0.001, 100.0)


@pytest.mark.parametrize("field, value, message", [
    ("position_embedding_type", "alibi", "position_embedding_type"),
    ("mamba_d_head", 12, "mamba_d_head"),
    ("mamba_n_groups", 3, "mamba_n_groups"),
    ("time_step_limit", [1.0, 0.5], "time_step_limit"),
    ("layer_types", ["mamba", "gated_deltanet", "attention", "mamba", "attention"], "layer_types"),
])
def test_config_refuses_what_it_cannot_run(field, value, message):
    raw = {**granite_config("moe-nope").to_dict(), field: value}
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict(raw)


def test_qwen_configs_do_not_accept_mamba_layers():
    from hybridcache.models.random_weights import tiny_hf_config

    raw = tiny_hf_config("qwen3_5_text").to_dict()
    raw["layer_types"] = ["mamba"] + raw["layer_types"][1:]
    with pytest.raises(ValueError, match="layer_types"):
        ModelConfig.from_dict(raw)


def test_tensor_parallelism_is_refused_with_a_clear_error(tmp_path):
    """(FP8 weights and KV are served: tests/models/test_fp8_mamba2_hybrids.py.)"""
    config = ModelConfig.from_dict(granite_config("dense-rope").to_dict())
    with pytest.raises(ValueError, match="tensor parallelism"):
        get_model_class(config.architecture)(config, TensorParallel(rank=0, size=2))
    granite_model("dense-rope").save_pretrained(tmp_path)
    model = load_model(tmp_path)  # and the folder itself loads, under its checkpoint's tensor names
    assert type(model).__name__ == "GraniteMoeHybridForCausalLM"


def test_moe_folder_loads_from_the_checkpoint_tensor_names(tmp_path):
    """save_pretrained writes the MoE block as the checkpoints do (input_linear, output_linear, router.layer)."""
    from safetensors import safe_open

    hf = granite_model("moe-nope")
    hf.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as handle:
        names = set(handle.keys())
    assert "model.layers.0.block_sparse_moe.input_linear.weight" in names
    assert "model.layers.0.block_sparse_moe.router.layer.weight" in names
    assert json.loads((tmp_path / "config.json").read_text())["layer_types"][0] == "linear_attention"
    ours = load_model(tmp_path)
    tokens = random_tokens(40, seed=7)
    (logits,) = PagedRunner(ours, 16, 8).step([(0, tokens)])
    with torch.no_grad():
        want = hf(input_ids=torch.tensor([tokens]), position_ids=torch.arange(40)[None]).logits[0]
    assert rel_err(logits, want) <= TOLERANCE


def test_defaults_are_transformers_defaults():
    """The fields config.json may leave out take `GraniteMoeHybridConfig`'s defaults."""
    import transformers

    from hybridcache.models.config.defaults import DEFAULTS

    hf = transformers.GraniteMoeHybridConfig()
    for key, value in DEFAULTS["granitemoehybrid"].items():
        if key in ("rope_theta", "partial_rotary_factor"):
            continue  # (in rope_parameters: checked below)
        want = "auto" if key == "mamba_d_head" else getattr(hf, key)  # (hf resolves "auto" when built)
        assert value == want, key
    assert DEFAULTS["granitemoehybrid"]["rope_theta"] == hf.rope_parameters["rope_theta"]
    minimal = {"architectures": ["GraniteMoeHybridForCausalLM"], "model_type": "granitemoehybrid",
               "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
               "mamba_n_heads": 8}
    config = ModelConfig.from_dict(minimal)
    assert config.attention.num_kv_heads == 4 and config.attention.head_dim == 16
    assert config.layer_types == (LayerKind.MAMBA2, LayerKind.MAMBA2) and config.mamba2.head_dim == 16
    assert config.mlp.num_experts == hf.num_local_experts and not config.attention.use_rope
