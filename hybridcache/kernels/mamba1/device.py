"""Mamba1's selective scan on the torch reference kernels, with the step's geometry read on the device (no host
sync), for `CudaBackend` until a fused kernel exists: CUDA graphs may capture both functions.

- `selective_decode`: one token of each of M sequences (an all-decode step), the state rows `ssm_pool[state_slots]`,
  fresh rows (context_len 1) read as zeros.
- `selective_scan_one`: one sequence over every row of the step, its length (cu_seqlens[1]), freshness
  (context_len == length) and slot read on the device; the rows past its length are made inert (dt, x, B, C and z
  zero: the state passes them unchanged, their outputs are finite and discarded), as a whole-step graph
  (`prefill_graphs.SequenceGraphs`) captures it on a bucket of rows.

Both compute what `reference.selective_step` / `selective_scan` compute (they call them).
"""

from __future__ import annotations

import torch

from hybridcache.kernels.mamba1 import reference as mamba1_ref


def selective_decode(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,  # noqa: N803
    B: torch.Tensor,  # noqa: N803
    C: torch.Tensor,  # noqa: N803
    D: torch.Tensor,  # noqa: N803
    z: torch.Tensor | None,
    ssm_pool: torch.Tensor,
    state_slots: torch.Tensor,
    context_lens: torch.Tensor,
) -> torch.Tensor:
    """x, dt [M, I] (dt discretized), A [I, N], B, C [M, N], D [I], z [M, I] or None; ssm_pool [num_slots, I, N]
    updated in place. Returns y [M, I] fp32."""
    state = ssm_pool.index_select(0, state_slots)
    state = torch.where((context_lens == 1)[:, None, None], torch.zeros_like(state), state)
    y, state = mamba1_ref.selective_step(x, dt, A, B, C, D, z, state)
    ssm_pool.index_copy_(0, state_slots, state.to(ssm_pool.dtype))
    return y


def selective_scan_one(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,  # noqa: N803
    B: torch.Tensor,  # noqa: N803
    C: torch.Tensor,  # noqa: N803
    D: torch.Tensor,  # noqa: N803
    z: torch.Tensor | None,
    ssm_pool: torch.Tensor,
    state_slots: torch.Tensor,
    cu_seqlens: torch.Tensor,
    context_lens: torch.Tensor,
) -> torch.Tensor:
    """One sequence on rows 0..T-1 (T = x's rows >= its length cu_seqlens[1]); x, dt [T, I] (dt discretized),
    B, C [T, N], z [T, I] or None; its state row ssm_pool[state_slots[0]] read (zeros when fresh) and rewritten.
    Returns y [T, I] fp32 (rows past the length: finite, meaningless)."""
    length = cu_seqlens[1] - cu_seqlens[0]
    valid = (torch.arange(x.shape[0], device=x.device) < length)[:, None]  # [T, 1]
    x, dt, B, C = (torch.where(valid, t.float(), 0.0) for t in (x, dt, B, C))  # noqa: N806
    z = None if z is None else torch.where(valid, z.float(), 0.0)
    slot = state_slots[:1]
    state = ssm_pool.index_select(0, slot)[0]
    state = torch.where(context_lens[0] == length, torch.zeros_like(state), state)
    y, state = mamba1_ref.selective_scan(x, dt, A, B, C, D, z, state)
    ssm_pool.index_copy_(0, slot, state[None].to(ssm_pool.dtype))
    return y
