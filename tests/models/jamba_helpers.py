"""Tiny random Jamba models (`JambaForCausalLM`) for the model and engine tests: transformers' config and model,
weights at std 1/sqrt(fan_in) (`randomize_`), every RMSNorm weight 1 + N(0, 0.1) (Jamba's norms, the dt / B / C norms
inside its Mamba1 layers included, are not zero-centred: `randomize_`'s N(0, 0.1) would scale them to nothing)."""

from __future__ import annotations

from typing import Any

import torch

from hybridcache.models import ModelConfig, get_model_class, load_weights
from hybridcache.models.random_weights import randomize_

from .helpers import ModelPair

TINY_JAMBA: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "num_hidden_layers": 6,
    "attn_layer_period": 3,
    "attn_layer_offset": 1,  # attention at layers 1 and 4, Mamba1 elsewhere
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 96,
    "mamba_d_state": 16,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "mamba_dt_rank": 8,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "eos_token_id": 2,
    "dtype": "float32",
    "architectures": ["JambaForCausalLM"],
}
VARIANTS: dict[str, dict[str, Any]] = {
    # one expert: a dense MLP after every mixer; head_dim not hidden / heads; biases on
    # in_proj / out_proj, none on the conv
    "dense": {"num_experts": 1, "head_dim": 24, "mamba_proj_bias": True, "mamba_conv_bias": False,
              "tie_word_embeddings": False},
    # MoE blocks at layers 1, 3, 5 (an attention layer and two Mamba1 layers), top 2 of 4 experts; tied embedding
    "moe": {"num_experts": 4, "num_experts_per_tok": 2, "expert_layer_period": 2, "expert_layer_offset": 1,
            "tie_word_embeddings": True},
}


def jamba_config(variant: str, **overrides: Any):
    import transformers

    return transformers.JambaConfig(**{**TINY_JAMBA, **VARIANTS[variant], **overrides})


@torch.no_grad()
def randomize_jamba_(model: torch.nn.Module, seed: int) -> None:
    randomize_(model, seed)
    generator = torch.Generator().manual_seed(seed + 1)
    for name, param in model.named_parameters():
        if name.endswith("layernorm.weight"):
            param.copy_(1 + 0.1 * torch.randn(param.shape, generator=generator))


def jamba_model(variant: str, seed: int = 0, **overrides: Any):
    import transformers

    model = transformers.JambaForCausalLM(jamba_config(variant, **overrides)).eval()
    randomize_jamba_(model, seed)
    return model


def make_jamba_pair(variant: str, seed: int = 0, **overrides: Any) -> ModelPair:
    hf = jamba_model(variant, seed, **overrides)
    ours = get_model_class("JambaForCausalLM")(ModelConfig.from_dict(hf.config.to_dict()))
    load_weights(ours, hf.state_dict())
    return ModelPair(hf.config, hf, ours)
