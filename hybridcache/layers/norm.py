"""RMSNorm variants of Qwen3.5 / Qwen3-Next (checked against transformers 5.24).

- `ZeroCenteredRMSNorm`: y = x / rms(x) * (1 + w), computed in fp32, `weight` initialised to 0. Used for
  input_layernorm, post_attention_layernorm, the final norm, and the attention q_norm / k_norm.
- `GatedRMSNorm`: y = (w * x / rms(x)) * silu(gate), `weight` initialised to 1 (NOT zero-centred). Used
  as `linear_attn.norm` on each DeltaNet value head, gated by z.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class ZeroCenteredRMSNorm(nn.Module):
    """x [..., dim] -> [..., dim] in x's dtype."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).type_as(x)


class GatedRMSNorm(nn.Module):
    """x, gate [..., dim] -> [..., dim] in x's dtype: norm first, then multiply by silu(gate)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * xf.to(dtype)
        return (out * F.silu(gate.float())).to(dtype)
