"""Torch reference of the feed-forward blocks' element-wise tails (the layers' own eager expressions).

- `silu_mul(gate, up)`: silu(gate) * up, the SiLU-gated MLP's hidden activation (two kernels in torch).
- `sigmoid_gate_add(routed, gate, shared)`: routed + sigmoid(gate) * shared, a sparse MoE block's output from
  its routed experts and its gated shared expert (three kernels in torch).
- `sigmoid_mul(x, gate)`: x * sigmoid(gate), the gated attention's output gate (with the copy of the strided gate,
  three kernels in torch).
- `relu_square(x)`: relu(x)^2, the ungated relu^2 MLP's hidden activation (Nemotron-H; two kernels in torch).

Each torch op rounds its result to the inputs' dtype, so in bf16 silu(gate) and sigmoid(gate) * shared are
rounded before the next op; the fused kernels round at the same points.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up [N, I] (same dtype, or up in float32) -> silu(gate) * up [N, I] in gate's dtype (silu rounded to it
    first, as torch rounds it)."""
    return (F.silu(gate) * up).to(gate.dtype)


def sigmoid_gate_add(routed: torch.Tensor, gate: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
    """routed, shared [N, H], gate [N, 1] (same dtype) -> routed + sigmoid(gate) * shared [N, H]."""
    return routed + torch.sigmoid(gate) * shared


def sigmoid_mul(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x, gate [T, H, D] (same dtype) -> x * sigmoid(gate), contiguous [T, H, D]."""
    return (x * torch.sigmoid(gate)).contiguous()


def relu_square(x: torch.Tensor) -> torch.Tensor:
    """x [N, I] -> relu(x)^2 [N, I] (relu is exact; the square rounds once)."""
    return torch.square(F.relu(x))
