"""FP8 linears on CUDA through `torch._scaled_mm` (cuBLASLt), for prefill-sized inputs:

- per-channel (compressed-tensors FP8_DYNAMIC): activations quantised per token in one launch
  (`triton_quant.quantize_rows`), row-wise scales;
- block (Qwen's fine-grained FP8): activations quantised per token per 128 channels by `triton_quant` (one
  launch, scales column-major, rows padded to a multiple of 4 as cuBLAS wants), 1 x 128 activation scales times
  128 x 128 weight scales (`F.scaled_mm`'s BlockWise1x128 / BlockWise128x128, sm90).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridcache.fp8_format import FP8_DTYPE, Fp8Format
from hybridcache.kernels.gemm import triton_quant


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
    rows = x.reshape(-1, x.shape[-1])
    xq, x_scale = triton_quant.quantize_rows(rows if rows.stride(-1) == 1 else rows.contiguous())
    out = torch._scaled_mm(xq, weight.t(), scale_a=x_scale, scale_b=scale.float().reshape(1, -1),
                           bias=bias, out_dtype=x.dtype)
    return out.reshape(*lead, weight.shape[0])


def block_scaled_mm_fits(weight: torch.Tensor, scale: torch.Tensor, fmt: Fp8Format) -> bool:
    """Whether `block_fp8_linear` takes this weight: 128 x 128 blocks, fp32 scales, N a multiple of 128 and K of
    512 (cuBLAS wants the K blocks a multiple of 4), and a torch with `F.scaled_mm`."""
    return (fmt.kind == "block" and fmt.block == (128, 128) and scale.dtype == torch.float32
            and weight.shape[0] % 128 == 0 and weight.shape[1] % 512 == 0 and hasattr(F, "scaled_mm"))


def block_fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                     quantized: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """x [M, K] (bf16/fp16, unit stride on K) -> x W^T [M, N] in x's dtype; weight [N, K] float8_e4m3fn with
    scale_inv [N/128, K/128] fp32 (`block_scaled_mm_fits` must hold). `quantized`: x already quantised as this
    function would (`quantize_groups(x, 128, pad_rows=4, column_major=True)`, e.g. by the norm before it)."""
    rows = x.shape[0]
    xq, x_scale = quantized or triton_quant.quantize_groups(x, 128, pad_rows=4, column_major=True)
    out = F.scaled_mm(xq, weight.t(), x_scale, F.ScalingType.BlockWise1x128, scale.t(),
                      F.ScalingType.BlockWise128x128, output_dtype=x.dtype)
    return out[:rows]
