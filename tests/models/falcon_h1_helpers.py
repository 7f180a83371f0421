"""Tiny random Falcon-H1 models (`FalconH1ForCausalLM`) for the model and engine tests: transformers' config and model,
every muP multiplier away from 1, weights at std 1/sqrt(fan_in) and every RMSNorm weight 1 + N(0, 0.1)
(`randomize_granite_`: Falcon-H1's norms are Granite's)."""

from __future__ import annotations

from typing import Any

from hybridcache.models import ModelConfig, get_model_class, load_weights

from .granite_helpers import randomize_granite_
from .helpers import ModelPair

TINY_FALCON: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "mamba_n_heads": 8,
    "mamba_d_ssm": 96,  # (heads of 12; not mamba_expand x hidden_size)
    "mamba_d_state": 16,
    "mamba_d_conv": 4,
    "mamba_chunk_size": 32,
    "intermediate_size": 96,
    "max_position_embeddings": 4096,
    "embedding_multiplier": 2.0,
    "lm_head_multiplier": 0.6,
    "key_multiplier": 0.7,
    "attention_in_multiplier": 1.3,
    "attention_out_multiplier": 0.8,
    "ssm_in_multiplier": 0.9,
    "ssm_out_multiplier": 1.4,
    "mlp_multipliers": [0.8, 1.3],
    "ssm_multipliers": [0.5, 1.7, 0.3, 2.2, 0.6],
    "tie_word_embeddings": False,
    "eos_token_id": 2,
    "dtype": "float32",
    "architectures": ["FalconH1ForCausalLM"],
}
VARIANTS: dict[str, dict[str, Any]] = {
    # the gated norm after the norm (FalconH1Config's default), two groups, head_dim not hidden / heads, out_proj bias
    "norm-first": {"mamba_rms_norm": True, "mamba_norm_before_gate": True, "mamba_n_groups": 2, "head_dim": 24,
                   "projectors_bias": True},
    # the gate before the norm (as the published configs say), attention and in_proj biases, no conv bias, tied
    "gate-first": {"mamba_rms_norm": True, "mamba_norm_before_gate": False, "mamba_n_groups": 1,
                   "attention_bias": True, "mamba_proj_bias": True, "mamba_conv_bias": False,
                   "tie_word_embeddings": True},
    # no gated norm (Falcon-H1-0.5B's mamba_rms_norm false: y * silu(z)), the published rope_theta 1e11
    "no-norm": {"mamba_rms_norm": False, "mamba_n_groups": 2,
                "rope_parameters": {"rope_type": "default", "rope_theta": 1e11}},
}


def falcon_config(variant: str, **overrides: Any):
    import transformers

    return transformers.FalconH1Config(**{**TINY_FALCON, **VARIANTS[variant], **overrides})


def falcon_model(variant: str, seed: int = 0, **overrides: Any):
    import transformers

    model = transformers.FalconH1ForCausalLM(falcon_config(variant, **overrides)).eval()
    randomize_granite_(model, seed)
    return model


def make_falcon_pair(variant: str, seed: int = 0, **overrides: Any) -> ModelPair:
    hf = falcon_model(variant, seed, **overrides)
    ours = get_model_class("FalconH1ForCausalLM")(ModelConfig.from_dict(hf.config.to_dict()))
    load_weights(ours, hf.state_dict())
    return ModelPair(hf.config, hf, ours)
