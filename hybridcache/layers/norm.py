"""RMSNorm modules of Qwen3.5 / Qwen3-Next: they hold the weight; the math is the kernel backend's
(`rms_norm`, `gated_rms_norm`; see `hybridcache.kernels.norm.reference` for the formulas).

- `ZeroCenteredRMSNorm`: y = x / rms(x) * (1 + w), `weight` initialised to 0. Used for input_layernorm,
  post_attention_layernorm, the final norm, and the attention q_norm / k_norm.
- `GatedRMSNorm`: y = (w * x / rms(x)) * silu(gate), `weight` initialised to 1 (NOT zero-centred). Used
  as `linear_attn.norm` on each DeltaNet value head, gated by z.

`fp8=True` (where `layers.linear.wants_fp8_rows` says the FP8 linear after the norm takes it): the output comes as
`layers.linear.Fp8Rows`, the norm's output with its FP8 quantisation for that linear, written by the norm's own
launch on CUDA (`kernels/norm/triton.py`, `*_fp8`); elsewhere, or where the kernel does not take the layout, the
backend's norm followed by `triton_quant.quantize_groups` (CUDA) or its torch reference (the same values).
"""

from __future__ import annotations

import torch
from torch import nn

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
        if x.is_cuda and x.dim() == 2:
            from hybridcache.kernels.norm import triton as norm_triton

            total, normed, xq, scale = norm_triton.add_rms_norm_fp8(
                x, residual, self.weight, self.eps, PREQUANTIZED_GROUP, PREQUANTIZED_PAD_ROWS)
            return total, Fp8Rows(normed, xq, scale)
        total, normed = backend.add_rms_norm(x, residual, self.weight, self.eps)
        return total, quantized_rows(normed)


class GatedRMSNorm(nn.Module):
    """x, gate [..., dim] -> [..., dim] in x's dtype: norm first, then multiply by silu(gate)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor, backend: KernelBackend, fp8: bool = False
                ) -> torch.Tensor | Fp8Rows:
        """`fp8` (x [T, heads, dim]): the output flattened to [T, heads * dim] as `Fp8Rows` (module docstring)."""
        if not fp8:
            return backend.gated_rms_norm(x, gate, self.weight, self.eps)
        tokens = x.shape[0]
        if x.is_cuda and x.dim() == 3 and x.shape[-1] % PREQUANTIZED_GROUP == 0:
            from hybridcache.kernels.norm import triton as norm_triton

            out, xq, scale = norm_triton.gated_rms_norm_fp8(x, gate, self.weight, self.eps, PREQUANTIZED_GROUP,
                                                            PREQUANTIZED_PAD_ROWS)
            return Fp8Rows(out.view(tokens, -1), xq, scale)
        return quantized_rows(backend.gated_rms_norm(x, gate, self.weight, self.eps).reshape(tokens, -1))


def quantized_rows(x: torch.Tensor) -> Fp8Rows:
    """x [T, K] with its quantisation as `Fp8Rows` in separate launches: `triton_quant.quantize_groups` on CUDA,
    else `gemm.reference.quantize_groups` padded and laid out the same way."""
    if x.is_cuda:
        from hybridcache.kernels.gemm import triton_quant

        return Fp8Rows(x, *triton_quant.quantize_groups(x, PREQUANTIZED_GROUP, pad_rows=PREQUANTIZED_PAD_ROWS,
                                                         column_major=True))
    from hybridcache.kernels.gemm import reference

    tokens = x.shape[0]
    padded = -(-tokens // PREQUANTIZED_PAD_ROWS) * PREQUANTIZED_PAD_ROWS
    xq, scale = reference.quantize_groups(torch.cat([x, x.new_zeros(padded - tokens, x.shape[1])]),
                                          PREQUANTIZED_GROUP)
    return Fp8Rows(x, xq, scale.t().contiguous().t())
