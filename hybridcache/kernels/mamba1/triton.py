"""Mamba1's selective scan on CUDA (Triton) over a whole varlen batch: prefill chunks, decode rows and mixed steps in
one launch, the state rows read from and written to the pool by slot (the math of `reference.py`).

One program per (sequence, block of BLOCK_D channels) walks its sequence's tokens in order, keeping the state tile
[BLOCK_D, N] in registers (fp32) from the slot's row (zeros for a fresh sequence, context_len == query_len, whatever
the row holds: its load is masked off) to the write-back after its last token. Per token it reads x, dt, z
[BLOCK_D] and B, C [N], and writes y [BLOCK_D]:

    dt = softplus(dt_raw + dt_bias)          (torch's: dt itself above 20)
    S  = exp(dt[:, None] * A) * S + (dt * x)[:, None] * B[None, :]          A = -exp(A_log) [BLOCK_D, N]
    y  = (S @ C + D * x) * silu(z)

The recurrence is serial in the tokens (no scalar decay per head, so no chunked matmul form as Mamba2's SSD); the
parallelism is the sequences times the channel blocks (a 4,096-token prompt of Jamba-v0.1, I = 8,192: 128 programs
of 4,096 steps). Every length, freshness and slot is read on the device (cu_seqlens, context_lens, state_slots), the
grid is (sequences, I / BLOCK_D) from the host's sequence count alone, and rows past cu_seqlens[-1] are left
unwritten: a decode graph captures it, and a whole-step graph (`prefill_graphs.SequenceGraphs`) runs a one-sequence
step on a bucket of rows. Launched plainly (no PDL).

Precision: fp32 throughout from the inputs' dtype; against `reference.selective_scan` in fp32 the interpreter agrees
to fp32 rounding (tests/kernels/test_mamba1_cuda.py). Not yet run on a GPU: the block size is a guess, not a
measurement.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK_D = 64  # channels per program (unmeasured: see the module docstring)
_WARPS = 2


@triton.jit
def _selective_scan_kernel(
    x_ptr, dt_ptr, b_ptr, c_ptr, z_ptr, a_log_ptr, dt_bias_ptr, d_ptr, out_ptr, pool_ptr, slots_ptr, cu_ptr,
    ctx_ptr, stride_xt, stride_dtt, stride_bt, stride_ct, stride_zt, stride_ot, stride_ps, stride_pd,
    num_channels, state_size,
    HAS_Z: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    chans = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    entries = tl.arange(0, BLOCK_N)
    chan_ok, entry_ok = chans < num_channels, entries < state_size
    tile_ok = chan_ok[:, None] & entry_ok[None, :]
    bos = tl.load(cu_ptr + seq).to(tl.int64)
    eos = tl.load(cu_ptr + seq + 1).to(tl.int64)
    # the state entries to read: none for a fresh sequence, whose row is masked off rather than multiplied by 0 (it
    # may hold a NaN or inf a former occupant left, and 0 * NaN is NaN)
    entries_to_read = state_size * (tl.load(ctx_ptr + seq).to(tl.int64) != eos - bos).to(tl.int32)
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    state_ptrs = pool_ptr + slot * stride_ps + chans[:, None] * stride_pd + entries[None, :]
    state = tl.load(state_ptrs, mask=chan_ok[:, None] & (entries < entries_to_read)[None, :], other=0.0)
    state = state.to(tl.float32)
    a = -tl.exp(tl.load(a_log_ptr + chans[:, None] * state_size + entries[None, :], mask=tile_ok,
                        other=0.0).to(tl.float32))
    dt_bias = tl.load(dt_bias_ptr + chans, mask=chan_ok, other=0.0).to(tl.float32)
    skip = tl.load(d_ptr + chans, mask=chan_ok, other=0.0).to(tl.float32)
    for t in range(bos, eos):
        x = tl.load(x_ptr + t * stride_xt + chans, mask=chan_ok, other=0.0).to(tl.float32)
        dt = tl.load(dt_ptr + t * stride_dtt + chans, mask=chan_ok, other=0.0).to(tl.float32) + dt_bias
        dt = tl.where(dt > 20.0, dt, tl.log(1.0 + tl.exp(tl.minimum(dt, 20.0))))
        b = tl.load(b_ptr + t * stride_bt + entries, mask=entry_ok, other=0.0).to(tl.float32)
        c = tl.load(c_ptr + t * stride_ct + entries, mask=entry_ok, other=0.0).to(tl.float32)
        state = tl.exp(dt[:, None] * a) * state + (dt * x)[:, None] * b[None, :]
        y = tl.sum(state * c[None, :], axis=1) + skip * x
        if HAS_Z:
            z = tl.load(z_ptr + t * stride_zt + chans, mask=chan_ok, other=0.0).to(tl.float32)
            y = y * z * tl.sigmoid(z)
        tl.store(out_ptr + t * stride_ot + chans, y, mask=chan_ok)
    tl.store(state_ptrs, state.to(pool_ptr.dtype.element_ty), mask=tile_ok)


def selective_scan_varlen(
    x: torch.Tensor,
    dt: torch.Tensor,
    B: torch.Tensor,  # noqa: N803 (Mamba's names)
    C: torch.Tensor,  # noqa: N803
    A_log: torch.Tensor,  # noqa: N803
    dt_bias: torch.Tensor,
    D: torch.Tensor,  # noqa: N803
    z: torch.Tensor | None,
    ssm_pool: torch.Tensor,
    state_slots: torch.Tensor,
    cu_seqlens: torch.Tensor,
    context_lens: torch.Tensor,
) -> torch.Tensor:
    """The scan over every sequence of the batch (module docstring); `KernelBackend.selective_scan`'s contract.

    x, dt    [T, I]  (dt raw: before dt_bias and softplus; rows with unit channel stride, any row stride)
    B, C     [T, N]
    z        [T, I] or None (the gate)
    A_log    [I, N];  dt_bias, D [I]
    ssm_pool [num_slots, I, N]: sequence i (rows cu_seqlens[i]:cu_seqlens[i+1]) starts from row state_slots[i]
             (zeros when context_lens[i] equals its length) and its final state is written back there, in the
             pool's dtype
    returns  y [T, I] fp32 (rows past cu_seqlens[-1] unwritten)
    """
    num_tokens, channels = x.shape
    state_size = B.shape[1]
    if ssm_pool.shape[1:] != (channels, state_size) or A_log.shape != (channels, state_size):
        raise ValueError(f"selective_scan: pool {tuple(ssm_pool.shape)} and A_log {tuple(A_log.shape)} must be "
                         f"[.., {channels}, {state_size}]")
    for name, t, width in (("x", x, channels), ("dt", dt, channels), ("B", B, state_size), ("C", C, state_size),
                           ("z", z, channels)):
        if t is not None and (t.dim() != 2 or t.shape != (num_tokens, width) or t.stride(1) != 1):
            raise ValueError(f"selective_scan: {name} {tuple(t.shape)} must be [{num_tokens}, {width}] with unit "
                             "channel stride")
    if ssm_pool.stride(2) != 1:
        raise ValueError("selective_scan: the pool's state entries must be contiguous")
    out = torch.empty(num_tokens, channels, dtype=torch.float32, device=x.device)
    num_seqs = state_slots.shape[0]
    if num_seqs == 0 or num_tokens == 0:
        return out
    gate = z if z is not None else x  # (unread without a gate)
    grid = (num_seqs, triton.cdiv(channels, _BLOCK_D))
    _selective_scan_kernel[grid](
        x, dt, B, C, gate, A_log.contiguous(), dt_bias, D, out, ssm_pool, state_slots, cu_seqlens, context_lens,
        x.stride(0), dt.stride(0), B.stride(0), C.stride(0), gate.stride(0), out.stride(0), ssm_pool.stride(0),
        ssm_pool.stride(1), channels, state_size,
        HAS_Z=z is not None, BLOCK_D=_BLOCK_D, BLOCK_N=triton.next_power_of_2(state_size), num_warps=_WARPS,
    )
    return out


def runs_on(x: torch.Tensor) -> bool:
    """Whether the kernel runs on x's device: CUDA only (`CudaBackend.selective_scan` takes the torch reference on
    CPU tensors). The interpreter tests patch it to run the kernel on the CPU under TRITON_INTERPRET."""
    return x.is_cuda
