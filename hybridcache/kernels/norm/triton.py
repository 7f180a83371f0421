"""Fused RMSNorms on CUDA (Triton): one launch per norm instead of torch's five or six elementwise kernels.
Same math and the same roundings as `layers.norm` (one program per row of the last dim):

- `rms_norm` (ZeroCenteredRMSNorm): y = x / rms(x) * (1 + w), all in fp32, rounded once to x's dtype.
- `gated_rms_norm` (GatedRMSNorm of DeltaNet outputs): n = (x / rms(x)) rounded to x's dtype; p = w * n rounded
  to x's dtype (the module multiplies in the weight's dtype); y = p * silu(gate) in fp32, rounded once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_x, stride_o, dim, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < dim
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / dim + eps)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (x * rstd * (1.0 + w)).to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _gated_rms_norm_kernel(x_ptr, g_ptr, w_ptr, out_ptr, stride_x, stride_g, stride_o, dim, eps,
                           BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < dim
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / dim + eps)
    dtype = out_ptr.dtype.element_ty
    normed = (x * rstd).to(dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    scaled = (w * normed).to(dtype).to(tl.float32)
    gate = tl.load(g_ptr + row * stride_g + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (scaled * (gate * tl.sigmoid(gate))).to(dtype), mask=ok)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """[..., dim] -> [rows, dim] with unit stride on dim (a view when the layout allows)."""
    flat = x.reshape(-1, x.shape[-1])
    return flat if flat.stride(-1) == 1 else flat.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Zero-centred RMSNorm over the last dim: x [..., dim], weight [dim] -> [..., dim] in x's dtype."""
    rows = _rows(x)
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](rows, weight, out, rows.stride(0), out.stride(0), rows.shape[1], eps,
                                          BLOCK=triton.next_power_of_2(rows.shape[1]))
    return out.view(x.shape)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gated RMSNorm over the last dim: x, gate [..., dim], weight [dim] -> [..., dim] in x's dtype."""
    rows, gates = _rows(x), _rows(gate)
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        _gated_rms_norm_kernel[(rows.shape[0],)](rows, gates, weight, out, rows.stride(0), gates.stride(0),
                                                out.stride(0), rows.shape[1], eps,
                                                BLOCK=triton.next_power_of_2(rows.shape[1]))
    return out.view(x.shape)
