"""Tiny random Bamba models (`BambaForCausalLM`) for the model and engine tests: transformers' config and model,
weights at std 1/sqrt(fan_in) and every RMSNorm weight 1 + N(0, 0.1) (`randomize_granite_`: Bamba's norms are
Granite's)."""

from __future__ import annotations

from typing import Any

from hybridcache.models import ModelConfig, get_model_class, load_weights

from .granite_helpers import randomize_granite_
from .helpers import ModelPair

TINY_BAMBA: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "num_hidden_layers": 5,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "mamba_n_heads": 8,
    "mamba_d_head": 16,
    "mamba_d_state": 16,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "mamba_chunk_size": 32,
    "intermediate_size": 96,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "eos_token_id": 2,
    "dtype": "float32",
    "architectures": ["BambaForCausalLM"],
}
VARIANTS: dict[str, dict[str, Any]] = {
    # Bamba-9B's layout: attention layers by index, half of each head rotated (BambaConfig's 0.5), two B / C groups
    "groups2": {"attn_layer_indices": [2, 4], "mamba_n_groups": 2},
    # a quarter of each head rotated (rope_parameters' factor wins), head_dim not hidden / heads, attention and
    # in_proj / out_proj biases, no conv bias, one group, tied embeddings
    "bias-rope": {"attn_layer_indices": [1], "mamba_n_groups": 1, "head_dim": 24, "attention_bias": True,
                  "mamba_proj_bias": True, "mamba_conv_bias": False, "tie_word_embeddings": True,
                  "rope_parameters": {"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.25}},
}


def bamba_config(variant: str, **overrides: Any):
    import transformers

    return transformers.BambaConfig(**{**TINY_BAMBA, **VARIANTS[variant], **overrides})


def bamba_model(variant: str, seed: int = 0, **overrides: Any):
    import transformers

    model = transformers.BambaForCausalLM(bamba_config(variant, **overrides)).eval()
    randomize_granite_(model, seed)
    return model


def make_bamba_pair(variant: str, seed: int = 0, **overrides: Any) -> ModelPair:
    hf = bamba_model(variant, seed, **overrides)
    ours = get_model_class("BambaForCausalLM")(ModelConfig.from_dict(hf.config.to_dict()))
    load_weights(ours, hf.state_dict())
    return ModelPair(hf.config, hf, ours)
