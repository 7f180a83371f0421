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
    FusedProjection(q_proj, k_proj, v_proj, g_proj, groups=(3, 1))(x)   # (qkv [T, Nq + Nk + Nv], g [T, Ng]):
                                                        # consecutive projections as one view (OLMo Hybrid's conv
                                                        # input q | k | v, without a copy)

In a decode step of 64 sequences each projection is a weight-bound GEMM of a few microseconds: one launch
instead of two to four per layer, and one larger GEMM that streams the weights at a higher rate.

The fused output has `padded_rows(sum N_i)` columns: plain weights get zero rows up to a multiple of `ROW_ALIGN`, so
every output row starts 16 bytes after the one before. cuBLAS runs its Hopper GEMMs only on aligned rows; the
MoE block's shared expert gate | up | router | shared gate is 2 x 1,024 + 32 + 1 = 2,081 wide on next-16b, and
unpadded it ran an sm75 kernel (docs/bench.md, session 43). The views returned stop before the padding.

FP8 projections (`layers/linear.py::Fp8Linear`) of one format are fused the same way, their scales concatenated
with their weights, when every projection but the last fills whole scale blocks (block format: out_features a
multiple of bn; channel format: always). A mix of formats, or unaligned blocks, runs one GEMM per projection.
"""

from __future__ import annotations

import torch
from torch import nn

import hybridcache.kernels.backend as kernel_backend
from hybridcache.layers.linear import Fp8Linear, Fp8Rows, dense_input

ROW_ALIGN = 8  # output columns per fused row, a multiple of: 16 bytes of bf16 (32 of fp32)


def padded_rows(rows: int) -> int:
    """`rows` rounded up to a multiple of ROW_ALIGN: 2,081 -> 2,088, 2,048 -> 2,048."""
    return -(-rows // ROW_ALIGN) * ROW_ALIGN


class FusedProjection:
    """Callable: x [..., H] -> one output view [..., N_i] per projection, in the order given; with `groups` (counts
    of consecutive projections, summing to their number) one view per group instead, its projections' columns side
    by side. Not an `nn.Module`, so it adds no parameters or state-dict entries to the layer that holds it."""

    def __init__(self, *linears: nn.Linear, groups: tuple[int, ...] | None = None) -> None:
        if len(linears) < 2:
            raise ValueError("FusedProjection needs at least two projections")
        if len({linear.in_features for linear in linears}) != 1:
            raise ValueError("fused projections must read inputs of one size")
        groups = groups or (1,) * len(linears)
        if sum(groups) != len(linears) or min(groups) < 1:
            raise ValueError(f"groups {groups} must be counts >= 1 of the {len(linears)} projections")
        self.linears = linears
        self.sizes = [linear.out_features for linear in linears]
        bounds = [sum(groups[:i]) for i in range(len(groups) + 1)]
        self.out_sizes = [sum(self.sizes[start:stop]) for start, stop in zip(bounds, bounds[1:])]
        self.weight: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None
        self.fp8: Fp8Linear | None = None  # the fused FP8 projection, when the projections are FP8
        self._pointers: tuple[int, ...] = ()
        self._checked: tuple[nn.Module, ...] | None = None  # the linears `_fused` was decided for
        self._fused = True

    def __call__(self, x: torch.Tensor | Fp8Rows) -> tuple[torch.Tensor, ...]:
        """x [..., H], or `Fp8Rows` of x [T, H] (a norm's pre-quantised output: the FP8 GEMMs read it, the dense
        ones its x)."""
        if not self.fused():
            outs = [linear(x if isinstance(linear, Fp8Linear) else dense_input(x)) for linear in self.linears]
            if len(self.out_sizes) == len(outs):
                return tuple(outs)
            return torch.cat(outs, dim=-1).split(self.out_sizes, dim=-1)
        if tuple(linear.weight.data_ptr() for linear in self.linears) != self._pointers:
            self._fuse()
        fp8 = self.fp8
        out = kernel_backend.dense_linear(dense_input(x), self.weight, self.bias) if fp8 is None else fp8(x)
        return out[..., : sum(self.sizes)].split(self.out_sizes, dim=-1)

    def fused(self) -> bool:
        """Whether a call runs one GEMM (plain linears, or FP8 ones that `_fusable` accepts), else one per
        projection; decided again when the linears were replaced (a model quantised after construction)."""
        if self._checked is not self.linears:
            self._fused, self._checked = self._fusable(), self.linears
        return self._fused

    def _fusable(self) -> bool:
        """Plain linears, or FP8 linears of one format whose scale blocks do not straddle two projections."""
        kinds = {type(linear) for linear in self.linears}
        if kinds == {nn.Linear}:
            return True
        if kinds != {Fp8Linear} or len({linear.fmt for linear in self.linears}) != 1:
            return False
        fmt = self.linears[0].fmt
        return fmt.kind == "channel" or all(size % fmt.block[0] == 0 for size in self.sizes[:-1])

    @torch.no_grad()
    def _fuse(self) -> None:
        fp8 = isinstance(self.linears[0], Fp8Linear)
        with torch.inference_mode(False):  # ordinary tensors even when the first call runs in inference mode
            weights = [linear.weight for linear in self.linears]
            pad = 0 if fp8 else padded_rows(sum(self.sizes)) - sum(self.sizes)  # FP8: the GEMM's own alignment
            weight = torch.cat([*weights, weights[0].new_zeros(pad, weights[0].shape[1])])
            scale = torch.cat([linear.scale for linear in self.linears]) if fp8 else None
            biases = [linear.bias for linear in self.linears]
            bias = None
            if any(b is not None for b in biases):
                bias_dtype = next(b.dtype for b in biases if b is not None)  # not an FP8 weight's dtype
                bias = torch.cat([*(b if b is not None else weight.new_zeros(size, dtype=bias_dtype)
                                    for b, size in zip(biases, self.sizes, strict=True)),
                                  weight.new_zeros(pad, dtype=bias_dtype)])
        start, scale_start = 0, 0
        for linear, size in zip(self.linears, self.sizes, strict=True):
            linear.weight.data = weight[start:start + size]
            if linear.bias is not None:
                linear.bias.data = bias[start:start + size]
            if scale is not None:
                rows = linear.scale.shape[0]
                linear.scale.data = scale[scale_start:scale_start + rows]
                scale_start += rows
            start += size
        self.weight, self.bias = weight, bias
        if fp8:
            first = self.linears[0]
            with torch.device("meta"):
                self.fp8 = Fp8Linear(first.in_features, weight.shape[0], first.fmt)
            self.fp8.weight = nn.Parameter(weight, requires_grad=False)
            setattr(self.fp8, first.fmt.scale_name, nn.Parameter(scale, requires_grad=False))
            self.fp8.bias = bias
            self.fp8.gemm = first.gemm
        self._pointers = tuple(linear.weight.data_ptr() for linear in self.linears)

