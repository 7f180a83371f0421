"""Device-side index tensors for varlen batches, built without reading the device (no host sync).

A varlen batch packs S sequences' new tokens back to back: sequence i owns rows cu_seqlens[i]:cu_seqlens[i+1].
Kernels that tile each sequence into blocks of `chunk` rows launch one program per (sequence, block) pair;
`chunk_indices` lists those pairs. Its length comes from the host lengths the batch already carries, so the
launch grid is known without asking the device.

Worked example, query lengths (3, 1, 5), chunk 2::

    blocks per sequence  (2, 1, 3)            total 6
    chunk_indices        [[0, 0], [0, 1], [1, 0], [2, 0], [2, 1], [2, 2]]

This is also the layout flash-linear-attention takes as `chunk_indices` (int32 or int64, like cu_seqlens).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def num_chunks(query_lens_cpu: Sequence[int], chunk: int) -> int:
    """Sum over sequences of ceil(query_len / chunk): the number of (sequence, block) pairs."""
    return sum(-(-length // chunk) for length in query_lens_cpu)


def chunk_indices(cu_seqlens: torch.Tensor, query_lens_cpu: Sequence[int], chunk: int) -> torch.Tensor:
    """[NT, 2] (sequence id, block id within the sequence), on cu_seqlens' device and dtype.

    Computed with device ops only (searchsorted over the cumulative block counts); NT comes from the host.
    """
    total = num_chunks(query_lens_cpu, chunk)
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    blocks = (lens + (chunk - 1)) // chunk
    ends = blocks.cumsum(0)  # exclusive end of each sequence's run of blocks
    flat = torch.arange(total, device=cu_seqlens.device)
    seq = torch.searchsorted(ends, flat, right=True)
    block = flat - (ends[seq] - blocks[seq])
    return torch.stack([seq, block], dim=1).to(cu_seqlens.dtype)


def fresh_mask(cu_seqlens: torch.Tensor, context_lens: torch.Tensor) -> torch.Tensor:
    """[S] bool: sequences that start at step 0 (context_len == query_len) and so ignore their state slot."""
    return context_lens.long() == (cu_seqlens[1:] - cu_seqlens[:-1]).long()


def check_verify_rows(num_seqs: int, cu_seqlens: torch.Tensor, context_lens: torch.Tensor,
                      draft_table: torch.Tensor, num_drafts: torch.Tensor) -> None:
    """ValueError naming the tensor unless a verify step's metadata fit `num_seqs` sequences: cu_seqlens [S + 1],
    context_lens [S], num_drafts [S], and draft_table [S, >= 1] int64 with unit stride on its last dim (the pool rows
    of each sequence's draft states). The verify kernels' launchers (`gated_delta/triton_verify.py`,
    `conv/triton_verify.py`) check with it before they launch."""
    if cu_seqlens.shape != (num_seqs + 1,) or context_lens.shape != (num_seqs,) or num_drafts.shape != (num_seqs,):
        raise ValueError(f"cu_seqlens {tuple(cu_seqlens.shape)}, context_lens {tuple(context_lens.shape)} and "
                         f"num_drafts {tuple(num_drafts.shape)} must match {num_seqs} sequences")
    if draft_table.dim() != 2 or draft_table.shape[0] != num_seqs or draft_table.shape[1] < 1:
        raise ValueError(f"draft_table {tuple(draft_table.shape)} must be [{num_seqs}, at least 1]")
    if draft_table.stride(1) != 1 or draft_table.dtype != torch.int64:
        raise ValueError("draft_table must be int64 with unit stride on its last dim")
