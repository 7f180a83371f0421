"""Tiny random OLMo Hybrid models (`OlmoHybridForCausalLM`) for the model and engine tests: transformers' config and
model, weights at std 1/sqrt(fan_in) (`randomize_`), every RMSNorm weight (the layer norms, q_norm / k_norm, the
DeltaNet's o_norm) 1 + N(0, 0.1) (OLMo's norms are not zero-centred: `randomize_`'s N(0, 0.1) would scale them to
nothing)."""

from __future__ import annotations

import copy
from typing import Any

import torch

from hybridcache.models import ModelConfig, get_model_class, load_weights
from hybridcache.models.random_weights import randomize_

from .helpers import ModelPair

TINY_OLMO: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 5,
    "layer_types": ["linear_attention", "linear_attention", "full_attention", "linear_attention", "full_attention"],
    "num_attention_heads": 4,
    "linear_conv_kernel_dim": 4,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "pad_token_id": 0,
    "eos_token_id": 2,
    "dtype": "float32",
    "architectures": ["OlmoHybridForCausalLM"],
}
VARIANTS: dict[str, dict[str, Any]] = {
    # as the released checkpoints: no RoPE (rope_theta null), beta up to 2; here with 2 key heads for 4 value heads
    "nope-gva": {"rope_parameters": {"rope_theta": None}, "num_key_value_heads": 2, "linear_num_key_heads": 2,
                 "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
                 "linear_allow_neg_eigval": True},
    # RoPE (theta 500,000), attention biases, beta in (0, 1), the DeltaNet dims left out (transformers derives 4 key
    # and value heads, key head dim 0.75 * 64 / 4 = 12, value head dim 24: not powers of two, as the 7B's 96 / 192)
    "rope-bias": {"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}, "attention_bias": True,
                  "linear_allow_neg_eigval": False},
}


def olmo_config(variant: str, **overrides: Any):
    import transformers

    return transformers.OlmoHybridConfig(**copy.deepcopy({**TINY_OLMO, **VARIANTS[variant], **overrides}))


@torch.no_grad()
def randomize_olmo_(model: torch.nn.Module, seed: int) -> None:
    randomize_(model, seed)
    generator = torch.Generator().manual_seed(seed + 1)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.copy_(1 + 0.1 * torch.randn(param.shape, generator=generator))


def olmo_model(variant: str, seed: int = 0, **overrides: Any):
    import transformers

    model = transformers.OlmoHybridForCausalLM(olmo_config(variant, **overrides)).eval()
    randomize_olmo_(model, seed)
    return model


def make_olmo_pair(variant: str, seed: int = 0, **overrides: Any) -> ModelPair:
    hf = olmo_model(variant, seed, **overrides)
    ours = get_model_class("OlmoHybridForCausalLM")(ModelConfig.from_dict(hf.config.to_dict()))
    load_weights(ours, hf.state_dict())
    return ModelPair(hf.config, hf, ours)
