"""The "reference" GEMM backend (any device): the weight dequantised to the activations' dtype, then `F.linear`."""

from __future__ import annotations

import torch

from hybridcache.fp8_format import Fp8Format
from hybridcache.kernels.gemm import reference
from hybridcache.kernels.registry import GEMM


@GEMM.register("reference")
class ReferenceGemm:
    def linear(self, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, fmt: Fp8Format,
               bias: torch.Tensor | None) -> torch.Tensor:
        return reference.linear(x, weight, scale, fmt, bias)
