"""A linear layer with an FP8 weight: the quantized counterpart of `nn.Linear` (same `in_features`,
`out_features`, `weight` [out, in], optional `bias`), plus its scale under the checkpoint's name.

    Fp8Linear(in_features, out_features, fmt)      fmt: `fp8_format.Fp8Format`
        weight            [out, in] float8_e4m3fn
        weight_scale_inv  [ceil(out/bn), ceil(in/bk)] fp32     (fmt.kind == "block")
        weight_scale      [out, 1] fp32                          (fmt.kind == "channel")
        bias              [out] in the model dtype, or None

The weight keeps its format: `forward` calls the FP8 GEMM backend its `gemm` names (`kernels.backend.fp8_linear`;
registered in `kernels.registry.GEMM`; the default: the Triton block-scaled GEMM or `torch._scaled_mm` on CUDA,
dequantise-then-matmul elsewhere). Casting the module
(`model.to(dtype)`, `.half()`) moves the weight and its scale between devices but never changes their dtypes;
only the bias follows the model dtype.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

import hybridcache.kernels.backend as kernel_backend
from hybridcache.fp8_format import FP8_DTYPE, Fp8Format
from hybridcache.kernels.backend import KernelBackend


class Fp8Linear(nn.Module):
    """x [..., in_features] -> x W^T (+ bias) [..., out_features] in x's dtype (module docstring)."""

    def __init__(self, in_features: int, out_features: int, fmt: Fp8Format, *, bias: bool = False,
                 bias_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.fmt = fmt
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8_DTYPE), requires_grad=False)
        scale = torch.ones(fmt.scale_shape(out_features, in_features), dtype=torch.float32)
        self.register_parameter(fmt.scale_name, nn.Parameter(scale, requires_grad=False))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=bias_dtype), requires_grad=False) if bias else None
        self.gemm: str | None = None  # the GEMM backend's registered name (kernels.registry.GEMM); None: the default

    @property
    def scale(self) -> torch.Tensor:
        """The weight's scale tensor (`weight_scale_inv` or `weight_scale`)."""
        return getattr(self, self.fmt.scale_name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernel_backend.fp8_linear(x, self.weight, self.scale, self.fmt, self.bias, gemm=self.gemm)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T without the bias (a row-parallel layer adds its bias once, after the ranks' partial sums)."""
        return kernel_backend.fp8_linear(x, self.weight, self.scale, self.fmt, None, gemm=self.gemm)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight as a dense [out, in] matrix in `dtype` (reference paths)."""
        return kernel_backend.fp8_dequantize(self.weight, self.scale, self.fmt, dtype)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Fp8Linear:
        """Device moves and `to_empty` apply to every tensor; dtype casts only to the bias (module docstring)."""
        del recurse
        for name in ("weight", self.fmt.scale_name, "bias"):
            param = getattr(self, name)
            if param is None:
                continue
            moved = fn(param.data)
            if name != "bias" and moved.dtype != param.dtype:
                moved = moved.to(param.dtype) if moved.is_meta else param.data.to(device=moved.device)
            setattr(self, name, nn.Parameter(moved, requires_grad=False))
        return self

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, format={self.fmt.describe()}"


def module_linear(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`module(x)`; a plain `nn.Linear` through the backend's dense GEMM (`kernels.backend.dense_linear`: cuBLAS or
    a skinny Triton GEMM for a decode step's few rows, as measured per shape)."""
    if type(module) is nn.Linear:
        return kernel_backend.dense_linear(x, module.weight, module.bias)
    return module(x)


def module_swiglu_linear(module: nn.Module, gate: torch.Tensor, up: torch.Tensor, backend: KernelBackend
                         ) -> torch.Tensor:
    """`module(backend.silu_mul(gate, up))`; a plain `nn.Linear` through `kernels.backend.dense_swiglu_linear`
    (one launch for both where the skinny GEMM runs)."""
    if type(module) is nn.Linear:
        return kernel_backend.dense_swiglu_linear(gate, up, module.weight, module.bias, backend.silu_mul)
    return module(backend.silu_mul(gate, up))
