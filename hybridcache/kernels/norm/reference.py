"""The RMSNorms in torch (checked against transformers 5.24); the CPU ground truth of `kernels/norm/triton.py`.

- `rms_norm`: n = x / rms(x) in fp32, then the weight w as `Weighting` says: zero-centred (Qwen3.5 / Qwen3-Next:
  n * (1 + w), rounded once to x's dtype; their input_layernorm, post_attention_layernorm, final norm and attention
  q_norm / k_norm), or w as it is (the other families' `layers.norm.RMSNorm`), multiplying the rounded n or n in
  fp32 as each family's transformers module does.
- `add_rms_norm`: the residual sum s = x + residual (rounded to the dtype, as torch's add rounds it) and
  rms_norm(s): a decoder layer's residual add and the next norm, which the CUDA backend runs as one kernel.
- `gated_rms_norm`: y = (w * x / rms(x)) * silu(gate), w NOT zero-centred; the normalised x is rounded to x's
  dtype before the weight multiplies it (as the module does). Used as `linear_attn.norm` on each DeltaNet value
  head, gated by z.
"""

from __future__ import annotations

import enum

import torch
import torch.nn.functional as F


class Weighting(enum.IntEnum):
    """How an RMSNorm applies its weight w to n = x / rms(x) (n in fp32), and where it rounds to x's dtype:

    ZERO_CENTRED: n * (1 + w) in fp32, rounded once (Qwen3.5 / Qwen3-Next's `ZeroCenteredRMSNorm`);
    ROUNDED: w * round(n), the product in w's dtype (Granite-4.0-H's, Bamba's, Jamba's, LFM2's, Falcon-H1's
    transformers modules: `weight * hidden_states.to(input_dtype)`);
    FP32: w * n in fp32, rounded once (Nemotron-H's and OLMo Hybrid's: `(weight.float() * hidden_states)
    .to(input_dtype)`)."""

    ZERO_CENTRED = 0
    ROUNDED = 1
    FP32 = 2


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             weighting: Weighting = Weighting.ZERO_CENTRED) -> torch.Tensor:
    """x [..., dim], weight [dim] -> [..., dim] in x's dtype (with ROUNDED, in the dtype x's and w's product takes)."""
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weighting == Weighting.ZERO_CENTRED:
        return (out * (1.0 + weight.float())).type_as(x)
    if weighting == Weighting.FP32:
        return (weight.float() * out).to(x.dtype)
    return weight * out.to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
    weighting: Weighting = Weighting.ZERO_CENTRED, scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [..., dim] (one dtype), weight [dim] -> (s, rms_norm(s)) with s = x + residual * scale (the product
    rounded to the dtype, then the sum: transformers' Granite `residual + out * residual_multiplier`), both in x's
    dtype."""
    total = x + (residual if scale == 1.0 else residual * scale)
    return total, rms_norm(total, weight, eps, weighting)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x, gate [..., dim], weight [dim] -> [..., dim] in x's dtype: norm first, then multiply by silu(gate)."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * xf.to(dtype)
    return (out * F.silu(gate.float())).to(dtype)
