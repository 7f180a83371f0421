"""Partial rotary embedding in one Triton launch per tensor (same math as `rotary/reference.py`, which takes
torch about six elementwise kernels per tensor: two slices' products, the negation, two concatenations, the sum).

One program per token: all heads of the row, computed in fp32 from the partner channel (d +- R/2) and rounded
once; channels at or past R are copied. Inputs may be strided over tokens and heads (the layers pass views of
the fused q/k/v projection and normed heads) but need unit stride over channels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotary_kernel(x_ptr, out_ptr, cos_ptr, sin_ptr, num_heads, stride_xt, stride_xh, stride_ot, stride_oh,
                   stride_ct, HALF: tl.constexpr, DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
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


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    num_tokens, num_heads, dim = x.shape
    rotary_dim = cos.shape[-1]
    if x.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride() != cos.stride():
        raise ValueError("rotary needs unit stride over channels and cos/sin of one layout")
    if rotary_dim % 2 or rotary_dim > dim:
        raise ValueError(f"rotary dim {rotary_dim} must be even and at most the head dim {dim}")
    out = torch.empty((num_tokens, num_heads, dim), dtype=x.dtype, device=x.device)
    if num_tokens:
        _rotary_kernel[(num_tokens,)](
            x, out, cos, sin, num_heads, x.stride(0), x.stride(1), out.stride(0), out.stride(1), cos.stride(0),
            HALF=rotary_dim // 2, DIM=dim, BLOCK_H=triton.next_power_of_2(num_heads),
            BLOCK_D=triton.next_power_of_2(dim),
        )
    return out


def rotary(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor,
           sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """query [T, Hq, D], key [T, Hk, D], cos/sin [T, R] (R even, <= D) -> the rotated query and key (new
    tensors in their dtypes; the first R channels rotated, computed in fp32 and rounded once)."""
    return _rotate(query, cos, sin), _rotate(key, cos, sin)
