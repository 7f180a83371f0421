"""The conv state after each draft position of speculative decoding's verify rows, on CUDA (Triton).

The conv state of gated DeltaNet is the last W = K-1 pre-convolution inputs of a sequence, oldest first. After
position j of a verify row (its last token and n drafts, rows bos .. bos+n of x), the state is the last W of
(old state ++ x[bos .. bos+j]); for j < n it goes to pool row `draft_table[i, j]` (what the cache's
`STATE_ROLLBACK` copies into the slot when only j drafts are accepted). Same result as
`conv/reference.py::conv_states_after`. Run it before the convolution kernels, which rewrite the slot.

Grid (S, C / BLOCK_C): each program copies its channels of every draft state of one sequence (entries are copies
of inputs: exact in every dtype).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridcache.kernels.conv.triton import state_entries, state_sequence
from hybridcache.kernels.varlen import check_verify_rows

_BLOCK_C = 128


@triton.jit(do_not_specialize=["stride_table"])  # the table's width is the step's most drafts: 1 is a run-time value
def _conv_draft_states_kernel(
    x_ptr, pool_ptr, slots_ptr, cu_ptr, ctx_ptr, table_ptr, drafts_ptr,
    stride_xt, stride_ps, stride_pc, stride_pw, stride_table, num_channels,
    W: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_C: tl.constexpr,
):
    seq, pid_c, bos, _, state_lo, slot = state_sequence(slots_ptr, cu_ptr, ctx_ptr, W)
    num_drafts = tl.load(drafts_ptr + seq).to(tl.int64)
    chans = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    cols = tl.arange(0, BLOCK_W)
    ok = (chans < num_channels)[:, None] & (cols < W)[None, :]
    for j in range(0, num_drafts):
        src = j + 1 - W + cols  # row position that becomes entry `col`
        entry = state_entries(x_ptr, pool_ptr, bos, slot, src, state_lo, chans, ok, stride_xt, stride_ps, stride_pc,
                              stride_pw, W)
        draft_row = tl.load(table_ptr + seq * stride_table + j).to(tl.int64)
        tl.store(pool_ptr + draft_row * stride_ps + chans[:, None] * stride_pc + cols[None, :] * stride_pw,
                 entry.to(pool_ptr.dtype.element_ty), mask=ok)


def conv_draft_states(
    x: torch.Tensor,
    conv_pool: torch.Tensor,
    state_slots: torch.Tensor,
    cu_seqlens: torch.Tensor,
    context_lens: torch.Tensor,
    draft_table: torch.Tensor,
    num_drafts: torch.Tensor,
) -> None:
    """Write the conv state after each of the first num_drafts[i] positions of every sequence i into its draft rows.

    x           [T, C] pre-convolution inputs (unit stride on C)
    conv_pool   [num_slots, C, W] the last W inputs of each slot, oldest first (read at state_slots, written at
                the draft rows only)
    state_slots [S] int64;  cu_seqlens [S + 1];  context_lens [S] (== query_len: fresh, the old state is zeros)
    draft_table [S, D] int64 pool rows (D >= max num_drafts, at least 1);  num_drafts [S] int32 (< query_len)
    Draft rows must not be any sequence's slot.
    """
    num_seqs = state_slots.shape[0]
    num_channels = x.shape[1]
    width = conv_pool.shape[2]
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x {tuple(x.shape)} must be [T, C] with unit stride on C")
    if conv_pool.dim() != 3 or conv_pool.shape[1] != num_channels:
        raise ValueError(f"conv_pool {tuple(conv_pool.shape)} must be [num_slots, {num_channels}, W]")
    check_verify_rows(num_seqs, cu_seqlens, context_lens, draft_table, num_drafts)
    if num_seqs == 0 or width == 0:
        return
    block_c = min(_BLOCK_C, triton.next_power_of_2(num_channels))
    _conv_draft_states_kernel[(num_seqs, triton.cdiv(num_channels, block_c))](
        x, conv_pool, state_slots, cu_seqlens, context_lens, draft_table, num_drafts,
        x.stride(0), conv_pool.stride(0), conv_pool.stride(1), conv_pool.stride(2), draft_table.stride(0),
        num_channels, W=width, BLOCK_W=triton.next_power_of_2(width), BLOCK_C=block_c,
    )
