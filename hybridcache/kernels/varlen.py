"""Index tensors for varlen batches on the device, built without reading the device (no host sync).

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

from array import array
from collections.abc import Sequence

import torch


def num_chunks(query_lens_cpu: Sequence[int], chunk: int) -> int:
    """Sum over sequences of ceil(query_len / chunk): the number of (sequence, block) pairs."""
    return sum(-(-length // chunk) for length in query_lens_cpu)


def leading_decode_rows(query_lens_cpu: Sequence[int]) -> int:
    """How many sequences at the batch's start feed one token each (a mixed step's decode rows, which the CUDA
    backend runs in the decode kernels): (1, 1, 40, 1) -> 2; all of them in an all-decode batch."""
    return next((i for i, length in enumerate(query_lens_cpu) if length != 1), len(query_lens_cpu))


def chunk_indices(cu_seqlens: torch.Tensor, query_lens_cpu: Sequence[int], chunk: int) -> torch.Tensor:
    """[NT, 2] (sequence id, block id within the sequence), on cu_seqlens' device and dtype.

    Built on the host from `query_lens_cpu` (which must be cu_seqlens' lengths) and moved in one transfer, pinned
    and non-blocking on CUDA (the host does not wait for the device; torch's caching host allocator keeps the
    pinned buffer until the copy has run): one copy instead of a dozen small device ops, each a launch of host
    time. Inside a CUDA graph capture it is built with device ops instead (`_device_chunk_indices`): a captured
    copy would read its host buffer at every replay, after the allocator has handed it out again.
    """
    if cu_seqlens.is_cuda and torch.cuda.is_current_stream_capturing():
        return _device_chunk_indices(cu_seqlens, query_lens_cpu, chunk)
    pairs = array("q")
    for seq, length in enumerate(query_lens_cpu):
        for block in range(-(-length // chunk)):
            pairs.append(seq)
            pairs.append(block)
    host = torch.frombuffer(pairs, dtype=torch.int64) if pairs else torch.empty(0, dtype=torch.int64)
    host = host.view(-1, 2).to(cu_seqlens.dtype)
    if not cu_seqlens.is_cuda:
        return host.to(cu_seqlens.device)
    return host.pin_memory().to(cu_seqlens.device, non_blocking=True)


def _device_chunk_indices(cu_seqlens: torch.Tensor, query_lens_cpu: Sequence[int], chunk: int) -> torch.Tensor:
    """`chunk_indices` with device ops only (searchsorted over the cumulative block counts); NT from the host."""
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


def any_fresh(context_lens_cpu: Sequence[int], query_lens_cpu: Sequence[int]) -> bool:
    """Whether any sequence starts at step 0 (`fresh_mask` from the host lengths): a step of prefix hits and
    decode rows has none, and its DeltaNet layers then read their state rows as they are, with no mask."""
    if len(context_lens_cpu) != len(query_lens_cpu):
        raise ValueError(f"{len(context_lens_cpu)} context lengths for {len(query_lens_cpu)} query lengths")
    return any(context == query for context, query in zip(context_lens_cpu, query_lens_cpu))


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
