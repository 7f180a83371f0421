"""Torch reference of the short depthwise causal convolution (transformers' `causal_conv1d_fn/update`).

Notation: T new tokens, C channels, K kernel size; the conv state holds the last K-1 inputs per channel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor | None,
    *,
    activation: str | None = "silu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal convolution over one sequence, continuing from a conv state.

    x          [T, C]       pre-convolution inputs of the new tokens
    weight     [C, K]       depthwise kernel (transformers' conv1d.weight [C, 1, K] squeezed)
    bias       [C] or None
    conv_state [C, K-1]     the last K-1 pre-convolution inputs before x, oldest first (None = zeros)
    returns    out [T, C] (SiLU applied when activation == "silu"), new_state [C, K-1]

    Worked example, K = 4, state [s1 s2 s3], new inputs [x1 x2]:
        window for x1 = [s1 s2 s3 x1], for x2 = [s2 s3 x1 x2];  new_state = [s3 x1 x2]
    """
    channels, kernel_size = weight.shape
    width = kernel_size - 1
    if conv_state is None:
        conv_state = torch.zeros(channels, width, dtype=x.dtype, device=x.device)
    full = torch.cat([conv_state.to(weight.dtype), x.transpose(0, 1).to(weight.dtype)], dim=-1)  # [C, K-1+T]
    out = _depthwise_windows(full, weight, bias, activation)  # [C, T]
    return out.transpose(0, 1).to(x.dtype), full[:, full.shape[-1] - width :].to(conv_state.dtype)


def causal_conv1d_step(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    *,
    activation: str | None = "silu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """One new token for each of N sequences at once (the decode case of `causal_conv1d`).

    x [N, C]; weight [C, K]; bias [C] or None; conv_state [N, C, K-1]
    returns out [N, C], new_state [N, C, K-1]  (window = state + x, new_state = window[..., 1:])
    """
    window = torch.cat([conv_state.to(weight.dtype), x.to(weight.dtype).unsqueeze(-1)], dim=-1)  # [N, C, K]
    out = _depthwise_windows(window, weight, bias, activation)[..., 0]
    return out.to(x.dtype), window[..., 1:].to(conv_state.dtype)


def _depthwise_windows(
    full: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None
) -> torch.Tensor:
    """full [..., C, K-1+T] -> [..., C, T]: every window of K inputs times the channel's kernel, summed."""
    out = (full.unfold(-1, weight.shape[-1], 1) * weight.unsqueeze(-2)).sum(-1)
    if bias is not None:
        out = out + bias.unsqueeze(-1)
    if activation == "silu":
        return F.silu(out)
    if activation is not None:
        raise ValueError(f"unsupported activation {activation!r}")
    return out


def conv_states_after(x: torch.Tensor, conv_state: torch.Tensor) -> torch.Tensor:
    """The conv state after each of T new inputs of one sequence: x [T, C], conv_state [C, K-1] (the last K-1
    inputs before x) -> [T, C, K-1] in conv_state's dtype; entry t holds the K-1 inputs ending at input t."""
    width = conv_state.shape[-1]
    full = torch.cat([conv_state, x.transpose(0, 1).to(conv_state.dtype)], dim=-1)  # [C, K-1+T]
    return torch.stack([full[:, t + 1: t + 1 + width] for t in range(x.shape[0])])
