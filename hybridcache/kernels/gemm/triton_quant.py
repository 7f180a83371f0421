"""Dynamic FP8 quantisation of activations per token per group of channels in one Triton launch: what
`reference.quantize_groups` computes in torch (a pad, an amax, two divisions and a cast: about ten launches), and
per token (`quantize_rows`: one group of the whole row, what `reference.quantize_rows` computes).

Program (m, c) takes row m's groups [c * CHUNK, (c + 1) * CHUNK) as a [CHUNK, GROUP] tile: per group
amax = max(max |x|, 1e-12), scale = amax / 448, q = clamp(x / scale, -448, 448) rounded to e4m3 (IEEE division,
as torch's), so the result equals `quantize_groups`' bit for bit. Rows past M (`pad_rows`) are written as zeros.
The experts' activation fused with a per-row quantisation: `swiglu_quantize_rows`, `relu2_quantize_rows`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridcache.fp8_format import FP8_DTYPE, FP8_MAX
from hybridcache.kernels.moe.triton_experts import relu_squared


# The row count M and the scale's group stride (the padded row count in cuBLAS's column-major layout) vary with
# every step's token count: not specialised (== 1, % 16), so the variants start-up compiles are all there are.
@triton.jit(do_not_specialize=["M", "stride_sg"])
def _quantize_groups_kernel(x_ptr, q_ptr, s_ptr, M, K, num_groups, stride_x, stride_q, stride_sm, stride_sg,
                            GROUP: tl.constexpr, CHUNK: tl.constexpr, QMAX: tl.constexpr):
    quantize_tile(x_ptr, q_ptr, s_ptr, tl.program_id(0).to(tl.int64), tl.program_id(1), M, K, num_groups, stride_x,
                  stride_q, stride_sm, stride_sg, GROUP, CHUNK, QMAX)


@triton.jit
def quantize_tile(x_ptr, q_ptr, s_ptr, row, chunk, M, K, num_groups, stride_x, stride_q, stride_sm, stride_sg,
                  GROUP: tl.constexpr, CHUNK: tl.constexpr, QMAX: tl.constexpr):
    """Row `row`'s groups [chunk * CHUNK, ...) of `quantize_groups` in the calling program (row >= M: a padding
    row of zeros)."""
    groups = chunk * CHUNK + tl.arange(0, CHUNK)
    ks = groups[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    ok = (groups[:, None] < num_groups) & (ks < K)
    x = tl.load(x_ptr + tl.minimum(row, M - 1) * stride_x + ks, mask=ok, other=0.0).to(tl.float32)
    x = tl.where(row < M, x, 0.0)  # a padding row
    scale = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-12) / QMAX
    q = tl.clamp(tl.math.div_rn(x, scale[:, None]), -QMAX, QMAX)
    tl.store(q_ptr + row * stride_q + ks, q.to(q_ptr.dtype.element_ty), mask=ok)
    tl.store(s_ptr + row * stride_sm + groups * stride_sg, scale, mask=groups < num_groups)


def quantize_groups(x: torch.Tensor, group: int = 128, *, pad_rows: int = 1,
                    column_major: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (unit stride on K) -> (xq [M', K] float8_e4m3fn, scale [M', ceil(K/group)] fp32), rows
    [0, M) equal to `reference.quantize_groups(x, group)`; M' is M rounded up to a multiple of `pad_rows`, the
    rows past M zeros (scale 1e-12 / 448). `column_major`: the scale's storage is [groups, M'] (stride (1, M'),
    cuBLAS's layout for 1 x 128 block scales). `group` a power of two >= 16."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"quantize_groups: x [M, K] with unit stride on K needed, got {list(x.shape)}")
    if group < 16 or group & (group - 1):
        raise ValueError(f"quantize_groups: the group {group} must be a power of two >= 16")
    rows, cols = x.shape
    padded = -(-rows // pad_rows) * pad_rows
    num_groups = -(-cols // group)
    xq = torch.empty((padded, cols), dtype=FP8_DTYPE, device=x.device)
    if column_major:
        scale = torch.empty((num_groups, padded), dtype=torch.float32, device=x.device).t()
    else:
        scale = torch.empty((padded, num_groups), dtype=torch.float32, device=x.device)
    if padded and cols:
        chunk = min(triton.next_power_of_2(num_groups), max(1, 2048 // group))
        _quantize_groups_kernel[(padded, triton.cdiv(num_groups, chunk))](
            x, xq, scale, rows, cols, num_groups, x.stride(0), xq.stride(0), scale.stride(0), scale.stride(1),
            GROUP=group, CHUNK=chunk, QMAX=FP8_MAX,
        )
    return xq, scale


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (unit stride on K) -> (xq [M, K] float8_e4m3fn, scale [M, 1] fp32) equal to
    `reference.quantize_rows(x)` (dynamic per token) in one launch: `quantize_groups` with one group of the whole
    row (K rounded up to a power of two, the channels past K masked)."""
    if x.dim() != 2:
        raise ValueError(f"quantize_rows: x [M, K] needed, got {list(x.shape)}")
    return quantize_groups(x, max(16, triton.next_power_of_2(x.shape[1])))


@triton.jit(do_not_specialize=["M"])
def _activation_quantize_rows_kernel(h_ptr, q_ptr, s_ptr, M, N, stride_h, stride_q, BLOCK: tl.constexpr,
                                     QMAX: tl.constexpr, RELU2: tl.constexpr = False):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < N
    if RELU2:  # ungated experts: h is the up projection alone
        up = tl.load(h_ptr + row * stride_h + cols, mask=ok, other=0.0).to(tl.float32)
        a = relu_squared(up)
    else:
        gate = tl.load(h_ptr + row * stride_h + cols, mask=ok, other=0.0).to(tl.float32)
        up = tl.load(h_ptr + row * stride_h + N + cols, mask=ok, other=0.0).to(tl.float32)
        a = gate * tl.sigmoid(gate) * up
    scale = tl.maximum(tl.max(tl.abs(a), axis=0), 1e-12) / QMAX
    q = tl.clamp(tl.math.div_rn(a, scale), -QMAX, QMAX)
    tl.store(q_ptr + row * stride_q + cols, q.to(q_ptr.dtype.element_ty), mask=ok)
    tl.store(s_ptr + row, scale)


def swiglu_quantize_rows(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """h [M, 2N] (gate columns [0, N), up columns [N, 2N); unit stride on them) -> (aq [M, N] float8_e4m3fn,
    scale [M] fp32): a = silu(gate) * up in fp32, quantised per row as `reference.quantize_rows(a)` (the per-row
    FP8 experts' SwiGLU and their down GEMM's activation quantisation in one launch, `triton_fp8_moe`)."""
    if h.dim() != 2 or h.stride(1) != 1 or h.shape[1] % 2:
        raise ValueError(f"swiglu_quantize_rows: h [M, 2N] with unit stride needed, got {list(h.shape)}")
    return _activation_quantize_rows(h, h.shape[1] // 2, relu2=False)


def relu2_quantize_rows(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """h [M, N] (an ungated expert's up projection; unit stride on N) -> (aq [M, N] float8_e4m3fn, scale [M] fp32):
    a = relu(h)^2 in fp32, quantised per row as `reference.quantize_rows(a)` (`swiglu_quantize_rows` for "relu2"
    experts, the same kernel)."""
    if h.dim() != 2 or h.stride(1) != 1:
        raise ValueError(f"relu2_quantize_rows: h [M, N] with unit stride needed, got {list(h.shape)}")
    return _activation_quantize_rows(h, h.shape[1], relu2=True)


def _activation_quantize_rows(h: torch.Tensor, n: int, relu2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    rows = h.shape[0]
    q = torch.empty((rows, n), dtype=FP8_DTYPE, device=h.device)
    scale = torch.empty((rows,), dtype=torch.float32, device=h.device)
    if rows and n:
        block = triton.next_power_of_2(n)
        _activation_quantize_rows_kernel[(rows,)](h, q, scale, rows, n, h.stride(0), q.stride(0), BLOCK=block,
                                                  QMAX=FP8_MAX, RELU2=relu2, num_warps=4 if block <= 2048 else 8)
    return q, scale


@triton.jit(do_not_specialize=["M"])
def _quantize_rows_scatter_kernel(x_ptr, rows_ptr, q_ptr, s_ptr, M, K, stride_x, stride_q, TOP_K: tl.constexpr,
                                  BLOCK: tl.constexpr, QMAX: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < K
    x = tl.load(x_ptr + token * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=0), 1e-12) / QMAX
    q = tl.clamp(tl.math.div_rn(x, scale), -QMAX, QMAX).to(q_ptr.dtype.element_ty)
    for pick in tl.static_range(TOP_K):
        row = tl.load(rows_ptr + token * TOP_K + pick).to(tl.int64)
        tl.store(q_ptr + row * stride_q + cols, q, mask=ok)
        tl.store(s_ptr + row, scale)


def quantize_rows_scatter(x: torch.Tensor, rows: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] (unit stride on K), rows [T * top_k] (a permutation: row rows[t * top_k + j] is token t's pick j,
    `moe.grouped.pair_rows` of a sort) -> (xq [T * top_k, K] float8_e4m3fn, scale [T * top_k] fp32): each token
    quantised per row as `quantize_rows` and written to each of its rows, in one launch; equal to
    `quantize_rows(x)` followed by `index_select(0, order // top_k)` of both (`rows = pair_rows(order)`), with one
    read of x instead of a gather of top_k copies (the row-wise experts' prefill, `triton_fp8_moe`)."""
    if x.dim() != 2 or x.stride(1) != 1 or rows.shape != (x.shape[0] * top_k,):
        raise ValueError(f"quantize_rows_scatter: x [T, K] with unit stride and rows [T * {top_k}] needed, got "
                         f"{list(x.shape)} and {list(rows.shape)}")
    tokens, cols = x.shape
    q = torch.empty((tokens * top_k, cols), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((tokens * top_k,), dtype=torch.float32, device=x.device)
    if tokens and cols:
        block = max(16, triton.next_power_of_2(cols))
        _quantize_rows_scatter_kernel[(tokens,)](x, rows, q, scale, tokens, cols, x.stride(0), q.stride(0),
                                                 TOP_K=top_k, BLOCK=block, QMAX=FP8_MAX,
                                                 num_warps=4 if block <= 2048 else 8)
    return q, scale
