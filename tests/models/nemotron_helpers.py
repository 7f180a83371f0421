"""Tiny random Nemotron-H models (`NemotronHForCausalLM`) for the model and engine tests: transformers' config and
model, weights at std 1/sqrt(fan_in) (`randomize_`), every RMSNorm weight 1 + N(0, 0.1) (Nemotron-H's norms are not
zero-centred: `randomize_`'s N(0, 0.1) would scale them to nothing), and each MoE router's
`e_score_correction_bias` (a buffer `randomize_` leaves at zero) N(0, 0.1), so that it changes the picks."""

from __future__ import annotations

from typing import Any

import torch

from hybridcache.models import ModelConfig, get_model_class, load_weights
from hybridcache.models.random_weights import randomize_

from .helpers import ModelPair

TINY_NEMOTRON: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 24,  # (not hidden_size / num_attention_heads)
    "intermediate_size": 96,
    "mamba_num_heads": 8,
    "mamba_head_dim": 12,  # (8 x 12 = 96: not expand x hidden_size, which transformers does not read)
    "ssm_state_size": 16,
    "conv_kernel": 4,
    "chunk_size": 32,
    "max_position_embeddings": 4096,
    "layer_norm_epsilon": 1e-5,
    "eos_token_id": 2,
    "dtype": "float32",
    "architectures": ["NemotronHForCausalLM"],
}
VARIANTS: dict[str, dict[str, Any]] = {
    # M - * M - *: two of each kind, an MLP layer between a Mamba2 and an attention layer
    "groups2": {"layers_block_type": ["mamba", "mlp", "attention", "mamba", "mlp", "attention"], "n_groups": 2,
                "tie_word_embeddings": False},
    # the pattern string of the older configs, in_proj / out_proj biases, no conv bias, one group
    "pattern-bias": {"hybrid_override_pattern": "M*-MM-", "n_groups": 1, "use_bias": True, "use_conv_bias": False,
                     "tie_word_embeddings": False},
}
MOE_VARIANTS: dict[str, dict[str, Any]] = {
    # MoE layers (E) beside an MLP layer; 8 experts in 4 groups, the best 2 groups kept, top 3, weights renormalised
    # and scaled by 2.5
    "moe-groups": {"layers_block_type": ["mamba", "moe", "attention", "mlp", "mamba", "moe"], "n_groups": 2,
                   "n_routed_experts": 8, "num_experts_per_tok": 3, "n_group": 4, "topk_group": 2,
                   "moe_intermediate_size": 32, "moe_shared_expert_intermediate_size": 48,
                   "routed_scaling_factor": 2.5, "norm_topk_prob": True, "tie_word_embeddings": False},
    # the experts inside moe_latent_size projections, one group, weights not renormalised
    "moe-latent": {"hybrid_override_pattern": "ME*ME", "n_groups": 2, "n_routed_experts": 6, "num_experts_per_tok": 2,
                   "n_group": 1, "topk_group": 1, "moe_intermediate_size": 24,
                   "moe_shared_expert_intermediate_size": 40, "moe_latent_size": 40, "routed_scaling_factor": 1.0,
                   "norm_topk_prob": False, "tie_word_embeddings": False},
}
VARIANTS.update(MOE_VARIANTS)


def nemotron_config(variant: str, **overrides: Any):
    import transformers

    return transformers.NemotronHConfig(**{**TINY_NEMOTRON, **VARIANTS[variant], **overrides})


@torch.no_grad()
def randomize_nemotron_(model: torch.nn.Module, seed: int) -> None:
    randomize_(model, seed)
    generator = torch.Generator().manual_seed(seed + 1)
    for name, param in model.named_parameters():
        if name.endswith(("norm.weight", "norm_f.weight")):
            param.copy_(1 + 0.1 * torch.randn(param.shape, generator=generator))
    for name, buffer in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buffer.copy_(0.1 * torch.randn(buffer.shape, generator=generator))


def nemotron_model(variant: str, seed: int = 0, **overrides: Any):
    import transformers

    model = transformers.NemotronHForCausalLM(nemotron_config(variant, **overrides)).eval()
    randomize_nemotron_(model, seed)
    return model


def make_nemotron_pair(variant: str, seed: int = 0, **overrides: Any) -> ModelPair:
    hf = nemotron_model(variant, seed, **overrides)
    ours = get_model_class("NemotronHForCausalLM")(ModelConfig.from_dict(hf.config.to_dict()))
    load_weights(ours, hf.state_dict())
    return ModelPair(hf.config, hf, ours)
