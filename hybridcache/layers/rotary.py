"""Partial rotary position embedding (rotate-half convention, as in transformers' Qwen3-Next / Qwen3.5).

Only the first `rotary_dim` channels of each head are rotated; the rest pass through unchanged. For
text-only input, Qwen3.5's interleaved M-RoPE has equal position ids on its three axes and reduces to this.
"""

from __future__ import annotations

import torch


def rotary_cos_sin(
    positions: torch.Tensor, rotary_dim: int, base: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T] int -> cos, sin [T, rotary_dim] (the rotary_dim/2 frequencies, repeated twice)."""
    # built on positions' device: no host-to-device copy in a step (CUDA graphs capture this function)
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=positions.device).to(torch.float32)
    inv_freq = 1.0 / (base ** (exponents / rotary_dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_partial_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D], cos/sin [T, R] with R <= D -> [T, H, D]: channels [0, R) rotated, [R, D) unchanged."""
    rotary_dim = cos.shape[-1]
    cos, sin = cos[:, None, :], sin[:, None, :]
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    return torch.cat((x_rot * cos + _rotate_half(x_rot) * sin, x_pass), dim=-1)
