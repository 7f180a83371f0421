"""The "triton" GEMM backend (CUDA), by the weight's format and the number of rows M:

- bf16 / fp16, block (128 x 128): `triton_block_fp8.fp8_linear`: cuBLAS's block-scaled GEMM where it applies,
  else the Triton kernel (W8A8; swap-AB tiles up to 64 rows).
- bf16 / fp16, channel: up to 64 rows `fp8_linear` (the Triton kernel, W8A8); more: `scaled_mm.
  channel_fp8_linear` (`torch._scaled_mm`, row-wise scales; K, N % 16 == 0).
- fp32 (the exact path): `reference.linear` (dequantise, then F.linear).

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
