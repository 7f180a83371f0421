"""The feed-forward blocks' element-wise tails on CUDA (Triton): one launch each instead of torch's two and three.
Same math and the same roundings as `activation/reference.py`: each torch op's result is rounded to the output
dtype where torch rounds it (no-ops in fp32), the arithmetic in between is fp32.

- `silu_mul(gate, up)`:                      s = round(g * sigmoid(g));  out = round(s * up)   (up may be fp32:
                                             Mamba2's ungated y * silu(z))
- `sigmoid_gate_add(routed, gate, shared)`:  w = round(sigmoid(gate));   p = round(w * shared);  out = round(routed + p)
- `sigmoid_mul(x, gate)` (the gated attention's output gate, per head):  w = round(sigmoid(gate));  out = round(x * w)
- `relu_square(x)` (the ungated relu^2 MLP):   out = round(max(x, 0)^2)  (bit-identical to torch's square of relu)

Inputs are read in place when their columns are contiguous: gate and up are column views of one fused
projection's output (`layers/fused.py`), so their rows sit `row_stride` elements apart; the [N, 1] gate of
`sigmoid_gate_add` is a column of the router's fused output. Outputs are new contiguous tensors. One program
per (row, BLOCK columns) (`sigmoid_mul`: per token, all its heads: the gate is a head view [T, H, D] of the
query projection, strided over tokens and heads); the row count is the grid, never a kernel argument, and the
widths and strides are fixed by the model, so nothing compiles after the engine's warm-up.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridcache.kernels import pdl

_MAX_BLOCK = 1024  # columns per program


@triton.jit
def _silu_mul_kernel(gate_ptr, up_ptr, out_ptr, width, gate_stride, up_stride, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl.start(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < width
    g = tl.load(gate_ptr + row * gate_stride + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + row * up_stride + cols, mask=ok, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    s = (g * tl.sigmoid(g)).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * width + cols, (s * u).to(dtype), mask=ok)


@triton.jit
def _sigmoid_gate_add_kernel(routed_ptr, gate_ptr, shared_ptr, out_ptr, width, routed_stride, gate_stride,
                             shared_stride, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl.start(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < width
    dtype = out_ptr.dtype.element_ty
    w = tl.sigmoid(tl.load(gate_ptr + row * gate_stride).to(tl.float32)).to(dtype).to(tl.float32)
    s = tl.load(shared_ptr + row * shared_stride + cols, mask=ok, other=0.0).to(tl.float32)
    r = tl.load(routed_ptr + row * routed_stride + cols, mask=ok, other=0.0).to(tl.float32)
    p = (w * s).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * width + cols, (r + p).to(dtype), mask=ok)


@triton.jit
def _sigmoid_mul_kernel(x_ptr, gate_ptr, out_ptr, num_heads, dim, stride_xt, stride_xh, stride_gt, stride_gh,
                        BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    pdl.start(PDL)
    token = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)
    chans = tl.arange(0, BLOCK_D)
    ok = (heads < num_heads)[:, None] & (chans < dim)[None, :]
    x = tl.load(x_ptr + token * stride_xt + heads[:, None] * stride_xh + chans[None, :], mask=ok, other=0.0)
    g = tl.load(gate_ptr + token * stride_gt + heads[:, None] * stride_gh + chans[None, :], mask=ok, other=0.0)
    dtype = out_ptr.dtype.element_ty
    w = tl.sigmoid(g.to(tl.float32)).to(dtype).to(tl.float32)
    dest = out_ptr + token * num_heads * dim + heads[:, None] * dim + chans[None, :]
    tl.store(dest, (x.to(tl.float32) * w).to(dtype), mask=ok)


@triton.jit
def _relu_square_kernel(x_ptr, out_ptr, width, x_stride, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl.start(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < width
    x = tl.maximum(tl.load(x_ptr + row * x_stride + cols, mask=ok, other=0.0).to(tl.float32), 0.0)
    tl.store(out_ptr + row * width + cols, (x * x).to(out_ptr.dtype.element_ty), mask=ok)


def _rows(x: torch.Tensor, name: str, shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """x as a 2-D [N, W] tensor with unit-stride columns (copied only when its columns are strided)."""
    if x.dim() != 2 or tuple(x.shape) != shape or x.dtype != dtype:
        raise ValueError(f"{name} must be {list(shape)} in {dtype}, got {list(x.shape)} in {x.dtype}")
    return x if x.stride(1) == 1 or x.shape[1] == 1 else x.contiguous()


def _grid(num_rows: int, width: int) -> tuple[tuple[int, int], int]:
    block = min(_MAX_BLOCK, triton.next_power_of_2(max(width, 1)))
    return (num_rows, triton.cdiv(width, block)), block


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up [N, I] of one dtype (or up in float32) -> silu(gate) * up, contiguous [N, I] in gate's dtype (module
    docstring)."""
    up = _rows(up, "up", tuple(gate.shape), torch.float32 if up.dtype == torch.float32 else gate.dtype)
    gate = _rows(gate, "gate", tuple(gate.shape), gate.dtype)
    num_rows, width = gate.shape
    out = torch.empty((num_rows, width), dtype=gate.dtype, device=gate.device)
    if num_rows and width:
        grid, block = _grid(num_rows, width)
        _silu_mul_kernel[grid](gate, up, out, width, gate.stride(0), up.stride(0), BLOCK=block, **pdl.options(out))
    return out


def sigmoid_gate_add(routed: torch.Tensor, gate: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
    """routed, shared [N, H], gate [N, 1] of one dtype -> routed + sigmoid(gate) * shared, contiguous [N, H]."""
    num_rows, width = routed.shape
    routed = _rows(routed, "routed", (num_rows, width), routed.dtype)
    shared = _rows(shared, "shared", (num_rows, width), routed.dtype)
    gate = _rows(gate, "gate", (num_rows, 1), routed.dtype)
    out = torch.empty((num_rows, width), dtype=routed.dtype, device=routed.device)
    if num_rows and width:
        grid, block = _grid(num_rows, width)
        _sigmoid_gate_add_kernel[grid](routed, gate, shared, out, width, routed.stride(0), gate.stride(0),
                                       shared.stride(0), BLOCK=block, **pdl.options(out))
    return out


def relu_square(x: torch.Tensor) -> torch.Tensor:
    """x [N, I] -> relu(x)^2, contiguous [N, I] in x's dtype (module docstring)."""
    if x.dim() != 2:
        raise ValueError(f"relu_square: x must be [N, I], got {list(x.shape)}")
    x = _rows(x, "x", tuple(x.shape), x.dtype)
    num_rows, width = x.shape
    out = torch.empty((num_rows, width), dtype=x.dtype, device=x.device)
    if num_rows and width:
        grid, block = _grid(num_rows, width)
        _relu_square_kernel[grid](x, out, width, x.stride(0), BLOCK=block, **pdl.options(out))
    return out


def sigmoid_mul(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x, gate [T, H, D] of one dtype (views strided over tokens and heads allowed) -> x * sigmoid(gate),
    contiguous [T, H, D] (module docstring)."""
    if x.dim() != 3 or gate.shape != x.shape or gate.dtype != x.dtype:
        raise ValueError(f"sigmoid_mul: x {list(x.shape)} {x.dtype} and gate {list(gate.shape)} {gate.dtype} must be "
                         "[T, H, D] of one shape and dtype")
    if x.stride(-1) != 1:
        x = x.contiguous()
    if gate.stride(-1) != 1:
        gate = gate.contiguous()
    num_tokens, num_heads, dim = x.shape
    out = torch.empty((num_tokens, num_heads, dim), dtype=x.dtype, device=x.device)
    if out.numel():
        block_h, block_d = triton.next_power_of_2(num_heads), triton.next_power_of_2(dim)
        # a token's heads in one program: a warp per 256 elements, up to 16 (as the one-row norms, `norm/triton.py`)
        _sigmoid_mul_kernel[(num_tokens,)](x, gate, out, num_heads, dim, x.stride(0), x.stride(1), gate.stride(0),
                                           gate.stride(1), BLOCK_H=block_h, BLOCK_D=block_d,
                                           num_warps=max(4, min(16, block_h * block_d // 256)), **pdl.options(out))
    return out
