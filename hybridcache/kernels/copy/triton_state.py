"""The Triton kernel of paged checkpoint-state copies: one launch saves (or restores) every slot of an op, straight
between the state groups and the pages, by the tile table of `state_tiles.py` (`hybridcache.engine.paged_state`
uses it on CUDA; its torch path is the reference).

Grid: (tiles, states): program (t, i) copies tile t of the i-th state of the op: slot `chunk_ids[i * K + j] // K`
<-> block `page_ids[i * K + j]` (j: the tile's chunk). All offsets are int64 words from one base tensor, so a pool
whose rows lie more than 2 GiB apart (a 1 MiB block over 80 GB) is addressed directly (torch's `index_copy_` on
such a view splits into one 64-bit launch per row; `docs/bench.md`, session 43).

Set TRITON_INTERPRET=1 before this module is imported to run it on CPU tensors.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import triton
import triton.language as tl

from hybridcache.kernels.copy.state_tiles import COLUMNS

TILE_BYTES = 16 << 10  # the table's tiles hold at most this many bytes


@triton.jit(do_not_specialize=["chunk_ids_ptr", "page_ids_ptr"])  # (any id tensor: one variant)
def _state_pages_kernel(base_ptr, table_ptr, chunk_ids_ptr, page_ids_ptr, K: tl.constexpr, TO_PAGES: tl.constexpr,
                        BLOCK: tl.constexpr, ALIGN: tl.constexpr, COLS: tl.constexpr):
    row = table_ptr + tl.program_id(0).to(tl.int64) * COLS
    state_off = tl.load(row)
    slot_stride = tl.load(row + 1)
    page_off = tl.load(row + 2)
    block_stride = tl.load(row + 3)
    j = tl.load(row + 4)
    length = tl.load(row + 5)
    pad = tl.load(row + 6)
    pair = tl.program_id(1).to(tl.int64) * K + j
    slot = tl.load(chunk_ids_ptr + pair).to(tl.int64) // K
    block = tl.load(page_ids_ptr + pair).to(tl.int64)
    state = tl.multiple_of(state_off + slot * slot_stride, ALIGN)
    page = tl.multiple_of(page_off + block * block_stride, ALIGN)
    offsets = tl.arange(0, BLOCK)
    inside = offsets < length
    real = offsets < length * (1 - pad)  # a padding tile has no state words
    if TO_PAGES:
        words = tl.load(base_ptr + state + offsets, mask=real, other=0)
        tl.store(base_ptr + page + offsets, words, mask=inside)
    else:
        words = tl.load(base_ptr + page + offsets, mask=real)
        tl.store(base_ptr + state + offsets, words, mask=real)


def tile_words(word: int) -> int:
    """The most words of one tile (the table's `block`)."""
    return TILE_BYTES // word


def alignment(table: torch.Tensor, base: torch.Tensor, word: int) -> int:
    """The words every tile start is a multiple of, for any slot and block (16 bytes' worth when the table's
    offsets and strides and the base address allow it, else 1): the kernel's load/store width hint."""
    words = max(1, 16 // word)
    aligned = base.data_ptr() % 16 == 0 and bool((table[:, :4] % words == 0).all())
    return words if aligned else 1


def compile_state_pages(base: torch.Tensor, table: torch.Tensor, ids: torch.Tensor, *, k: int, align: int) -> None:
    """Compile both directions' variants of the kernel for these pools without running it (Triton's `warmup`):
    `ids`, any int64 id tensor on the device (its values are not read)."""
    with torch.cuda.device(base.device) if base.device.type == "cuda" else nullcontext():
        for to_pages in (True, False):
            _state_pages_kernel.warmup(base, table, ids, ids, K=k, TO_PAGES=to_pages, BLOCK=tile_words(
                base.element_size()), ALIGN=align, COLS=COLUMNS, num_warps=4, grid=(1, 1))


def launch_state_pages(base: torch.Tensor, table: torch.Tensor, chunk_ids: torch.Tensor, page_ids: torch.Tensor,
                       *, k: int, to_pages: bool, align: int) -> None:
    """One launch: every state of the op (chunk_ids, page_ids [N * k] int64 on the device, a state's k chunks
    together, j in order) copied slot -> pages (`to_pages`) or pages -> slot. base: the word view every table
    offset counts from; table: `state_tiles.state_tiles` on the device; align: `alignment` of it."""
    num_states = chunk_ids.numel() // k
    if num_states == 0 or table.shape[0] == 0:
        return
    word = base.element_size()
    with torch.cuda.device(base.device) if base.device.type == "cuda" else nullcontext():
        _state_pages_kernel[(table.shape[0], num_states)](
            base, table, chunk_ids, page_ids, K=k, TO_PAGES=to_pages, BLOCK=tile_words(word), ALIGN=align,
            COLS=COLUMNS, num_warps=4,
        )
