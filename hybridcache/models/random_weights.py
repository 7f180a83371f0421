"""Random weights for tests and the built-in demo model.

`randomize_` draws every matrix at std 1/sqrt(fan_in) rather than the usual 0.02: with tiny weights the
recurrent paths barely move the logits and a broken recurrent state goes unnoticed. It works on our
models and on the transformers ones (fan_in is the last dim for Linear [out, in], depthwise conv
[C, 1, K] and stacked experts [E, out, in]).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

import hybridcache.kernels.backend as kernel_backend
from hybridcache.layers.linear import Fp8Linear

# Rules by parameter name (both our and transformers' names), applied in this order:
#   *.A_log                    log(uniform(0.05, 1.0))   decay rates: slow and fast heads
#   *.dt_bias                  uniform(-1, 1)
#   *linear_attn.norm.weight   1 + N(0, 0.1)             gated RMSNorm, centred on 1
#   the weight of a module whose class says `centred_on_one` (the Mamba hybrids' norms, Jamba's dt / B / C norms)
#                              1 + N(0, 0.1)
#   other 1-D *norm*.weight    N(0, 0.1)                 zero-centred RMSNorm (scale 1 + w)
#   *embed_tokens.weight       N(0, 1)
#   other 1-D parameters       N(0, 0.1)                 biases
#   any tensor with ndim >= 2  N(0, 1/fan_in), fan_in = shape[-1]


def centred_on_one(module: nn.Module) -> frozenset[str]:
    """The names of `module`'s parameters that scale by their value, not by 1 + it: the `weight` of each submodule
    whose class sets `centred_on_one` (a norm initialised to 1)."""
    return frozenset(f"{name}.weight" if name else "weight" for name, m in module.named_modules()
                     if getattr(m, "centred_on_one", False))


def draw_parameter(name: str, shape: torch.Size, generator: torch.Generator, on_one: bool = False) -> torch.Tensor:
    """The fp32 value `randomize_` gives parameter `name` of `shape`, drawn from `generator` on its device;
    `on_one`: the parameter is in `centred_on_one` of its model."""
    device = generator.device

    def normal(std: float) -> torch.Tensor:
        return torch.randn(shape, generator=generator, device=device) * std

    def uniform(low: float, high: float) -> torch.Tensor:
        return torch.rand(shape, generator=generator, device=device) * (high - low) + low

    if name.endswith("A_log"):
        return uniform(0.05, 1.0).log()
    if name.endswith("dt_bias"):
        return uniform(-1.0, 1.0)
    if on_one or name.endswith("linear_attn.norm.weight"):
        return 1.0 + normal(0.1)
    if "embed_tokens" in name:
        return normal(1.0)
    if len(shape) <= 1:
        return normal(0.1)
    return normal(1.0 / math.sqrt(max(shape[-1], 1)))  # (an empty matrix: a zero-width shared expert)


@torch.no_grad()
def randomize_(module: nn.Module, seed: int, draw_device: torch.device | str = "cpu") -> None:
    """Overwrite every parameter of `module` in place, deterministically from `seed` (see the rules above).

    Draws happen on `draw_device` (default the CPU) in `named_parameters()` order (tied parameters once), so the
    same module class gets the same values wherever it lives; drawing on a GPU (benchmarks' multi-GB models) is
    much faster but gives other values than the CPU for the same seed.

    FP8 linears (`layers/linear.py`) get the quantised values of the dense weight drawn in its place, so a model
    with FP8 linears draws the same values as its dense twin (their scales take no draw).
    """
    generator = torch.Generator(draw_device).manual_seed(seed)
    fp8 = {f"{name}.weight": m for name, m in module.named_modules() if isinstance(m, Fp8Linear)}
    scales = {f"{name}.{m.fmt.scale_name}" for name, m in module.named_modules() if isinstance(m, Fp8Linear)}
    on_one = centred_on_one(module)
    for name, param in module.named_parameters():
        if name in scales:
            continue
        value = draw_parameter(name, param.shape, generator, name in on_one)
        if name in fp8:
            weight, scale = kernel_backend.fp8_quantize(value, fp8[name].fmt)
            param.copy_(weight)
            fp8[name].scale.copy_(scale)
        else:
            param.copy_(value.to(param.dtype))


_TINY_COMMON: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "num_hidden_layers": 5,
    "layer_types": [
        "linear_attention",
        "linear_attention",
        "linear_attention",
        "full_attention",
        "linear_attention",
    ],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "linear_conv_kernel_dim": 4,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "max_position_embeddings": 4096,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    "tie_word_embeddings": False,
    "eos_token_id": 2,
    "dtype": "float32",
}

_TINY_MOE: dict[str, Any] = {
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 48,
}


def tiny_hf_config(model_type: str, **overrides: Any) -> Any:
    """A transformers config for a tiny model (hidden 64, vocab 256, 5 layers: 4 DeltaNet + 1 attention).

    model_type: `qwen3_5_text`, `qwen3_5_moe_text` or `qwen3_next` (Qwen3-Next: MoE everywhere except a
    dense MLP in layer 1, via `mlp_only_layers`). `overrides` replace any config field. `architectures`
    is set to the matching transformers causal-LM class, so `save_pretrained` writes a loadable folder.
    """
    import transformers

    next_fields = {"intermediate_size": 128, "mlp_only_layers": [1], "decoder_sparse_step": 1}
    choices = {
        "qwen3_5_text": (transformers.Qwen3_5TextConfig, "Qwen3_5ForCausalLM", {"intermediate_size": 128}),
        "qwen3_5_moe_text": (transformers.Qwen3_5MoeTextConfig, "Qwen3_5MoeForCausalLM", _TINY_MOE),
        "qwen3_next": (transformers.Qwen3NextConfig, "Qwen3NextForCausalLM", {**_TINY_MOE, **next_fields}),
    }
    if model_type not in choices:
        raise ValueError(f"no tiny config for model_type {model_type!r}; known: {sorted(choices)}")
    cls, arch, fields = choices[model_type]
    return cls(**{**_TINY_COMMON, "architectures": [arch], **fields, **overrides})
