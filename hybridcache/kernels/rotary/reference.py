"""Partial rotary position embedding in torch (rotate-half convention, as transformers' Qwen3-Next / Qwen3.5 apply
it, with the same bf16 roundings); the CPU ground truth of `kernels/rotary/triton.py`.

Only the first R = cos.shape[-1] channels of each head are rotated; the rest pass through unchanged. With
x1 = x[..., :R/2] and x2 = x[..., R/2:R] and cos/sin holding the R/2 frequencies twice:
    out[..., :R/2] = x1 * cos - x2 * sin,   out[..., R/2:R] = x2 * cos + x1 * sin,   out[..., R:] = x[..., R:]
"""

from __future__ import annotations

import torch


def apply_partial_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D], cos/sin [T, R] with R <= D -> [T, H, D]: channels [0, R) rotated, [R, D) unchanged."""
    rotary_dim = cos.shape[-1]
    cos, sin = cos[:, None, :], sin[:, None, :]
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    rotated_half = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
    return torch.cat((x_rot * cos + rotated_half * sin, x_pass), dim=-1)


def rotary(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor,
           sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """query [T, Hq, D], key [T, Hk, D], cos/sin [T, R] -> the rotated query and key (new tensors)."""
    return apply_partial_rotary(query, cos, sin), apply_partial_rotary(key, cos, sin)


def norm_rotary(query: torch.Tensor, key: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention layer's q_norm / k_norm (zero-centred RMSNorm over each head, `norm.reference.rms_norm`) and
    then `rotary`: query [T, Hq, D], key [T, Hk, D], weights [D], cos/sin [T, R] -> the normed, rotated query and
    key (the norms' outputs rounded to the inputs' dtype before the rotation, as the two ops in a row give)."""
    from hybridcache.kernels.norm.reference import rms_norm

    return rotary(rms_norm(query, q_weight, eps), rms_norm(key, k_weight, eps), cos, sin)
