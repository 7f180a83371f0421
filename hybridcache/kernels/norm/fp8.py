"""The norms before an FP8 linear with the quantisation of their output for it (`layers.linear.Fp8Rows`), by
device: on CUDA the norm and the quantisation in one launch (`triton.py`'s `*_fp8` kernels), elsewhere (and on CUDA
where those kernels do not take the layout) the norm, then `quantize_for_gemm`. Every path gives the same
values: the quantisation is `gemm.reference.quantize_groups`' arithmetic on the norm's output as stored."""

from __future__ import annotations

import torch

from hybridcache.kernels.norm import reference as norm_ref


def quantize_for_gemm(x: torch.Tensor, group: int, pad_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (xq [T', K] float8_e4m3fn, scale [T', ceil(K/group)] fp32 stored column-major), T' = T rounded
    up to `pad_rows`, the rows past T zeros: `triton_quant.quantize_groups(x, group, pad_rows=pad_rows,
    column_major=True)` on CUDA, the same from `gemm.reference.quantize_groups` elsewhere."""
    if x.is_cuda:
        from hybridcache.kernels.gemm import triton_quant

        return triton_quant.quantize_groups(x, group, pad_rows=pad_rows, column_major=True)
    from hybridcache.kernels.gemm import reference

    tokens = x.shape[0]
    padded = -(-tokens // pad_rows) * pad_rows
    xq, scale = reference.quantize_groups(torch.cat([x, x.new_zeros(padded - tokens, x.shape[1])]), group)
    return xq, scale.t().contiguous().t()


def add_rms_norm_fp8(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, group: int,
                     pad_rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x, residual [T, dim] -> (x + residual, its zero-centred RMSNorm, and the norm's `quantize_for_gemm`)."""
    if x.is_cuda:
        from hybridcache.kernels.norm import triton as norm_triton

        return norm_triton.add_rms_norm_fp8(x, residual, weight, eps, group, pad_rows)
    total, normed = norm_ref.add_rms_norm(x, residual, weight, eps)
    return total, normed, *quantize_for_gemm(normed, group, pad_rows)


def gated_rms_norm_fp8(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, group: int,
                       pad_rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x, gate [T, heads, dim] -> (the gated RMSNorm flattened to [T, heads * dim], and its `quantize_for_gemm`)."""
    tokens = x.shape[0]
    if x.is_cuda:
        from hybridcache.kernels.norm import triton as norm_triton

        if x.dim() == 3 and x.shape[-1] % group == 0:
            out, xq, scale = norm_triton.gated_rms_norm_fp8(x, gate, weight, eps, group, pad_rows)
            return out.view(tokens, -1), xq, scale
        out = norm_triton.gated_rms_norm(x, gate, weight, eps).reshape(tokens, -1)
    else:
        out = norm_ref.gated_rms_norm(x, gate, weight, eps).reshape(tokens, -1)
    return out, *quantize_for_gemm(out, group, pad_rows)
