"""The RMSNorms of Qwen3.5 / Qwen3-Next in torch (checked against transformers 5.24); the CPU ground truth of
`kernels/norm/triton.py`.

- `rms_norm` (zero-centred): y = x / rms(x) * (1 + w), computed in fp32, rounded once to x's dtype. Used for
  input_layernorm, post_attention_layernorm, the final norm, and the attention q_norm / k_norm.
- `add_rms_norm`: the residual sum s = x + residual (rounded to the dtype, as torch's add rounds it) and
  rms_norm(s): a decoder layer's residual add and the next norm, which the CUDA backend runs as one kernel.
- `gated_rms_norm`: y = (w * x / rms(x)) * silu(gate), w NOT zero-centred; the normalised x is rounded to x's
  dtype before the weight multiplies it (as the module does). Used as `linear_attn.norm` on each DeltaNet value
  head, gated by z.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., dim], weight [dim] -> [..., dim] in x's dtype."""
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (out * (1.0 + weight.float())).type_as(x)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [..., dim] (one dtype), weight [dim] -> (x + residual, rms_norm(x + residual)), both in x's dtype."""
    total = x + residual
    return total, rms_norm(total, weight, eps)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x, gate [..., dim], weight [dim] -> [..., dim] in x's dtype: norm first, then multiply by silu(gate)."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * xf.to(dtype)
    return (out * F.silu(gate.float())).to(dtype)
