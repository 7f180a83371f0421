"""Dynamic FP8 quantisation of activations per token per group of channels in one Triton launch: what
`reference.quantize_groups` computes in torch (a pad, an amax, two divisions and a cast: about ten launches).

Program (m, c) takes row m's groups [c * CHUNK, (c + 1) * CHUNK) as a [CHUNK, GROUP] tile: per group
amax = max(max |x|, 1e-12), scale = amax / 448, q = clamp(x / scale, -448, 448) rounded to e4m3 (IEEE division,
as torch's), so the result equals `quantize_groups`' bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridcache.fp8_format import FP8_DTYPE, FP8_MAX


@triton.jit
def _quantize_groups_kernel(x_ptr, q_ptr, s_ptr, K, num_groups, stride_x, stride_q, stride_s,
                            GROUP: tl.constexpr, CHUNK: tl.constexpr, QMAX: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    groups = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
    ks = groups[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    ok = (groups[:, None] < num_groups) & (ks < K)
    x = tl.load(x_ptr + row * stride_x + ks, mask=ok, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-12) / QMAX
    q = tl.clamp(tl.math.div_rn(x, scale[:, None]), -QMAX, QMAX)
    tl.store(q_ptr + row * stride_q + ks, q.to(q_ptr.dtype.element_ty), mask=ok)
    tl.store(s_ptr + row * stride_s + groups, scale, mask=groups < num_groups)


def quantize_groups(x: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (unit stride on K) -> (xq [M, K] float8_e4m3fn, scale [M, ceil(K/group)] fp32), equal to
    `reference.quantize_groups(x, group)`. `group` a power of two >= 16."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"quantize_groups: x [M, K] with unit stride on K needed, got {list(x.shape)}")
    if group < 16 or group & (group - 1):
        raise ValueError(f"quantize_groups: the group {group} must be a power of two >= 16")
    rows, cols = x.shape
    num_groups = -(-cols // group)
    xq = torch.empty((rows, cols), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((rows, num_groups), dtype=torch.float32, device=x.device)
    if rows and cols:
        chunk = min(triton.next_power_of_2(num_groups), max(1, 2048 // group))
        _quantize_groups_kernel[(rows, triton.cdiv(num_groups, chunk))](
            x, xq, scale, cols, num_groups, x.stride(0), xq.stride(0), scale.stride(0),
            GROUP=group, CHUNK=chunk, QMAX=FP8_MAX,
        )
    return xq, scale
