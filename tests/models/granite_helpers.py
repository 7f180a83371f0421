"""Tiny random Granite-4.0-H models (`GraniteMoeHybridForCausalLM`) for the model and engine tests: transformers'
config and model, weights at std 1/sqrt(fan_in) (`randomize_`), every RMSNorm weight 1 + N(0, 0.1) (Granite's norms
are not zero-centred: `randomize_`'s N(0, 0.1) would scale them to nothing)."""

from __future__ import annotations

from typing import Any

import torch

from hybridcache.models import ModelConfig, get_model_class, load_weights
from hybridcache.models.random_weights import randomize_

from .helpers import ModelPair

TINY_GRANITE: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "num_hidden_layers": 5,
    "layer_types": ["mamba", "mamba", "attention", "mamba", "attention"],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "mamba_n_heads": 8,
    "mamba_d_head": 16,
    "mamba_n_groups": 2,
    "mamba_d_state": 16,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "mamba_chunk_size": 32,
    "shared_intermediate_size": 96,
    "max_position_embeddings": 4096,
    "embedding_multiplier": 2.0,
    "residual_multiplier": 0.5,
    "attention_multiplier": 0.2,
    "logits_scaling": 3.0,
    "tie_word_embeddings": False,
    "eos_token_id": 2,
    "dtype": "float32",
    "architectures": ["GraniteMoeHybridForCausalLM"],
}
VARIANTS: dict[str, dict[str, Any]] = {
    "dense-rope": {"num_local_experts": 0, "position_embedding_type": "rope"},
    "moe-nope": {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32,
                 "position_embedding_type": "nope"},
}


def granite_config(variant: str, **overrides: Any):
    import transformers

    return transformers.GraniteMoeHybridConfig(**{**TINY_GRANITE, **VARIANTS[variant], **overrides})


@torch.no_grad()
def randomize_granite_(model: torch.nn.Module, seed: int) -> None:
    randomize_(model, seed)
    generator = torch.Generator().manual_seed(seed + 1)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.copy_(1 + 0.1 * torch.randn(param.shape, generator=generator))


def granite_model(variant: str, seed: int = 0, **overrides: Any):
    import transformers

    config = granite_config(variant, **overrides)
    model = transformers.GraniteMoeHybridForCausalLM(config).eval()
    randomize_granite_(model, seed)
    return model


def make_granite_pair(variant: str, seed: int = 0, **overrides: Any) -> ModelPair:
    hf = granite_model(variant, seed, **overrides)
    ours = get_model_class("GraniteMoeHybridForCausalLM")(ModelConfig.from_dict(hf.config.to_dict()))
    load_weights(ours, hf.state_dict())
    return ModelPair(hf.config, hf, ours)
