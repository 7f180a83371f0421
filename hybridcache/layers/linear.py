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

An FP8 linear may take its input already quantised (`Fp8Rows`): the norm before it writes the FP8 activations and
their scales in its own launch (`layers/norm.py`, `fp8=True`), so the GEMM skips its quantisation launch. A layer
asks `wants_fp8_rows(projection, x)` first; `module_linear`, `FusedProjection` and `Fp8Linear` take either input.

    normed = norm.add(x, residual, backend, fp8=wants_fp8_rows(proj, x))   # a tensor, or Fp8Rows
    proj(normed)                                                           # the GEMM on normed.xq / normed.scale
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn

import hybridcache.kernels.backend as kernel_backend
from hybridcache.fp8_format import FP8_DTYPE, Fp8Format
from hybridcache.kernels.backend import KernelBackend

PREQUANTIZED_GROUP = 128  # the activations' group of the block-scaled GEMMs (`triton_block_fp8.fp8_linear`)
PREQUANTIZED_PAD_ROWS = 4  # tokens padded to a multiple of this (cuBLAS's block-scaled layout)
_FAST_DTYPES = (torch.bfloat16, torch.float16)


class Fp8Rows(NamedTuple):
    """An FP8 linear's input x [T, K] with its quantisation per token per `PREQUANTIZED_GROUP` channels, in the
    layout `scaled_mm.block_fp8_linear` hands cuBLAS: exactly `triton_quant.quantize_groups(x, 128, pad_rows=4,
    column_major=True)`.

        x      [T, K] bf16 / fp16 (what a dense linear of the same input reads)
        xq     [T', K] float8_e4m3fn, T' = T rounded up to a multiple of 4 (the rows past T zeros)
        scale  [T', ceil(K/128)] fp32, stored column-major (stride (1, T'))
    """

    x: torch.Tensor
    xq: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        """x's shape (a layer reads the token count from its input)."""
        return self.x.shape


def dense_input(x: torch.Tensor | Fp8Rows) -> torch.Tensor:
    """The input as a tensor: x itself, or an `Fp8Rows`' unquantised x."""
    return x.x if isinstance(x, Fp8Rows) else x


def takes_fp8_rows(linear: nn.Module) -> bool:
    """Whether `linear` runs its GEMM on an `Fp8Rows` input's xq / scale: an `Fp8Linear` in the block format with
    K blocks of `PREQUANTIZED_GROUP` on the default GEMM backend (the "triton" one on CUDA)."""
    return (isinstance(linear, Fp8Linear) and linear.fmt.kind == "block"
            and linear.fmt.block[1] == PREQUANTIZED_GROUP and linear.gemm in (None, "triton"))


def wants_fp8_rows(projection: object, x: torch.Tensor) -> bool:
    """Whether the norm before `projection` (a linear, a `FusedProjection`, or None) should hand it `Fp8Rows` of
    its output x: x bf16 / fp16 on CUDA and one of the projection's linears `takes_fp8_rows`."""
    if projection is None or not x.is_cuda or x.dtype not in _FAST_DTYPES:
        return False
    return any(takes_fp8_rows(linear) for linear in getattr(projection, "linears", (projection,)))


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

    def forward(self, x: torch.Tensor | Fp8Rows) -> torch.Tensor:
        """x [..., K], or `Fp8Rows` of x [T, K]: then, where this linear `takes_fp8_rows` and x is bf16 / fp16 on
        CUDA, the GEMM runs on its xq / scale (the same product as quantising x here), else on its x."""
        if isinstance(x, Fp8Rows):
            rows = x.x
            if takes_fp8_rows(self) and rows.is_cuda and rows.dtype in _FAST_DTYPES:
                return kernel_backend.fp8_linear_quantized(rows, x.xq, x.scale, self.weight, self.scale, self.fmt,
                                                           self.bias)
            x = rows
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


def module_linear(module: nn.Module, x: torch.Tensor | Fp8Rows) -> torch.Tensor:
    """`module(x)`; a plain `nn.Linear` through the backend's dense GEMM (`kernels.backend.dense_linear`: cuBLAS or
    a skinny Triton GEMM for a decode step's few rows, as measured per shape). `Fp8Rows` go whole to an
    `Fp8Linear`, as their x to anything else."""
    if type(module) is nn.Linear:
        return kernel_backend.dense_linear(dense_input(x), module.weight, module.bias)
    return module(x) if isinstance(module, Fp8Linear) else module(dense_input(x))


def module_swiglu_linear(module: nn.Module, gate: torch.Tensor, up: torch.Tensor, backend: KernelBackend
                         ) -> torch.Tensor:
    """`module(backend.silu_mul(gate, up))`; a plain `nn.Linear` through `kernels.backend.dense_swiglu_linear`
    (one launch for both where the skinny GEMM runs)."""
    if type(module) is nn.Linear:
        return kernel_backend.dense_swiglu_linear(gate, up, module.weight, module.bias, backend.silu_mul)
    return module(backend.silu_mul(gate, up))


@torch.no_grad()
def scale_linear_(linear: nn.Linear, weight: float | torch.Tensor, bias: float | torch.Tensor | None = None) -> None:
    """Fold constant scales into a dense linear, in place: its weight's rows times `weight` (a scalar, or one per
    output row) and its bias times `bias` (default: `weight`), each product in fp32, rounded once to the dtype.

        y = m * linear(a * x)   ->   scale_linear_(linear, m * a, m)      (an input scale leaves the bias)

    For a family's constant multipliers (Falcon-H1's muP), so that the forward applies none of them."""
    if not isinstance(linear, nn.Linear):
        raise TypeError(f"scale_linear_ folds scales into a dense nn.Linear, not {type(linear).__name__}")
    bias = weight if bias is None else bias
    for param, scale in ((linear.weight, weight), (linear.bias, bias)):
        if param is None:
            continue
        if isinstance(scale, torch.Tensor):
            scale = scale.to(device=param.device, dtype=torch.float32).reshape(-1, *([1] * (param.dim() - 1)))
        elif scale == 1.0:
            continue
        param.copy_(param.float() * scale)
