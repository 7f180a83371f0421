"""Builds the device inputs of one forward step from host-side chunks.

This is the only place where scheduler blocks become kernel pages: scheduler block `b` is made of the
kernel pages `b * pages_per_block + j` for `j < pages_per_block`, where
`pages_per_block = block_size // kernel_block_size`.

Worked example (block_size 16, kernel_block_size 8, pages_per_block 2)::

    chunk: start 20, 5 new tokens, block_ids [3, 7]
    kernel pages of the sequence: [6, 7, 14, 15]
    positions 20..24 lie in scheduler block index 1 (block 7): 20..23 in kernel page 14 at offsets
    4..7, 24 in kernel page 15 at offset 0
    slot_mapping = 14 * 8 + [4, 5, 6, 7] and 15 * 8 + 0 = [116, 117, 118, 119, 120]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hybridcache.cache.plan import CopyPlan
from hybridcache.forward_batch import DeviceCopyOp, ForwardBatch


@dataclass(frozen=True)
class SeqChunk:
    """The tokens one sequence feeds in one step.

    token_ids: the new tokens; start: tokens already in the cache before them (the step they begin at);
    block_ids: scheduler blocks holding positions [0, start + len(token_ids)), in order; slot: state row;
    embeds: (offset in the chunk, vectors [n, hidden]) pairs: input embeddings given for chunk rows
    offset .. offset + n - 1 (multimodal spans) instead of looked up from their token ids.
    """

    token_ids: Sequence[int]
    start: int
    block_ids: Sequence[int]
    slot: int
    embeds: tuple[tuple[int, torch.Tensor], ...] = ()


def build_forward_batch(
    chunks: Sequence[SeqChunk],
    *,
    block_size: int,
    kernel_block_size: int,
    device: torch.device | str = "cpu",
    copies: CopyPlan | None = None,
) -> ForwardBatch:
    """Concatenate the chunks into one `ForwardBatch` (see `hybridcache.forward_batch`), with the step's copy
    plan turned into device id tensors."""
    if block_size % kernel_block_size:
        raise ValueError(f"block_size {block_size} is not a multiple of kernel_block_size {kernel_block_size}")
    pages_per_block = block_size // kernel_block_size
    input_ids: list[int] = []
    positions: list[int] = []
    slot_mapping: list[int] = []
    cu_seqlens = [0]
    context_lens: list[int] = []
    page_rows: list[list[int]] = []
    logits_indices: list[int] = []
    embed_rows: list[int] = []
    embeds: list[torch.Tensor] = []
    for chunk in chunks:
        num_new = len(chunk.token_ids)
        if num_new == 0:
            raise ValueError("a chunk must feed at least one token")
        end = chunk.start + num_new
        if len(chunk.block_ids) * block_size < end:
            raise ValueError(f"{len(chunk.block_ids)} blocks cannot hold {end} tokens")
        pages = [b * pages_per_block + j for b in chunk.block_ids for j in range(pages_per_block)]
        for offset, vectors in chunk.embeds:
            embed_rows.extend(range(len(input_ids) + offset, len(input_ids) + offset + vectors.shape[0]))
            embeds.append(vectors)
        input_ids.extend(chunk.token_ids)
        for pos in range(chunk.start, end):
            positions.append(pos)
            slot_mapping.append(pages[pos // kernel_block_size] * kernel_block_size + pos % kernel_block_size)
        cu_seqlens.append(cu_seqlens[-1] + num_new)
        context_lens.append(end)
        page_rows.append(pages[: -(-end // kernel_block_size)])
        logits_indices.append(cu_seqlens[-1] - 1)
    width = max(len(row) for row in page_rows)
    table = [row + [0] * (width - len(row)) for row in page_rows]

    def tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    return ForwardBatch(
        input_ids=tensor(input_ids, torch.int64),
        positions=tensor(positions, torch.int64),
        cu_seqlens=tensor(cu_seqlens, torch.int32),
        context_lens=tensor(context_lens, torch.int32),
        block_tables=tensor(table, torch.int32),
        slot_mapping=tensor(slot_mapping, torch.int64),
        state_slots=tensor([c.slot for c in chunks], torch.int64),
        logits_indices=tensor(logits_indices, torch.int64),
        query_lens_cpu=tuple(len(c.token_ids) for c in chunks),
        context_lens_cpu=tuple(context_lens),
        copies=device_copies(copies, device) if copies is not None else (),
        embed_rows=tensor(embed_rows, torch.int64) if embed_rows else None,
        embeds=torch.cat(embeds).to(device) if embeds else None,
    )


def device_copies(copies: CopyPlan, device: torch.device | str) -> tuple[DeviceCopyOp, ...]:
    """Each op's ids in one host tensor, moved to the device in one transfer."""
    ops = []
    for op in copies.ops:
        ids = torch.tensor([op.src_ids, op.dst_ids], dtype=torch.int64).to(device)
        ops.append(DeviceCopyOp(op.kind, ids[0], ids[1]))
    return tuple(ops)
