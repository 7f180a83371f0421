"""The "triton" GEMM backend (CUDA), by the weight's format:

| activations   | block (128 x 128)                            | channel                                       |
| ------------- | -------------------------------------------- | --------------------------------------------- |
| bf16 / fp16   | `triton_block_fp8.block_fp8_linear`          | `scaled_mm.channel_fp8_linear` (K, N % 16 == 0) |
| fp32 (exact)  | `reference.linear` (dequantise, then F.linear)                                               |

The CUDA modules are imported on first use, so registering this backend never imports Triton.
"""

from __future__ import annotations

import torch

from hybridcache.fp8_format import Fp8Format
from hybridcache.kernels.gemm import reference
from hybridcache.kernels.registry import GEMM

_FAST_DTYPES = (torch.bfloat16, torch.float16)


@GEMM.register("triton")
class TritonGemm:
    devices = ("cuda",)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, fmt: Fp8Format,
               bias: torch.Tensor | None) -> torch.Tensor:
        if x.dtype in _FAST_DTYPES:
            if fmt.kind == "block":
                from hybridcache.kernels.gemm.triton_block_fp8 import block_fp8_linear

                return block_fp8_linear(x, weight, scale, fmt.block, bias)
            if weight.shape[0] % 16 == 0 and weight.shape[1] % 16 == 0:
                from hybridcache.kernels.gemm.scaled_mm import channel_fp8_linear

                return channel_fp8_linear(x, weight, scale, bias)
        return reference.linear(x, weight, scale, fmt, bias)
