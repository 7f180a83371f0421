"""The GEMM op family's protocol: the matrix product of an FP8 linear layer (see `hybridcache.kernels.registry`)."""

from __future__ import annotations

from typing import Protocol

import torch

from hybridcache.fp8_format import Fp8Format


class GemmBackend(Protocol):
    def linear(self, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, fmt: Fp8Format,
               bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., K] -> x W^T (+ bias) [..., N] in x's dtype; weight [N, K] float8_e4m3fn with `scale` in `fmt`'s
        shape (`fp8_format`)."""
        ...
