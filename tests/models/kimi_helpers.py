"""Tiny random Kimi Linear models (`KimiLinearForCausalLM`) for the model and engine tests: transformers' config and
model, weights at std 1/sqrt(fan_in) (`randomize_`), every RMSNorm weight 1 + N(0, 0.1) (Kimi's norms are not
zero-centred), each router's `e_score_correction_bias` N(0, 0.1) (so that it changes the picks), and the state dict
handed to our loader under the released checkpoints' names (`checkpoint_state_dict`: transformers' conversion
mapping undone)."""

from __future__ import annotations

import re
from typing import Any

import torch

from hybridcache.models import ModelConfig, get_model_class, load_weights
from hybridcache.models.random_weights import randomize_

from .helpers import ModelPair

TINY_KIMI: dict[str, Any] = {
    "vocab_size": 256, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
    "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 24, "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8, "v_head_dim": 20, "rms_norm_eps": 1e-5, "eos_token_id": 2, "pad_token_id": 0,
    "bos_token_id": 1, "dtype": "float32",
    "architectures": ["KimiLinearForCausalLM"], "mla_use_nope": True, "tie_word_embeddings": False,
}
VARIANTS: dict[str, dict[str, Any]] = {
    # K K M K K M (1-based lists), the first layer dense, 8 experts in 4 groups, best 2 kept, top 3, scaled
    "moe-groups": {"num_hidden_layers": 6, "num_experts": 8, "num_experts_per_token": 3, "num_expert_group": 4,
                   "topk_group": 2, "routed_scaling_factor": 2.5, "first_k_dense_replace": 1,
                   "linear_attn_config": {"kda_layers": [1, 2, 4, 5], "full_attn_layers": [3, 6], "num_heads": 2,
                                          "head_dim": 16, "short_conv_kernel_size": 4}},
    # q_lora, an odd latent row (21 + 8), two dense layers, one group, weights not renormalised, two shared
    # experts, an MLA layer first
    "qlora-dense2": {"num_hidden_layers": 4, "q_lora_rank": 20, "kv_lora_rank": 21, "num_experts": 6,
                     "num_experts_per_token": 2,
                     "num_shared_experts": 2, "moe_renormalize": False, "routed_scaling_factor": 1.0,
                     "first_k_dense_replace": 2,
                     "linear_attn_config": {"kda_layers": [2, 3], "full_attn_layers": [1, 4], "num_heads": 3,
                                            "head_dim": 8, "short_conv_kernel_size": 3}},
}

_TO_CHECKPOINT = (  # transformers' in-memory name -> the released checkpoints' (its conversion mapping, undone)
    (re.compile(r"\.self_attn\.forget_gate\."), ".self_attn."),
    (re.compile(r"\.mlp\.(gate|experts|shared_experts)\b"), r".block_sparse_moe.\1"),
)


def kimi_config(variant: str, **overrides: Any):
    import transformers

    return transformers.KimiLinearConfig(**{**TINY_KIMI, **VARIANTS[variant], **overrides})


@torch.no_grad()
def kimi_model(variant: str, seed: int = 0, **overrides: Any):
    import transformers

    model = transformers.KimiLinearForCausalLM(kimi_config(variant, **overrides)).eval()
    randomize_(model, seed)
    generator = torch.Generator().manual_seed(seed + 1)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.copy_(1 + 0.1 * torch.randn(param.shape, generator=generator))
        if name.endswith("A_log"):  # decays exp(-exp(A_log) softplus(.)): some slow channels, some fast
            param.copy_(torch.rand(param.shape, generator=generator).mul(2).add(-1.5))
    for name, buffer in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buffer.copy_(0.1 * torch.randn(buffer.shape, generator=generator))
    return model


def checkpoint_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """transformers' state dict under the released checkpoints' names: the KDA gate directly under self_attn, the
    conv split into q_conv1d / k_conv1d / v_conv1d [C, 1, W], the MoE block as block_sparse_moe with experts.{e}.w1
    (gate), w3 (up), w2 (down)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        for pattern, replacement in _TO_CHECKPOINT:
            name = pattern.sub(replacement, name)
        if name.endswith(".self_attn.conv1d.weight"):
            for part, rows in zip("qkv", tensor.chunk(3), strict=True):
                out[name.replace(".conv1d.", f".{part}_conv1d.")] = rows.clone()
        elif name.endswith(".experts.gate_up_proj"):
            for e, stacked in enumerate(tensor):
                gate, up = stacked.chunk(2)
                out[name.replace("gate_up_proj", f"{e}.w1.weight")] = gate.clone()
                out[name.replace("gate_up_proj", f"{e}.w3.weight")] = up.clone()
        elif name.endswith(".experts.down_proj"):
            for e, stacked in enumerate(tensor):
                out[name.replace("down_proj", f"{e}.w2.weight")] = stacked.clone()
        else:
            out[name] = tensor
    return out


def make_kimi_pair(variant: str, seed: int = 0, **overrides: Any) -> ModelPair:
    hf = kimi_model(variant, seed, **overrides)
    raw = {**TINY_KIMI, **VARIANTS[variant], **overrides, "model_type": "kimi_linear"}
    ours = get_model_class("KimiLinearForCausalLM")(ModelConfig.from_dict(raw))
    load_weights(ours, checkpoint_state_dict(hf))
    return ModelPair(hf.config, hf, ours)


def released_kimi_config() -> ModelConfig:
    """Kimi-Linear-48B-A3B-Instruct's config.json (the fields our config reads)."""
    raw = {"architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", "vocab_size": 163840,
           "hidden_size": 2304, "num_hidden_layers": 27, "num_attention_heads": 32, "num_key_value_heads": 32,
           "num_experts": 256, "num_experts_per_token": 8, "num_shared_experts": 1, "moe_renormalize": True,
           "num_expert_group": 1, "topk_group": 1, "routed_scaling_factor": 2.446, "model_max_length": 1048576,
           "first_k_dense_replace": 1, "moe_layer_freq": 1, "mla_use_nope": True, "num_nextn_predict_layers": 0,
           "kv_lora_rank": 512, "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
           "v_head_dim": 128, "linear_attn_config": {
               "head_dim": 128, "num_heads": 32, "short_conv_kernel_size": 4,
               "kda_layers": [i for i in range(1, 27) if i % 4], "full_attn_layers": [4, 8, 12, 16, 20, 24, 27]}}
    return ModelConfig.from_dict(raw)
