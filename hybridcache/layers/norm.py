"""RMSNorm modules of Qwen3.5 / Qwen3-Next: they hold the weight; the math is the kernel backend's
(`rms_norm`, `gated_rms_norm`; see `hybridcache.kernels.norm.reference` for the formulas).

- `ZeroCenteredRMSNorm`: y = x / rms(x) * (1 + w), `weight` initialised to 0. Used for input_layernorm,
  post_attention_layernorm, the final norm, and the attention q_norm / k_norm.
- `GatedRMSNorm`: y = (w * x / rms(x)) * silu(gate), `weight` initialised to 1 (NOT zero-centred). Used
  as `linear_attn.norm` on each DeltaNet value head, gated by z (OLMo Hybrid's `linear_attn.o_norm`, gated by g).
- `RMSNorm`: y = w * x / rms(x), `weight` initialised to 1: the norms of Granite-4.0-H, Bamba, Falcon-H1, Nemotron-H,
  Jamba (also the dt / B / C norms inside its Mamba1 layers), LFM2 and OLMo Hybrid (their layer norms, final norm,
  and LFM2's and OLMo's attention q_norm / k_norm): the backend's `rms_norm` / `add_rms_norm` with the family's
  `Weighting` (one fused launch each on CUDA), torch's ops where no backend is given.

`fp8=True` (where `layers.linear.wants_fp8_rows` says the FP8 linear after the norm takes it): the output comes as
`layers.linear.Fp8Rows`, the norm's output with its FP8 quantisation for that linear, written by the norm's own
launch on CUDA (`kernels.backend.add_rms_norm_fp8` / `gated_rms_norm_fp8`).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

import hybridcache.kernels.backend as kernel_backend
from hybridcache.kernels.backend import KernelBackend
from hybridcache.layers.linear import PREQUANTIZED_GROUP, PREQUANTIZED_PAD_ROWS, Fp8Rows


class ZeroCenteredRMSNorm(nn.Module):
    """x [..., dim] -> [..., dim] in x's dtype."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor, backend: KernelBackend) -> torch.Tensor:
        return backend.rms_norm(x, self.weight, self.eps)

    def add(self, x: torch.Tensor, residual: torch.Tensor, backend: KernelBackend, fp8: bool = False
            ) -> tuple[torch.Tensor, torch.Tensor | Fp8Rows]:
        """(x + residual, this norm of it), both [..., dim] in x's dtype: the residual add before the norm and the
        norm in one op (`backend.add_rms_norm`). `fp8` (x [T, dim]): the norm as `Fp8Rows` (module docstring)."""
        if not fp8:
            return backend.add_rms_norm(x, residual, self.weight, self.eps)
        total, normed, xq, scale = kernel_backend.add_rms_norm_fp8(x, residual, self.weight, self.eps,
                                                                   PREQUANTIZED_GROUP, PREQUANTIZED_PAD_ROWS)
        return total, Fp8Rows(normed, xq, scale)


class GatedRMSNorm(nn.Module):
    """x, gate [..., dim] -> [..., dim] in x's dtype: norm first, then multiply by silu(gate)."""

    centred_on_one: ClassVar[bool] = True  # its weight scales as it is (random weights draw it around 1)

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor, backend: KernelBackend, fp8: bool = False
                ) -> torch.Tensor | Fp8Rows:
        """`fp8` (x [T, heads, dim]): the output flattened to [T, heads * dim] as `Fp8Rows` (module docstring)."""
        if not fp8:
            return backend.gated_rms_norm(x, gate, self.weight, self.eps)
        return Fp8Rows(*kernel_backend.gated_rms_norm_fp8(x, gate, self.weight, self.eps, PREQUANTIZED_GROUP,
                                                          PREQUANTIZED_PAD_ROWS))


class RMSNorm(nn.Module):
    """x [..., dim] -> weight * x / rms(x) [..., dim] in x's dtype, normalised in fp32 (`weight` starts at 1). Where it
    rounds is transformers' of each model: Granite's, Jamba's and LFM2's round x / rms(x) to x's dtype, then multiply by
    the weight; Nemotron-H's and OLMo Hybrid's (`weight_in_fp32`) multiply in fp32, then round."""

    centred_on_one: ClassVar[bool] = True  # its weight scales as it is (random weights draw it around 1)

    def __init__(self, dim: int, eps: float, weight_in_fp32: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.weighting = kernel_backend.Weighting.FP32 if weight_in_fp32 else kernel_backend.Weighting.ROUNDED
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, backend: KernelBackend | None = None) -> torch.Tensor:
        """`backend`: the step's (None: torch's ops)."""
        if backend is None:
            return kernel_backend.ReferenceBackend.rms_norm(x, self.weight, self.eps, self.weighting)
        return backend.rms_norm(x, self.weight, self.eps, self.weighting)

    def add(self, x: torch.Tensor, residual: torch.Tensor, backend: KernelBackend | None = None,
            fp8: bool = False, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + residual * scale, this norm of it): one launch on CUDA (`backend.add_rms_norm`; `scale`: Granite's
        residual multiplier, the product rounded before the add as transformers' is)."""
        del fp8  # (not asked here: an FP8 linear after this norm quantises its own input)
        if backend is None:
            backend = kernel_backend.ReferenceBackend
        return backend.add_rms_norm(x, residual, self.weight, self.eps, self.weighting, scale)
