"""Mamba2's decode step on CUDA (Triton): one token of every sequence through the SSD recurrence, each state row
updated in place in the pool, in one launch (`reference.ssd_step`'s math, with `reference.discretized_dt`'s).

The torch step (`fla.ssd_decode`) discretizes dt and makes A in about seven small launches, gathers the rows
(`index_select`), zeroes the fresh ones, computes decay * S + dt x B^T and S C in fp32 over whole [M, H, P, N]
tensors, then scatters them back: about fifteen state-sized reads and writes where the step needs two.
Here a program owns BLOCK_P rows of one head's [P, N] state of one sequence::

    grid (M sequences, H heads, cdiv(P, BLOCK_P))          head h reads B and C of its group g = h // (H / G)
    dt = clamp(softplus(dt_raw[h] + dt_bias[h]), dt_limit);  A = -exp(A_log[h])   fp32, as `discretized_dt`
    S = 0 if context_len == 1 (fresh) else pool[slot, h, p-block, :]             fp32 in registers
    S = exp(dt * A) * S + (dt * x[p-block])[:, None] * B[g][None, :]
    y[p-block] = S @ C[g] + D[h] * x[p-block]                                    fp32 out
    pool[slot, h, p-block, :] = S                                                 rounded to the pool's dtype

softplus is torch's (the gated delta rule's gate kernel's, `gated_delta/triton_gates.softplus`). Slots must be
distinct (each program reads and writes only its own rows).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridcache.kernels import pdl
from hybridcache.kernels.gated_delta.triton_gates import softplus

_BLOCK_P = 16  # state rows a program (a [16, 128] fp32 tile: 8 KB of registers over 4 warps)


@triton.jit
def _ssd_step_kernel(x_ptr, dt_ptr, dt_bias_ptr, alog_ptr, b_ptr, c_ptr, d_ptr, pool_ptr, slots_ptr, ctx_ptr, out_ptr,
                     stride_xm, stride_xh, stride_dtm, stride_bm, stride_bg, stride_cm, stride_cg,
                     stride_ps, stride_ph, stride_pp, stride_om, stride_oh, head_dim, state_size, dt_low, dt_high,
                     HEADS_PER_GROUP: tl.constexpr, CLAMP: tl.constexpr, BLOCK_P: tl.constexpr,
                     BLOCK_N: tl.constexpr, PDL: tl.constexpr):
    pdl.start(PDL)
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    group = head // HEADS_PER_GROUP
    ps = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    ns = tl.arange(0, BLOCK_N)
    p_ok = ps < head_dim
    n_ok = ns < state_size
    ok = p_ok[:, None] & n_ok[None, :]
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    fresh = tl.load(ctx_ptr + seq) == 1  # a fresh sequence (context_len 1) starts from zeros, whatever its row holds
    dt = softplus(tl.load(dt_ptr + seq * stride_dtm + head).to(tl.float32)
                  + tl.load(dt_bias_ptr + head).to(tl.float32))
    if CLAMP:
        dt = tl.minimum(tl.maximum(dt, dt_low), dt_high)
    decay = tl.exp(dt * -tl.exp(tl.load(alog_ptr + head).to(tl.float32)))
    rows = pool_ptr + slot * stride_ps + head * stride_ph + ps[:, None] * stride_pp + ns[None, :]
    state = tl.where(fresh, 0.0, tl.load(rows, mask=ok, other=0.0).to(tl.float32))
    x = tl.load(x_ptr + seq * stride_xm + head * stride_xh + ps, mask=p_ok, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + seq * stride_bm + group * stride_bg + ns, mask=n_ok, other=0.0).to(tl.float32)
    c = tl.load(c_ptr + seq * stride_cm + group * stride_cg + ns, mask=n_ok, other=0.0).to(tl.float32)
    state = state * decay + (x * dt)[:, None] * b[None, :]
    y = tl.sum(state * c[None, :], axis=1) + x * tl.load(d_ptr + head).to(tl.float32)
    tl.store(rows, state.to(pool_ptr.dtype.element_ty), mask=ok)
    tl.store(out_ptr + seq * stride_om + head * stride_oh + ps, y, mask=p_ok)


def ssd_step_update(x: torch.Tensor, dt: torch.Tensor, dt_bias: torch.Tensor, A_log: torch.Tensor,  # noqa: N803
                    B: torch.Tensor, C: torch.Tensor, D: torch.Tensor, ssm_pool: torch.Tensor,  # noqa: N803
                    state_slots: torch.Tensor, context_lens: torch.Tensor, *, dt_limit: tuple[float, float],
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, H, P]; dt [M, H] in_proj's raw output (any row stride); dt_bias, A_log, D [H]; B, C [M, G, N];
    ssm_pool [slots, H, P, N]; state_slots, context_lens [M] -> y [M, H, P] fp32 (written into `out` when given),
    the M state rows updated in place (module docstring). x, B, C, the pool and `out` need unit stride over their
    last dim."""
    num, heads, head_dim = x.shape
    groups, state_size = B.shape[1], B.shape[2]
    if (heads % groups or C.shape != B.shape or tuple(dt.shape) != (num, heads) or ssm_pool.shape[1:] != (
            heads, head_dim, state_size) or ssm_pool.stride(-1) != 1 or x.stride(-1) != 1 or B.stride(-1) != 1
            or C.stride(-1) != 1 or dt.stride(-1) != 1):
        raise ValueError(f"ssd_step_update: x {list(x.shape)}, dt {list(dt.shape)}, B {list(B.shape)}, C "
                         f"{list(C.shape)}, pool {list(ssm_pool.shape)} (unit stride over the last dim needed)")
    if out is None:
        out = torch.empty((num, heads, head_dim), dtype=torch.float32, device=x.device)
    elif out.dtype != torch.float32 or out.shape != x.shape or out.stride(-1) != 1:
        raise ValueError(f"ssd_step_update: out must be fp32 {list(x.shape)} with unit stride over P")
    low, high = dt_limit
    if num:
        _ssd_step_kernel[(num, heads, triton.cdiv(head_dim, _BLOCK_P))](
            x, dt, dt_bias, A_log, B, C, D, ssm_pool, state_slots, context_lens, out,
            x.stride(0), x.stride(1), dt.stride(0), B.stride(0), B.stride(1), C.stride(0), C.stride(1),
            ssm_pool.stride(0), ssm_pool.stride(1), ssm_pool.stride(2), out.stride(0), out.stride(1), head_dim,
            state_size, float(low), float(high),
            HEADS_PER_GROUP=heads // groups, CLAMP=low > 0.0 or high != float("inf"), BLOCK_P=_BLOCK_P,
            BLOCK_N=triton.next_power_of_2(state_size), **pdl.options(x))
    return out
