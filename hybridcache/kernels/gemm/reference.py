"""FP8 weight formats and their arithmetic in torch: the ground truth of the GEMM kernels and the CPU path.

Two formats, both float8_e4m3fn weights [N, K] (`nn.Linear` layout: y = x W^T, N outputs, K inputs):

- **block** (Qwen's "fine-grained FP8", DeepSeek-V3's recipe, `quant_method: fp8`): `weight_scale_inv`
  [ceil(N/bn), ceil(K/bk)] (bn = bk = 128), dequantised W[n, k] = weight[n, k] * scale_inv[n // bn, k // bk].
  Activations are quantised dynamically per token per bk channels (`quantize_groups`).
- **channel** (compressed-tensors FP8_DYNAMIC, `strategy: channel`): `weight_scale` [N, 1], W[n, k] =
  weight[n, k] * scale[n]. Activations are quantised dynamically per token (`quantize_rows`).

Scales are fp32 and chosen so that the largest |value| of a block (row) maps to e4m3's largest finite value, 448.
The CPU path (`dequantize` then `F.linear` in the activations' dtype) multiplies unquantised activations: it is
what transformers computes with `dequantize=True`; the GPU kernels quantise the activations too
(`emulate_block_linear` / `emulate_channel_linear` give their exact arithmetic in torch).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridcache.fp8_format import FP8_DTYPE, FP8_MAX, Fp8Format


def _expand_blocks(scale: torch.Tensor, shape: tuple[int, int], block: tuple[int, int]) -> torch.Tensor:
    """scale [ceil(N/bn), ceil(K/bk)] -> [N, K], each block's scale repeated over it (the last blocks cut)."""
    rows, cols = shape
    bn, bk = block
    return scale.repeat_interleave(bn, dim=0)[:rows].repeat_interleave(bk, dim=1)[:, :cols]


def dequantize(weight: torch.Tensor, scale: torch.Tensor, fmt: Fp8Format, dtype: torch.dtype) -> torch.Tensor:
    """weight [N, K] fp8, scale (see the module docstring) -> W [N, K] in `dtype` (products taken in fp32)."""
    w = weight.to(torch.float32)
    s = scale.to(torch.float32)
    if fmt.kind == "channel":
        return (w * s.reshape(-1, 1)).to(dtype)
    return (w * _expand_blocks(s, tuple(w.shape), fmt.block)).to(dtype)


def quantize(weight: torch.Tensor, fmt: Fp8Format) -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] (any float dtype) -> (weight [N, K] fp8, scale fp32 in `fmt`'s shape): each block (row) scaled so its
    largest |value| is 448 (an all-zero block gets scale 1), rounded to nearest."""
    w = weight.to(torch.float32)
    if fmt.kind == "channel":
        amax = w.abs().amax(dim=1, keepdim=True)
        scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
        return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale
    rows, cols = w.shape
    bn, bk = fmt.block
    grid_rows, grid_cols = fmt.scale_shape(rows, cols)
    if rows % bn == 0 and cols % bk == 0:  # whole blocks: the same numbers through a view, no padded copy
        blocks = w.view(grid_rows, bn, grid_cols, bk)
        amax = blocks.abs().amax(dim=(1, 3))
        scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
        q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        return q.view(rows, cols), scale
    padded = w.new_zeros(grid_rows * bn, grid_cols * bk)
    padded[:rows, :cols] = w
    amax = padded.view(grid_rows, bn, grid_cols, bk).abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (w / _expand_blocks(scale, (rows, cols), fmt.block)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def requantize_rows(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                    chunk: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacked block-scaled weights [E, N, K] fp8 with scales [E, ceil(N/bn), ceil(K/bk)] -> the same weights per
    channel: ([E, N, K] fp8, scale [E, N] fp32), each row dequantised in fp32 and quantised again as
    `quantize(row, channel)` (its largest |value| maps to 448). A change of numerics: the rows' small blocks lose
    the precision their own scales gave them. `chunk` experts at a time (the fp32 copy's memory; default: about
    256 MiB of it)."""
    experts, rows, cols = weight.shape
    bn, bk = block
    chunk = chunk or max(1, 2**28 // max(1, 4 * rows * cols))
    out = torch.empty_like(weight)
    row_scale = torch.empty((experts, rows), dtype=torch.float32, device=weight.device)
    for first in range(0, experts, chunk):
        part = slice(first, first + chunk)
        s = scale[part].float().repeat_interleave(bn, dim=1)[:, :rows].repeat_interleave(bk, dim=2)[:, :, :cols]
        w = weight[part].float() * s
        amax = w.abs().amax(dim=2, keepdim=True)
        s = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
        out[part] = (w / s).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        row_scale[part] = s[:, :, 0]
    return out, row_scale


def quantize_groups(x: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations x [M, K] -> (xq [M, K] fp8, scale [M, ceil(K/group)] fp32): dynamic per token per `group`
    channels (DeepSeek-V3). x = xq * scale up to fp8 rounding."""
    rows, cols = x.shape
    groups = -(-cols // group)
    padded = x.new_zeros(rows, groups * group, dtype=torch.float32)
    padded[:, :cols] = x
    amax = padded.view(rows, groups, group).abs().amax(dim=2).clamp(min=1e-12)
    scale = amax / FP8_MAX
    xq = (x.float() / scale.repeat_interleave(group, dim=1)[:, :cols]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return xq, scale


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations x [M, K] -> (xq [M, K] fp8, scale [M, 1] fp32): dynamic per token."""
    scale = x.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / FP8_MAX
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, fmt: Fp8Format,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """The CPU path: x [..., K] -> x W^T (+ bias) [..., N] in x's dtype, W dequantised to x's dtype."""
    return F.linear(x, dequantize(weight, scale, fmt, x.dtype), bias)


def emulate_block_linear(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                         block: tuple[int, int]) -> torch.Tensor:
    """What the block-scaled FP8 GEMM computes, in fp32: xq [M, K] fp8 with x_scale [M, ceil(K/bk)], weight [N, K]
    fp8 with scale_inv [ceil(N/bn), ceil(K/bk)] -> [M, N] fp32 = sum over K blocks b of
    (xq[:, b] @ weight[:, b]^T) * x_scale[:, b] * scale_inv[n // bn, b]."""
    bn, bk = block
    rows, cols = xq.shape
    out = torch.zeros(rows, weight.shape[0], dtype=torch.float32, device=xq.device)
    w_scale = scale_inv.float().repeat_interleave(bn, dim=0)[: weight.shape[0]]  # [N, ceil(K/bk)]
    for b in range(-(-cols // bk)):
        part = slice(b * bk, min((b + 1) * bk, cols))
        partial = xq[:, part].float() @ weight[:, part].float().T
        out += partial * x_scale[:, b : b + 1].float() * w_scale[:, b][None, :]
    return out


def emulate_channel_linear(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor,
                           scale: torch.Tensor) -> torch.Tensor:
    """What the per-channel FP8 GEMM computes, in fp32: (xq @ weight^T) * x_scale [M, 1] * scale [N, 1]^T."""
    return (xq.float() @ weight.float().T) * x_scale.float() * scale.float().reshape(1, -1)
