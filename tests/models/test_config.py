"""ModelConfig parsing: transformers-5 and older layouts, nesting, derived sizes, errors; no torch import."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hybridcache.models import ModelConfig
from hybridcache.state_spec import AttentionSpec, RecurrentSpec

from .helpers import make_pair


def base_dict(**changes) -> dict:
    raw = {
        "architectures": ["Qwen3NextForCausalLM"],
        "model_type": "qwen3_next",
        "vocab_size": 1000,
        "hidden_size": 64,
        "num_hidden_layers": 8,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "intermediate_size": 96,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 16,
        "shared_expert_intermediate_size": 16,
        "decoder_sparse_step": 2,
        "mlp_only_layers": [3],
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 8,
        "linear_conv_kernel_dim": 4,
        "rope_theta": 5000.0,
        "partial_rotary_factor": 0.5,
        "eos_token_id": [5, 6],
        "torch_dtype": "bfloat16",
    }
    raw.update(changes)
    return raw


def test_older_layout_with_defaults():
    config = ModelConfig.from_dict(base_dict())
    assert config.layer_types == ("linear_attention",) * 3 + ("full_attention",) + (
        "linear_attention",
    ) * 3 + ("full_attention",)
    assert config.linear_layer_ids == (0, 1, 2, 4, 5, 6) and config.attention_layer_ids == (3, 7)
    assert (config.attention.rope_theta, config.attention.partial_rotary_factor, config.attention.rotary_dim) == (
        5000.0,
        0.5,
        16,
    )
    assert config.eos_token_ids == (5, 6) and config.torch_dtype == "bfloat16"
    assert config.gated_delta.conv_dim == 2 * 32 + 32 and config.gated_delta.conv_width == 3
    # sparse on odd layers (decoder_sparse_step 2) except layer 3 (mlp_only_layers)
    assert [config.is_moe_layer(i) for i in range(8)] == [False, True, False, False, False, True, False, True]


def test_transformers5_rope_parameters_and_multimodal_nesting():
    text = base_dict(
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 1e7,
            "partial_rotary_factor": 0.25,
            "mrope_section": [11, 11, 10],
            "mrope_interleaved": True,
        },
        model_type="qwen3_5_moe_text",
        dtype="float32",
    )
    raw = {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "text_config": text,
        "tie_word_embeddings": True,
        "eos_token_id": 9,
    }
    config = ModelConfig.from_dict(raw)
    assert config.model_type == "qwen3_5_moe_text" and config.architecture == raw["architectures"][0]
    assert (config.attention.rope_theta, config.attention.rotary_dim, config.torch_dtype) == (1e7, 8, "float32")
    assert config.tie_word_embeddings and config.eos_token_ids == (9,)
    assert all(config.is_moe_layer(i) for i in range(8))  # Qwen3.5-MoE: every layer


def test_round_trip_of_a_transformers_config_gives_matching_state_specs():
    pair = make_pair("qwen3_5_text")
    specs = pair.ours.state_specs(torch.float32, torch.float32)
    hf = pair.hf_config
    assert sum(isinstance(s, RecurrentSpec) for s in specs) == hf.layer_types.count("linear_attention")
    assert sum(isinstance(s, AttentionSpec) for s in specs) == hf.layer_types.count("full_attention")
    conv = pair.hf.model.layers[0].linear_attn.conv1d.weight
    (conv_spec,) = (t for t in specs[0].tensors if t.name == "conv")
    assert conv_spec.shape == (conv.shape[0], conv.shape[-1] - 1)


@pytest.mark.parametrize(
    "changes,message",
    [
        ({"architectures": []}, "architectures"),
        ({"model_type": "mamba2"}, "unsupported model_type"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
        ({"hidden_act": "gelu"}, "gelu"),
        ({"layer_types": ["linear_attention"] * 7}, "layer_types"),
        ({"num_key_value_heads": 3}, "kv heads"),
    ],
)
def test_unsupported_settings_raise(changes, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict(base_dict(**changes))


def test_generation_config_eos_ids_are_merged(tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps(base_dict(eos_token_id=5)))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 7]}))
    assert ModelConfig.from_model_dir(tmp_path).eos_token_ids == (5, 7)


def test_config_module_does_not_import_torch():
    code = "import sys; from hybridcache.models import ModelConfig; print('torch' in sys.modules)"
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root, env=env
    )
    assert result.stdout.strip() == "False"
