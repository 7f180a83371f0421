"""Partial rotary embedding in one Triton launch per tensor (same math as `rotary/reference.py`, which takes
torch about six elementwise kernels per tensor: two slices' products, the negation, two concatenations, the sum).

One program per token: all heads of the row, computed in fp32 from the partner channel (d +- R/2) and rounded
once; channels at or past R are copied. Inputs may be strided over tokens and heads (the layers pass views of
the fused q/k/v projection and normed heads) but need unit stride over channels.

`norm_rotary`: the attention layer's q_norm and k_norm (zero-centred RMSNorm per head, `norm/triton.py`'s math)
and the rotation of both, in one launch (four before): one program per token normalises its query heads, then its
key heads, each channel and its partner channel from the head's one sum of squares, rounds the normed values to
the output dtype (where the separate norm kernel stored them) and rotates them as `rotary` does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridcache.kernels import pdl


@triton.jit
def _rotary_kernel(x_ptr, out_ptr, cos_ptr, sin_ptr, num_heads, stride_xt, stride_xh, stride_ot, stride_oh,
                   stride_ct, HALF: tl.constexpr, DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                   PDL: tl.constexpr):
    pdl.start(PDL)
    token = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)
    chans = tl.arange(0, BLOCK_D)
    ok = (heads < num_heads)[:, None] & (chans < DIM)[None, :]
    rotated = chans < 2 * HALF
    partner = tl.where(chans < HALF, chans + HALF, chans - HALF)
    sign = tl.where(chans < HALF, -1.0, 1.0)
    row = x_ptr + token * stride_xt + heads[:, None] * stride_xh
    x = tl.load(row + chans[None, :], mask=ok, other=0.0).to(tl.float32)
    x_partner = tl.load(row + partner[None, :], mask=ok & rotated[None, :], other=0.0).to(tl.float32)
    cos = tl.load(cos_ptr + token * stride_ct + chans, mask=rotated, other=1.0).to(tl.float32)
    sin = tl.load(sin_ptr + token * stride_ct + chans, mask=rotated, other=0.0).to(tl.float32)
    out = x * cos[None, :] + sign[None, :] * x_partner * sin[None, :]
    dest = out_ptr + token * stride_ot + heads[:, None] * stride_oh + chans[None, :]
    tl.store(dest, out.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _norm_rotate_heads(x_ptr, out_ptr, w_ptr, cos, sin, token, num_heads, stride_xt, stride_xh, eps,
                       chans, partner, sign, rotated, HALF: tl.constexpr, DIM: tl.constexpr, BLOCK_H: tl.constexpr):
    """One token's heads of one tensor: zero-centred RMSNorm of each head (rounded to the output dtype), then the
    partial rotation (`_rotary_kernel`'s expression); out is contiguous [T, num_heads, DIM]."""
    heads = tl.arange(0, BLOCK_H)
    ok = (heads < num_heads)[:, None] & (chans < DIM)[None, :]
    row = x_ptr + token * stride_xt + heads[:, None] * stride_xh
    x = tl.load(row + chans[None, :], mask=ok, other=0.0).to(tl.float32)
    x_partner = tl.load(row + partner[None, :], mask=ok & rotated[None, :], other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / DIM + eps)
    dtype = out_ptr.dtype.element_ty
    w = tl.load(w_ptr + chans, mask=chans < DIM, other=0.0).to(tl.float32)
    w_partner = tl.load(w_ptr + partner, mask=rotated, other=0.0).to(tl.float32)
    n = (x * rstd[:, None] * (1.0 + w[None, :])).to(dtype).to(tl.float32)
    n_partner = (x_partner * rstd[:, None] * (1.0 + w_partner[None, :])).to(dtype).to(tl.float32)
    out = n * cos[None, :] + sign[None, :] * n_partner * sin[None, :]
    dest = out_ptr + token * num_heads * DIM + heads[:, None] * DIM + chans[None, :]
    tl.store(dest, out.to(dtype), mask=ok)


@triton.jit
def _norm_rotary_kernel(q_ptr, k_ptr, q_out_ptr, k_out_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, num_q_heads,
                        num_k_heads, stride_qt, stride_qh, stride_kt, stride_kh, stride_ct, eps,
                        HALF: tl.constexpr, DIM: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
                        BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    pdl.start(PDL)
    token = tl.program_id(0).to(tl.int64)
    chans = tl.arange(0, BLOCK_D)
    rotated = chans < 2 * HALF
    partner = tl.where(chans < HALF, chans + HALF, chans - HALF)
    sign = tl.where(chans < HALF, -1.0, 1.0)
    cos = tl.load(cos_ptr + token * stride_ct + chans, mask=rotated, other=1.0).to(tl.float32)
    sin = tl.load(sin_ptr + token * stride_ct + chans, mask=rotated, other=0.0).to(tl.float32)
    _norm_rotate_heads(q_ptr, q_out_ptr, qw_ptr, cos, sin, token, num_q_heads, stride_qt, stride_qh, eps, chans,
                       partner, sign, rotated, HALF, DIM, BLOCK_HQ)
    _norm_rotate_heads(k_ptr, k_out_ptr, kw_ptr, cos, sin, token, num_k_heads, stride_kt, stride_kh, eps, chans,
                       partner, sign, rotated, HALF, DIM, BLOCK_HK)


def _check_layout(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    rotary_dim = cos.shape[-1]
    if x.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride() != cos.stride():
        raise ValueError("rotary needs unit stride over channels and cos/sin of one layout")
    if rotary_dim % 2 or rotary_dim > x.shape[-1]:
        raise ValueError(f"rotary dim {rotary_dim} must be even and at most the head dim {x.shape[-1]}")


def norm_rotary(query: torch.Tensor, key: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """query [T, Hq, D], key [T, Hk, D] (one dtype; views strided over tokens and heads allowed), weights [D],
    cos/sin [T, R] -> the zero-centred-RMSNormed, rotated query and key: new contiguous tensors in their dtype, in
    one launch (module docstring; `reference.norm_rotary`)."""
    for x in (query, key):
        _check_layout(x, cos, sin)
    num_tokens, num_q_heads, dim = query.shape
    if key.shape[0] != num_tokens or key.shape[2] != dim or key.dtype != query.dtype:
        raise ValueError(f"norm_rotary: key {tuple(key.shape)} {key.dtype} does not match query "
                         f"{tuple(query.shape)} {query.dtype}")
    q_out = torch.empty((num_tokens, num_q_heads, dim), dtype=query.dtype, device=query.device)
    k_out = torch.empty(tuple(key.shape), dtype=key.dtype, device=key.device)
    if num_tokens:
        _norm_rotary_kernel[(num_tokens,)](
            query, key, q_out, k_out, q_weight, k_weight, cos, sin, num_q_heads, key.shape[1], query.stride(0),
            query.stride(1), key.stride(0), key.stride(1), cos.stride(0), eps, HALF=cos.shape[-1] // 2, DIM=dim,
            BLOCK_HQ=triton.next_power_of_2(num_q_heads), BLOCK_HK=triton.next_power_of_2(key.shape[1]),
            BLOCK_D=triton.next_power_of_2(dim), **pdl.options(query),
        )
    return q_out, k_out


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    num_tokens, num_heads, dim = x.shape
    rotary_dim = cos.shape[-1]
    _check_layout(x, cos, sin)
    out = torch.empty((num_tokens, num_heads, dim), dtype=x.dtype, device=x.device)
    if num_tokens:
        _rotary_kernel[(num_tokens,)](
            x, out, cos, sin, num_heads, x.stride(0), x.stride(1), out.stride(0), out.stride(1), cos.stride(0),
            HALF=rotary_dim // 2, DIM=dim, BLOCK_H=triton.next_power_of_2(num_heads),
            BLOCK_D=triton.next_power_of_2(dim), **pdl.options(x),
        )
    return out


def rotary(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor,
           sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """query [T, Hq, D], key [T, Hk, D], cos/sin [T, R] (R even, <= D) -> the rotated query and key (new
    tensors in their dtypes; the first R channels rotated, computed in fp32 and rounded once)."""
    return _rotate(query, cos, sin), _rotate(key, cos, sin)
