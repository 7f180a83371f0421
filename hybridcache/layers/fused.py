"""One GEMM for several projections of the same input (what vLLM's QKV and merged column linears do), with one
copy of the weights.

The layer keeps its `nn.Linear` modules (their parameter names are the checkpoint's; the loader, tensor-parallel
sharding and `state_dict` see nothing new). On the first call the projections' weights (and biases) are
concatenated along the output dim and each module's parameters are re-pointed at their rows of the
concatenation, so the modules and the fused GEMM share memory. If a module's weight is later replaced rather
than written in place (`module.to(...)`, `param.data = ...`), the next call sees a different storage and fuses
again.

    qkv = FusedProjection(q_proj, k_proj, v_proj)      # weights [Nq, H], [Nk, H], [Nv, H]
    q, k, v = qkv(x)                                    # x [T, H]: one F.linear with [Nq + Nk + Nv, H];
                                                        # q, k, v: column views [T, Nq], [T, Nk], [T, Nv]

In a decode step of 64 sequences each projection is a weight-bound GEMM of a few microseconds: one launch
instead of two to four per layer, and one larger GEMM that streams the weights at a higher rate.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class FusedProjection:
    """Callable: x [..., H] -> one output view [..., N_i] per projection, in the order given. Not an
    `nn.Module`, so it adds no parameters or state-dict entries to the layer that holds it."""

    def __init__(self, *linears: nn.Linear) -> None:
        if len(linears) < 2:
            raise ValueError("FusedProjection needs at least two projections")
        if len({linear.in_features for linear in linears}) != 1:
            raise ValueError("fused projections must read inputs of one size")
        self.linears = linears
        self.sizes = [linear.out_features for linear in linears]
        self.weight: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None
        self._pointers: tuple[int, ...] = ()

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if tuple(linear.weight.data_ptr() for linear in self.linears) != self._pointers:
            self._fuse()
        return F.linear(x, self.weight, self.bias).split(self.sizes, dim=-1)

    @torch.no_grad()
    def _fuse(self) -> None:
        with torch.inference_mode(False):  # ordinary tensors even when the first call runs in inference mode
            weight = torch.cat([linear.weight for linear in self.linears])
            biases = [linear.bias for linear in self.linears]
            bias = None
            if any(b is not None for b in biases):
                bias = torch.cat([b if b is not None else weight.new_zeros(size)
                                  for b, size in zip(biases, self.sizes, strict=True)])
        start = 0
        for linear, size in zip(self.linears, self.sizes, strict=True):
            linear.weight.data = weight[start:start + size]
            if linear.bias is not None:
                linear.bias.data = bias[start:start + size]
            start += size
        self.weight, self.bias = weight, bias
        self._pointers = tuple(linear.weight.data_ptr() for linear in self.linears)
