"""fla's inputs for a prefill step's gated delta rule in one launch (CUDA, Triton): q and k l2-normalised, v made
contiguous, from the conv output's head views.

The conv output is [T, C] with C = q | k | v; q, k, v are head views of it ([T, H, D] with row stride C). fla's
kernels take contiguous [T, H, D] tensors, and the rule wants q and k l2-normalised: before, two
`norm.triton.l2norm` launches and v's `.contiguous()` copy, per DeltaNet layer and prefill step. A short prefill
step is host-bound (each launch costs the H200 machines' hosts 30-50 us; next-1b runs 12 DeltaNet layers), so the
three are one launch here: a 1-D grid whose first programs normalise q's rows, the next k's, the last copy v's.

Same math and tiles as `norm.triton.l2norm` (y = x / sqrt(sum(x^2) + eps) in fp32, rounded once to the input's
dtype; 2,048 // width rows per program), so q and k are what it gives; v is copied bit for bit.
Worked example (next-1b: Hk = 16, Hv = 32, Dk = Dv = 128, T = 200): 16 rows of 128 per program, so q and k take
200 rows x 16 heads / 16 = 200 programs each and v 400: a grid of 800 programs, rows read in place from the
conv output (row stride 2 x 2048 + 4096 = 8192).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_ELEMENTS_PER_PROGRAM = 2048  # as norm/triton.py: rows per program = this // the padded row width


@triton.jit
def _l2norm_rows(x_ptr, out_ptr, program, num_rows, stride_t, stride_h, heads, dim, eps, ROWS: tl.constexpr,
                 BLOCK: tl.constexpr):
    """Program `program`'s ROWS rows of a [T, heads, dim] view, l2-normalised into contiguous rows of out."""
    rows = program.to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    ok = (rows < num_rows)[:, None] & (cols < dim)[None, :]
    starts = (rows // heads) * stride_t + (rows % heads) * stride_h
    x = tl.load(x_ptr + starts[:, None] + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) + eps)
    tl.store(out_ptr + rows[:, None] * dim + cols[None, :], (x * rstd[:, None]).to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit(do_not_specialize=["num_tokens"])
def _qkv_prep_kernel(q_ptr, k_ptr, v_ptr, qo_ptr, ko_ptr, vo_ptr, num_tokens, q_stride_t, q_stride_h, k_stride_t,
                     k_stride_h, v_stride_t, v_stride_h, heads_k, heads_v, dim_k, dim_v, eps,
                     ROWS_K: tl.constexpr, BLOCK_K: tl.constexpr, ROWS_V: tl.constexpr, BLOCK_V: tl.constexpr):
    pid = tl.program_id(0)
    rows_k = num_tokens * heads_k
    qk_programs = tl.cdiv(rows_k, ROWS_K)  # programs of q, and as many of k
    if pid < qk_programs:
        _l2norm_rows(q_ptr, qo_ptr, pid, rows_k, q_stride_t, q_stride_h, heads_k, dim_k, eps, ROWS_K, BLOCK_K)
    elif pid < 2 * qk_programs:
        _l2norm_rows(k_ptr, ko_ptr, pid - qk_programs, rows_k, k_stride_t, k_stride_h, heads_k, dim_k, eps, ROWS_K,
                     BLOCK_K)
    else:
        rows = (pid - 2 * qk_programs).to(tl.int64) * ROWS_V + tl.arange(0, ROWS_V)
        cols = tl.arange(0, BLOCK_V)
        ok = (rows < num_tokens * heads_v)[:, None] & (cols < dim_v)[None, :]
        starts = (rows // heads_v) * v_stride_t + (rows % heads_v) * v_stride_h
        values = tl.load(v_ptr + starts[:, None] + cols[None, :], mask=ok, other=0.0)
        tl.store(vo_ptr + rows[:, None] * dim_v + cols[None, :], values, mask=ok)


def _rows_per_program(dim: int) -> tuple[int, int]:
    """(rows per program, padded width) for rows of `dim` columns."""
    block = triton.next_power_of_2(dim)
    return max(1, _ELEMENTS_PER_PROGRAM // block), block


def qkv_prep(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, eps: float = 1e-6
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k [T, Hk, Dk] and v [T, Hv, Dv] (views with unit stride on the last dim, e.g. of the conv output; one
    dtype) -> (l2norm(q), l2norm(k), v), each a new contiguous tensor in that dtype, in one launch."""
    if q.dim() != 3 or k.shape != q.shape or v.dim() != 3 or v.shape[0] != q.shape[0]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must be [T, Hk, Dk] and v {tuple(v.shape)} "
                         "[T, Hv, Dv] with the same T")
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if any(t.stride(-1) != 1 for t in (q, k, v)):
        raise ValueError("q, k and v need unit stride on their last dim")
    num_tokens, heads_k, dim_k = q.shape
    _, heads_v, dim_v = v.shape
    outs = tuple(torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
    if num_tokens == 0:
        return outs
    rows_k, block_k = _rows_per_program(dim_k)
    rows_v, block_v = _rows_per_program(dim_v)
    programs = 2 * triton.cdiv(num_tokens * heads_k, rows_k) + triton.cdiv(num_tokens * heads_v, rows_v)
    _qkv_prep_kernel[(programs,)](
        q, k, v, *outs, num_tokens, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        heads_k, heads_v, dim_k, dim_v, eps, ROWS_K=rows_k, BLOCK_K=block_k, ROWS_V=rows_v, BLOCK_V=block_v,
    )
    return outs
