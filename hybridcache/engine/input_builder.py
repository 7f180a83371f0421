"""Builds the device inputs of one forward step from host-side chunks.

This is the only place where scheduler blocks become kernel pages: scheduler block `b` is made of the
kernel pages `b * pages_per_block + j` for `j < pages_per_block`, where
`pages_per_block = block_size // kernel_block_size`.

Worked example (block_size 16, kernel_block_size 8, pages_per_block 2)::

    chunk: start 20, 5 new tokens, block_ids [3, 7]
    kernel pages of the sequence: [6, 7, 14, 15]
    positions 20..24 lie in scheduler block index 1 (block 7): 20..23 in kernel page 14 at offsets
    4..7, 24 in kernel page 15 at offset 0
    kv_rows = 14 * 8 + [4, 5, 6, 7] and 15 * 8 + 0 = [116, 117, 118, 119, 120]
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hybridcache.cache.plan import CopyOp, CopyPlan
from hybridcache.forward_batch import DeviceCopyOp, ForwardBatch, table_width

_ALIGN_WORDS = 2  # int64 words per 16 bytes: every field of a step's packed id tensor starts aligned (_to_device)
_PAD = (0,) * _ALIGN_WORDS


@dataclass(frozen=True)
class SeqChunk:
    """The tokens one sequence feeds in one step.

    token_ids: the new tokens; start: tokens already in the cache before them (the step they begin at);
    block_ids: scheduler blocks holding positions [0, start + len(token_ids)), in order; slot: state row;
    embeds: (offset in the chunk, vectors [n, hidden]) pairs: input embeddings given for chunk rows
    offset .. offset + n - 1 (multimodal spans) instead of looked up from their token ids; rope_positions:
    [3, len(token_ids)] M-RoPE positions of the chunk's tokens (a chunk overlapping an image), else None: they are
    then `start + rope_shift ..` on every axis (rope_shift: the M-RoPE shift of the images before the chunk).
    """

    token_ids: Sequence[int]
    start: int
    block_ids: Sequence[int]
    slot: int
    embeds: tuple[tuple[int, torch.Tensor], ...] = ()
    rope_positions: torch.Tensor | None = None
    rope_shift: int = 0


class PageRows:
    """Each state slot's kernel pages as an int64 C buffer, kept from step to step: a decode step's block table is
    then copied from buffers (`array.extend`, a memcpy) instead of converted from Python ints, and with
    pages_per_block > 1 not expanded again (64 sequences of 16,000 tokens: ~1,000 blocks' ids a step; the figures
    are in docs/bench.md, "Host"). A row is reused only while the slot's block ids equal the ones it was made
    from (a tuple compare, element identity first), so a stale row is never read: a slot that another sequence
    took, blocks a preempted sequence got back, a block replaced by its private copy all make a new row."""

    def __init__(self, pages_per_block: int) -> None:
        self.pages_per_block = pages_per_block
        self._rows: dict[int, tuple[tuple[int, ...], array]] = {}

    def pages(self, slot: int, block_ids: Sequence[int]) -> array:
        """The kernel pages of `block_ids` (block b: pages b * pages_per_block + j), the slot's kept row when its
        block ids are the same."""
        kept = self._rows.get(slot)
        block_ids = tuple(block_ids)
        if kept is not None and kept[0] == block_ids:
            return kept[1]
        ppb = self.pages_per_block
        pages = array("q", block_ids if ppb == 1 else [b * ppb + j for b in block_ids for j in range(ppb)])
        self._rows[slot] = (block_ids, pages)
        return pages


def build_forward_batch(
    chunks: Sequence[SeqChunk],
    *,
    block_size: int,
    kernel_block_size: int,
    device: torch.device | str = "cpu",
    copies: CopyPlan | None = None,
    prompt_logits: Sequence[bool] = (),
    draft_slots: Sequence[tuple[int, ...]] = (),
    page_rows: PageRows | None = None,
) -> ForwardBatch:
    """Concatenate the chunks into one `ForwardBatch` (see `hybridcache.forward_batch`), with the step's copy
    plan turned into device id tensors. `prompt_logits[i]` (default: False for every chunk): chunk i also gets
    logits at each of its rows but its last (`prompt_logits_rows`, in chunk order), for prompt logprobs.
    `draft_slots[i]` (speculative decoding; default () for every chunk): chunk i is a verify row (its last token,
    then n drafts) and names n state pool rows, where the state after each of its first n positions is kept
    (`ForwardBatch.draft_rows` / `draft_slots`). `page_rows`: the caller's `PageRows`, kept across its steps (the
    engine's), for its block pages of the pages per block given here; None: made afresh for this step."""
    if prompt_logits and len(prompt_logits) != len(chunks):
        raise ValueError(f"{len(prompt_logits)} prompt_logits flags for {len(chunks)} chunks")
    if draft_slots and len(draft_slots) != len(chunks):
        raise ValueError(f"{len(draft_slots)} draft slot lists for {len(chunks)} chunks")
    if block_size % kernel_block_size:
        raise ValueError(f"block_size {block_size} is not a multiple of kernel_block_size {kernel_block_size}")
    pages_per_block = block_size // kernel_block_size
    if page_rows is None:
        page_rows = PageRows(pages_per_block)
    elif page_rows.pages_per_block != pages_per_block:
        raise ValueError(f"page_rows hold {page_rows.pages_per_block} pages a block, this step {pages_per_block}")
    input_ids: list[int] = []
    positions: list[int] = []
    kv_rows: list[int] = []
    cu_seqlens = [0]
    context_lens: list[int] = []
    table_rows: list[array] = []
    logits_indices: list[int] = []
    embed_rows: list[int] = []
    embeds: list[torch.Tensor] = []
    draft_rows: list[int] = []
    draft_pool_rows: list[int] = []
    explicit_rope: list[tuple[int, torch.Tensor]] = []  # (first row, [3, n]) of chunks overlapping an image
    shifted: list[int] | None = None  # rotary positions once a chunk has a rope_shift: position + the shift
    kbs = kernel_block_size
    for i, chunk in enumerate(chunks):
        token_ids, start, block_ids = chunk.token_ids, chunk.start, chunk.block_ids
        num_new = len(token_ids)
        if num_new == 0:
            raise ValueError("a chunk must feed at least one token")
        end = start + num_new
        if len(block_ids) * block_size < end:
            raise ValueError(f"{len(block_ids)} blocks cannot hold {end} tokens")
        pages = page_rows.pages(chunk.slot, block_ids)
        first_row = len(input_ids)
        drafted = tuple(draft_slots[i]) if draft_slots else ()
        if len(drafted) >= num_new:
            raise ValueError(f"{len(drafted)} draft states for a chunk of {num_new} tokens")
        draft_rows.extend(range(first_row, first_row + len(drafted)))
        draft_pool_rows.extend(drafted)
        for offset, vectors in chunk.embeds:
            embed_rows.extend(range(first_row + offset, first_row + offset + vectors.shape[0]))
            embeds.append(vectors)
        input_ids.extend(token_ids)
        rope_rows = chunk.rope_positions
        if rope_rows is not None:
            explicit_rope.append((first_row, rope_rows))
        shift = chunk.rope_shift
        if shift and shifted is None:  # the first shifted chunk: the rows before it are unshifted
            shifted = list(positions)
        if shifted is not None:
            shifted.extend(range(start + shift, end + shift))
        if num_new == 1:  # a decode row (most rows of most steps)
            positions.append(start)
            kv_rows.append(pages[start // kbs] * kbs + start % kbs)
        else:
            positions.extend(range(start, end))
            kv_rows.extend(pages[pos // kbs] * kbs + pos % kbs for pos in range(start, end))
        cu_seqlens.append(first_row + num_new)
        context_lens.append(end)
        table_rows.append(pages[: -(-end // kbs)])
        logits_indices.append(first_row + num_new - 1)
    prompt_rows = [row for i, flag in enumerate(prompt_logits) if flag
                   for row in range(cu_seqlens[i], cu_seqlens[i + 1] - 1)]
    width = table_width(max(len(row) for row in table_rows))
    table = array("q")
    for row in table_rows:
        table.extend(row)
        table.frombytes(bytes(8 * (width - len(row))))  # zero pages past the row's end

    num_seqs = len(chunks)
    fields = {
        "input_ids": input_ids,
        "positions": positions,
        "kv_rows": kv_rows,
        "state_slots": [c.slot for c in chunks],
        "logits_indices": logits_indices,
        "cu_seqlens": cu_seqlens,
        "context_lens": context_lens,
        "block_tables": table,
        "embed_rows": embed_rows,
        "prompt_logits_rows": prompt_rows,
        "draft_rows": draft_rows,
        "draft_slots": draft_pool_rows,
        "rotary_positions": shifted or (),
    }
    ops = copies.ops if copies is not None else ()
    fields.update(_copy_fields(ops))
    device_fields = _to_device(fields, device)
    int32 = {name: device_fields[name].to(torch.int32) for name in ("cu_seqlens", "context_lens", "block_tables")}
    device_copies = [DeviceCopyOp(op.kind, device_fields[f"copy{i}_src"], device_fields[f"copy{i}_dst"],
                                  DeviceCopyOp.host_side(op.kind, op.src_ids, op.dst_ids))
                     for i, op in enumerate(ops)]
    rope_positions = None
    if explicit_rope:  # chunks overlapping an image: [3, T] built on the host, their rows written in
        host = torch.tensor(positions if shifted is None else shifted, dtype=torch.int64).repeat(3, 1)
        for row, rows in explicit_rope:
            host[:, row: row + rows.shape[1]] = rows
        rope_positions = host.to(device)
    elif shifted is not None:  # text rows after images only (decode steps): one row, the same on the three axes
        rope_positions = device_fields["rotary_positions"].expand(3, -1)
    return ForwardBatch(
        input_ids=device_fields["input_ids"],
        positions=device_fields["positions"],
        cu_seqlens=int32["cu_seqlens"],
        context_lens=int32["context_lens"],
        block_tables=int32["block_tables"].view(num_seqs, width),
        kv_rows=device_fields["kv_rows"],
        state_slots=device_fields["state_slots"],
        logits_indices=device_fields["logits_indices"],
        query_lens_cpu=tuple(len(c.token_ids) for c in chunks),
        context_lens_cpu=tuple(context_lens),
        copies=tuple(device_copies),
        embed_rows=device_fields["embed_rows"] if embed_rows else None,
        embeds=torch.cat([e.to(device) for e in embeds]) if embeds else None,  # spans may live on either side
        rope_positions=rope_positions,
        prompt_logits_rows=device_fields["prompt_logits_rows"] if prompt_rows else None,
        draft_rows=device_fields["draft_rows"] if draft_rows else None,
        draft_slots=device_fields["draft_slots"] if draft_rows else None,
        draft_slots_cpu=tuple(tuple(d) for d in draft_slots) if draft_rows else (),
    )


def _copy_fields(ops: Sequence[CopyOp]) -> dict[str, Sequence[int]]:
    """The copy plan's id lists, source and destination apart (each is then a field of its own, aligned)."""
    fields: dict[str, Sequence[int]] = {}
    for i, op in enumerate(ops):
        fields[f"copy{i}_src"] = op.src_ids
        fields[f"copy{i}_dst"] = op.dst_ids
    return fields


def _to_device(fields: dict[str, Sequence[int]], device: torch.device | str) -> dict[str, torch.Tensor]:
    """Every integer field in one int64 host tensor, moved to `device` in one transfer (pinned and non-blocking
    on CUDA: the host does not wait for it; the pinned buffer is kept alive by torch's caching host allocator
    until the copy is done); returns views of the device tensor, one per field.

    Every field starts at an even word, i.e. 16-byte aligned like the packed tensor itself: Triton specialises a
    kernel on whether each pointer argument is 16-byte aligned, so a field whose alignment followed the lengths
    before it (state slots after 3 x T token words, a copy's destination ids after its sources) would compile
    another variant of the kernels that read it in whichever step first met the other alignment."""
    flat = array("q")  # a C buffer, wrapped without a copy (torch.tensor over a list of ints converts each int)
    starts = {}
    for name, values in fields.items():
        flat.extend(_PAD[: -len(flat) % _ALIGN_WORDS])
        starts[name] = len(flat)
        flat.extend(values)
    host = torch.frombuffer(flat, dtype=torch.int64) if flat else torch.empty(0, dtype=torch.int64)
    on_cuda = torch.device(device).type == "cuda"
    packed = host.pin_memory().to(device, non_blocking=True) if on_cuda else host.to(device)
    return {name: packed[starts[name]: starts[name] + len(values)] for name, values in fields.items()}


def device_copies(copies: CopyPlan, device: torch.device | str) -> tuple[DeviceCopyOp, ...]:
    """The step's copy ops alone, on the device in one transfer (a step with no forward: only zero-prefill
    samples, whose restores still run)."""
    fields = _copy_fields(copies.ops)
    if not fields:
        return ()
    on_device = _to_device(fields, device)
    return tuple(DeviceCopyOp(op.kind, on_device[f"copy{i}_src"], on_device[f"copy{i}_dst"],
                              DeviceCopyOp.host_side(op.kind, op.src_ids, op.dst_ids))
                 for i, op in enumerate(copies.ops))
