"""Per-channel FP8 linear on CUDA through `torch._scaled_mm` (row-wise scales, cuBLASLt / CUTLASS): activations
quantised per token, weights per output channel (compressed-tensors FP8_DYNAMIC)."""

from __future__ import annotations

import torch

from hybridcache.fp8_format import FP8_DTYPE
from hybridcache.kernels.gemm.reference import quantize_rows


def channel_fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                       bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] (bf16/fp16) -> x W^T (+ bias) [..., N] in x's dtype; weight [N, K] float8_e4m3fn, scale [N, 1]
    fp32. K and N must be multiples of 16 (`torch._scaled_mm`'s rule); checked before the call."""
    if weight.dtype != FP8_DTYPE or weight.dim() != 2 or tuple(scale.shape) != (weight.shape[0], 1):
        raise ValueError(f"channel_fp8_linear: weight [N, K] {FP8_DTYPE} and scale [N, 1] needed, got "
                         f"{weight.dtype} {list(weight.shape)} and {list(scale.shape)}")
    if weight.shape[0] % 16 or weight.shape[1] % 16:
        raise ValueError(f"channel_fp8_linear: N and K must be multiples of 16, got {list(weight.shape)}")
    lead = x.shape[:-1]
    xq, x_scale = quantize_rows(x.reshape(-1, x.shape[-1]))
    out = torch._scaled_mm(xq, weight.t(), scale_a=x_scale, scale_b=scale.float().reshape(1, -1),
                           bias=bias, out_dtype=x.dtype)
    return out.reshape(*lead, weight.shape[0])
