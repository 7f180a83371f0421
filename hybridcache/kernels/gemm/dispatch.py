"""The one place that picks the GEMM kernel of an FP8 linear: by the weight's format and the device.

| device, activations | block (128 x 128)                            | channel                                   |
| ------------------- | -------------------------------------------- | ----------------------------------------- |
| CUDA, bf16 / fp16   | `triton_block_fp8.block_fp8_linear`          | `scaled_mm.channel_fp8_linear`            |
| anything else       | `reference.linear` (dequantise, then F.linear in the activations' dtype)   |

The CUDA modules are imported on first use, so CPU runs never import Triton.
"""

from __future__ import annotations

import torch

from hybridcache.fp8_format import Fp8Format
from hybridcache.kernels.gemm import reference

_FAST_DTYPES = (torch.bfloat16, torch.float16)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, fmt: Fp8Format,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] -> x W^T (+ bias) [..., N] in x's dtype, W the FP8 weight [N, K] with `scale` in `fmt`'s shape."""
    if x.device.type == "cuda" and x.dtype in _FAST_DTYPES:
        if fmt.kind == "block":
            from hybridcache.kernels.gemm.triton_block_fp8 import block_fp8_linear

            return block_fp8_linear(x, weight, scale, fmt.block, bias)
        if weight.shape[0] % 16 == 0 and weight.shape[1] % 16 == 0:
            from hybridcache.kernels.gemm.scaled_mm import channel_fp8_linear

            return channel_fp8_linear(x, weight, scale, bias)
    return reference.linear(x, weight, scale, fmt, bias)
