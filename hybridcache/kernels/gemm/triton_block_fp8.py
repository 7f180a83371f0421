"""The block-scaled FP8 GEMM (DeepSeek-V3's recipe): activations quantised per token per 128 channels, weights
per 128 x 128 block, fp32 accumulation, one scale product per K tile.

    out[m, n] = sum over K tiles b of (aq[m, b] . w[n, b]) * a_scale[m, b] * w_scale[n // GROUP_N, b]

Program (m, n) computes a BLOCK_M x BLOCK_N tile of the output; its K loop steps one scale group (GROUP_K = 128
channels) at a time, so each step reads one activation scale per row and one weight scale per column. Rows and
columns past M, N and channels past K are masked to zero (any M, N, K; the last groups may be partial).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridcache.fp8_format import FP8_DTYPE
from hybridcache.kernels.gemm.reference import quantize_groups


@triton.jit
def _block_fp8_gemm_kernel(a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, out_ptr, M, N, K,
                           stride_am, stride_wn, stride_om, stride_asm, stride_wsn,
                           GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    rows64 = rows.to(tl.int64)
    cols64 = cols.to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for group in range(0, tl.cdiv(K, GROUP_K)):
        ks = group * GROUP_K + tl.arange(0, GROUP_K)
        k_ok = ks < K
        a = tl.load(a_ptr + rows64[:, None] * stride_am + ks[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)
        w = tl.load(w_ptr + cols64[None, :] * stride_wn + ks[:, None], mask=k_ok[:, None] & col_ok[None, :],
                    other=0.0)
        a_scale = tl.load(a_scale_ptr + rows64 * stride_asm + group, mask=row_ok, other=0.0)
        w_scale = tl.load(w_scale_ptr + (cols64 // GROUP_N) * stride_wsn + group, mask=col_ok, other=0.0)
        acc += tl.dot(a, w, out_dtype=tl.float32) * a_scale[:, None] * w_scale[None, :]
    out = out_ptr + rows64[:, None] * stride_om + cols64[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def block_fp8_gemm(aq: torch.Tensor, a_scale: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                   block: tuple[int, int], out_dtype: torch.dtype, *, block_m: int = 64,
                   block_n: int = 128, num_warps: int = 4, num_stages: int = 3) -> torch.Tensor:
    """The launcher: aq [M, K] float8_e4m3fn with a_scale [M, ceil(K/bk)] fp32, weight [N, K] float8_e4m3fn with
    scale_inv [ceil(N/bn), ceil(K/bk)] fp32, block = (bn, bk) -> out [M, N] in `out_dtype`. Unit stride on K
    (and on the scales' group dim) is required; shapes, dtypes and strides are checked before the launch."""
    bn, bk = block
    if aq.dim() != 2 or weight.dim() != 2 or aq.shape[1] != weight.shape[1]:
        raise ValueError(f"block_fp8_gemm: aq [M, K] and weight [N, K] needed, got {list(aq.shape)} and "
                         f"{list(weight.shape)}")
    if aq.dtype != FP8_DTYPE or weight.dtype != FP8_DTYPE:
        raise ValueError(f"block_fp8_gemm: aq and weight must be {FP8_DTYPE}, got {aq.dtype} and {weight.dtype}")
    (m, k), n = aq.shape, weight.shape[0]
    groups = -(-k // bk)
    if tuple(a_scale.shape) != (m, groups) or tuple(scale_inv.shape) != (-(-n // bn), groups):
        raise ValueError(f"block_fp8_gemm: scales [{m}, {groups}] and [{-(-n // bn)}, {groups}] needed for block "
                         f"{block}, got {list(a_scale.shape)} and {list(scale_inv.shape)}")
    if a_scale.dtype != torch.float32 or scale_inv.dtype != torch.float32:
        raise ValueError("block_fp8_gemm: the scales must be float32")
    if aq.stride(1) != 1 or weight.stride(1) != 1 or a_scale.stride(1) != 1 or scale_inv.stride(1) != 1:
        raise ValueError("block_fp8_gemm needs unit stride on K (activations, weight and both scales)")
    if bk < 16 or bk & (bk - 1):
        raise ValueError(f"block_fp8_gemm: the K group {bk} must be a power of two >= 16")
    out = torch.empty((m, n), dtype=out_dtype, device=aq.device)
    if m and n:
        grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
        _block_fp8_gemm_kernel[grid](
            aq, a_scale, weight, scale_inv, out, m, n, k,
            aq.stride(0), weight.stride(0), out.stride(0), a_scale.stride(0), scale_inv.stride(0),
            GROUP_N=bn, GROUP_K=bk, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps, num_stages=num_stages,
        )
    return out


def block_fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] (bf16/fp16/fp32) -> x W^T (+ bias) [..., N] in x's dtype, W the block-scaled FP8 weight [N, K]
    with scale_inv [ceil(N/bn), ceil(K/bk)]; x is quantised per token per bk channels first (`quantize_groups`)."""
    lead = x.shape[:-1]
    xq, x_scale = quantize_groups(x.reshape(-1, x.shape[-1]), block[1])
    out = block_fp8_gemm(xq, x_scale, weight, scale_inv.float(), block, x.dtype)
    out = out.reshape(*lead, weight.shape[0])
    return out if bias is None else out + bias
