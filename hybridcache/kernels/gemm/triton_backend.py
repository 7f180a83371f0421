"""The "triton" GEMM backend (CUDA), by the weight's format and the number of rows M:

| activations, rows M  | block (128 x 128)                          | channel                                        |
| -------------------- | ------------------------------------------ | ---------------------------------------------- |
| bf16 / fp16, M <= 64 | `triton_block_fp8.fp8_linear`: the decode kernel (W8A16, swap-AB tiles)                     |
| bf16 / fp16, M > 64  | `fp8_linear`: cuBLAS block scales or W8A8 | `scaled_mm.channel_fp8_linear` (K, N % 16 == 0) |
| fp32 (exact)         | `reference.linear` (dequantise, then F.linear)                                              |

Why (measured on the H200, `benchmarks/fp8_sweep.py`): docs/kernels.md "Quantization". The CUDA modules are
imported on first use, so registering this backend never imports Triton.
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
        if x.dtype not in _FAST_DTYPES:
            return reference.linear(x, weight, scale, fmt, bias)
        from hybridcache.kernels.gemm.triton_block_fp8 import DECODE_ROWS, fp8_linear

        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        fits = weight.shape[0] % 16 == 0 and weight.shape[1] % 16 == 0
        if fmt.kind == "channel" and rows > DECODE_ROWS and fits:
            from hybridcache.kernels.gemm.scaled_mm import channel_fp8_linear

            return channel_fp8_linear(x, weight, scale, bias)
        return fp8_linear(x, weight, scale, fmt, bias)
