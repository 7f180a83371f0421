"""Tiny random LFM2 and LFM2-MoE models (`Lfm2ForCausalLM`, `Lfm2MoeForCausalLM`) for the model and engine tests:
transformers' config and model, weights at std 1/sqrt(fan_in) (`randomize_`), every RMSNorm weight (operator_norm,
ffn_norm, q_layernorm / k_layernorm, embedding_norm) 1 + N(0, 0.1) (LFM2's norms are not zero-centred:
`randomize_`'s N(0, 0.1) would scale them to nothing), and each MoE block's `expert_bias` (a buffer `randomize_` leaves
at zero) N(0, 0.1), so that it changes the picks."""

from __future__ import annotations

import copy
from typing import Any

import torch

from hybridcache.models import ModelConfig, get_model_class, load_weights
from hybridcache.models.random_weights import randomize_

from .helpers import ModelPair

TINY_LFM2: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "num_hidden_layers": 5,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
    "norm_eps": 1e-5,
    "block_multiple_of": 16,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "dtype": "float32",
    "architectures": ["Lfm2ForCausalLM"],
}
VARIANTS: dict[str, dict[str, Any]] = {
    # as the released configs: layer_types, 3 taps, tied embeddings, the MLP width adjusted (2/3 of 144, rounded up to
    # a multiple of 16: 96); here with conv biases (the released ones have none)
    "bias-k3": {"layer_types": ["conv", "conv", "full_attention", "conv", "full_attention"], "conv_L_cache": 3,
                "conv_bias": True, "block_ff_dim": 144, "block_ffn_dim_multiplier": 1.0, "tie_embedding": True,
                "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}},
    # the older full_attn_idxs, 4 taps, no biases, untied, the width as written, an older-style rope_theta
    "idxs-k4": {"full_attn_idxs": [1, 3], "conv_L_cache": 4, "conv_bias": False, "intermediate_size": 80,
                "block_auto_adjust_ff_dim": False, "tie_word_embeddings": False, "rope_theta": 10000.0},
}
MOE_VARIANTS: dict[str, dict[str, Any]] = {
    # LFM2-MoE: one dense layer, then MoE blocks of 8 experts, top 3, renormalised and scaled by 2.5
    "moe-norm": {"layer_types": ["conv", "conv", "full_attention", "conv", "full_attention"], "num_dense_layers": 1,
                 "num_experts": 8, "num_experts_per_tok": 3, "moe_intermediate_size": 32, "intermediate_size": 96,
                 "routed_scaling_factor": 2.5, "norm_topk_prob": True, "tie_word_embeddings": False},
    # two dense layers, conv biases, weights as the router's scores (not renormalised), tied embeddings
    "moe-raw": {"layer_types": ["full_attention", "conv", "conv", "full_attention", "conv"], "num_dense_layers": 2,
                "num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 24, "intermediate_size": 80,
                "norm_topk_prob": False, "conv_bias": True, "conv_L_cache": 4},
}
VARIANTS.update(MOE_VARIANTS)


def lfm2_config(variant: str, **overrides: Any):
    import transformers

    moe = variant in MOE_VARIANTS
    cls = transformers.Lfm2MoeConfig if moe else transformers.Lfm2Config
    arch = {"architectures": ["Lfm2MoeForCausalLM" if moe else "Lfm2ForCausalLM"]}
    fields = {**TINY_LFM2, **arch, **VARIANTS[variant], **overrides}
    if moe:
        fields.pop("block_multiple_of")  # (not an Lfm2MoeConfig field)
    return cls(**copy.deepcopy(fields))


@torch.no_grad()
def randomize_lfm2_(model: torch.nn.Module, seed: int) -> None:
    randomize_(model, seed)
    generator = torch.Generator().manual_seed(seed + 1)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.copy_(1 + 0.1 * torch.randn(param.shape, generator=generator))
    for name, buffer in model.named_buffers():
        if name.endswith("expert_bias"):
            buffer.copy_(0.1 * torch.randn(buffer.shape, generator=generator))


def lfm2_model(variant: str, seed: int = 0, **overrides: Any):
    import transformers

    config = lfm2_config(variant, **overrides)
    model = getattr(transformers, config.architectures[0])(config).eval()
    randomize_lfm2_(model, seed)
    return model


def make_lfm2_pair(variant: str, seed: int = 0, **overrides: Any) -> ModelPair:
    hf = lfm2_model(variant, seed, **overrides)
    ours = get_model_class(hf.config.architectures[0])(ModelConfig.from_dict(hf.config.to_dict()))
    load_weights(ours, hf.state_dict())
    return ModelPair(hf.config, hf, ours)
