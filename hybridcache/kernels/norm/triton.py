"""Fused row norms on CUDA (Triton): one launch per norm instead of torch's five or six elementwise kernels.
Same math and the same roundings as `layers.norm` / the references (one program per row of the last dim):

- `rms_norm` (ZeroCenteredRMSNorm): y = x / rms(x) * (1 + w), all in fp32, rounded once to x's dtype.
- `gated_rms_norm` (GatedRMSNorm of DeltaNet outputs): n = (x / rms(x)) rounded to x's dtype; p = w * n rounded
  to x's dtype (the module multiplies in the weight's dtype); y = p * silu(gate) in fp32, rounded once.
- `l2norm` (the gated delta rule's q / k): y = x / sqrt(sum(x^2) + eps) in fp32, rounded once (fla's
  convention, `gated_delta.reference.l2norm`). Ours rather than fla's in-kernel one: fla autotunes its l2norm
  over 25 configs per bucket of T * H / 65,536, so the first prefill of each new size bucket compiled for ~12 s
  on the H200 (gpu_bench, next-1b phase D).

Inputs may be head views: a [T, H, D] tensor whose rows sit at t * stride_t + h * stride_h (q / k / z sliced out
of a fused projection, q / k / v out of the conv output) is read in place, never copied first. Row r of the
output (contiguous [T * H, D]) is (t, h) = divmod(r, H)::

    x = qkv[:, :1024].view(T, 8, 128)      stride_t = 3072 (the fused row), stride_h = 128, heads = 8
    row r -> x_ptr + (r // 8) * 3072 + (r % 8) * 128 + [0, 128)
No autotuning, so nothing compiles at run time beyond Triton's integer specialisations, which the engine's warm-up
reaches.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _load_row(x_ptr, row, stride_t, stride_h, heads, cols, ok):  # row `row` of a [T, H, D] view, in fp32
    start = (row // heads) * stride_t + (row % heads) * stride_h
    return tl.load(x_ptr + start + cols, mask=ok, other=0.0).to(tl.float32)


# Every kernel: one program per row; (x_ptr, out_ptr, stride_t, stride_h, heads, dim, eps) first, then its own.
@triton.jit
def _rms_norm_kernel(x_ptr, out_ptr, stride_t, stride_h, heads, dim, eps, w_ptr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < dim
    x = _load_row(x_ptr, row, stride_t, stride_h, heads, cols, ok)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / dim + eps)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * dim + cols, (x * rstd * (1.0 + w)).to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _gated_rms_norm_kernel(x_ptr, out_ptr, stride_t, stride_h, heads, dim, eps, g_ptr, gate_stride_t, gate_stride_h,
                           w_ptr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < dim
    x = _load_row(x_ptr, row, stride_t, stride_h, heads, cols, ok)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / dim + eps)
    dtype = out_ptr.dtype.element_ty
    normed = (x * rstd).to(dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    scaled = (w * normed).to(dtype).to(tl.float32)
    gate = _load_row(g_ptr, row, gate_stride_t, gate_stride_h, heads, cols, ok)
    tl.store(out_ptr + row * dim + cols, (scaled * (gate * tl.sigmoid(gate))).to(dtype), mask=ok)


@triton.jit
def _l2norm_kernel(x_ptr, out_ptr, stride_t, stride_h, heads, dim, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < dim
    x = _load_row(x_ptr, row, stride_t, stride_h, heads, cols, ok)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) + eps)
    tl.store(out_ptr + row * dim + cols, (x * rstd).to(out_ptr.dtype.element_ty), mask=ok)


def _rows(x: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """x [..., dim] as (tensor, stride_t, stride_h, heads): row r at (r // heads) * stride_t + (r % heads) *
    stride_h with unit-stride columns. 2-D inputs and 3-D head views are read in place; other layouts are
    reshaped (copied when they must be)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    if x.dim() == 3:
        return x, x.stride(0), x.stride(1), x.shape[1]
    flat = x.reshape(-1, x.shape[-1])
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    return flat, flat.stride(0), 0, 1


def _launch(kernel, x: torch.Tensor, eps: float, *extra) -> torch.Tensor:
    """A contiguous [..., dim] output in x's dtype from one program per row of x (read in place, `_rows`)."""
    rows, stride_t, stride_h, heads = _rows(x)
    dim = x.shape[-1]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if out.numel():
        kernel[(out.numel() // dim,)](rows, out, stride_t, stride_h, heads, dim, eps, *extra,
                                      BLOCK=triton.next_power_of_2(dim))
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Zero-centred RMSNorm over the last dim: x [..., dim], weight [dim] -> contiguous [..., dim] in x's dtype."""
    return _launch(_rms_norm_kernel, x, eps, weight)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gated RMSNorm over the last dim: x, gate [..., dim] (same shape), weight [dim] -> contiguous [..., dim]."""
    if gate.shape != x.shape:
        raise ValueError(f"gated_rms_norm: gate {tuple(gate.shape)} and x {tuple(x.shape)} differ")
    gates, gate_stride_t, gate_stride_h, _ = _rows(gate)  # same shape, so the same row -> (t, h) split
    return _launch(_gated_rms_norm_kernel, x, eps, gates, gate_stride_t, gate_stride_h, weight)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim: x [..., dim] -> contiguous [..., dim] in x's dtype."""
    return _launch(_l2norm_kernel, x, eps)
