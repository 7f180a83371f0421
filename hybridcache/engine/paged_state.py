"""Checkpoint states kept in KV pages: the device side of paged `STATE_SAVE` / `STATE_FINISH` / `STATE_RESTORE`.

A running sequence's state lives in its runtime slot (a row of every `DevicePools.state_groups` tensor); a
checkpoint's state lives in k blocks of the KV pool, its pages (see `hybridcache.cache.plan`). Both sides are
read as bytes:

- a slot's **stream**: the concatenation over the state groups, in order, of the slot's bytes in each group
  ([layers, *shape] in C order), zero-padded to k * P bytes; chunk j (id `slot * k + j`) = stream[j*P:(j+1)*P];
- a **page** (scheduler block b): the concatenation over the KV groups, in order, of the block's bytes in each
  group ([layers, 2, pages_per_block * kernel_block_size * Hkv * D] elements: its kernel pages b * ppb ..
  b * ppb + ppb - 1 are adjacent in every (layer, K|V) row), P bytes in all.

`k = ceil(S / P)` for a slot of S bytes. Worked example (1 DeltaNet layer: conv [8, 3] bf16 = 48 B, ssm
[2, 4, 4] fp32 = 128 B, last_hidden [16] bf16 = 32 B, so S = 208 B; 1 attention layer, kernel pages of 2 tokens,
1 kv head of 8 fp32 values, pages_per_block 1, so P = 2 x 2 x 8 x 4 = 128 B)::

    k = ceil(208 / 128) = 2
    stream of slot 3 = conv[0, 3] (48 B) | ssm[0, 3] (128 B) | last_hidden[0, 3] (32 B) | 48 zero bytes
    STATE_SAVE [(6, 40), (7, 41)]: bytes 0..127 of the stream -> block 40 (its K row: bytes 0..63, V row:
    64..127), bytes 128..255 -> block 41;  STATE_RESTORE [(40, 2), (41, 3)] writes them back into slot 1

A model without attention layers (P = 0) gets a page store of its own, [num_blocks, S] bytes, with k = 1: the
cache's block ids then name rows of the store (its KV blocks hold nothing).

All copies are in words of the widest size (8, 4, 2 or 1 bytes) that divides every row, so they run the same
whatever the dtypes, with no host synchronisation and no loop over pairs. On CUDA a save or restore is one Triton
launch straight between the state groups and the pages (`hybridcache.kernels.copy.triton_state`, int64 offsets:
a next-16b pool's (layer, K|V) rows lie more than 2 GiB apart); the torch path (the reference, and the CPU's) is
batched ops on views of the pools, a loop over groups and over workspace tiles of slots.
"""

from __future__ import annotations

import os
from importlib.util import find_spec
from math import prod

import torch

from hybridcache.engine.memory import state_pages
from hybridcache.kernels.copy.state_tiles import group_runs, page_group_runs, state_tiles
from hybridcache.state_spec import DevicePools

DEFAULT_MAX_WORKSPACE_BYTES = 64 << 20
_WORDS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def _row_bytes(tensor: torch.Tensor, dim: int) -> int:
    """Bytes of one entry of `tensor` along `dim` (the elements of the dims after it)."""
    return prod(tensor.shape[dim + 1:]) * tensor.element_size()


class PagedStates:
    """Saves runtime slots' states into pages of the KV pool and restores them (see the module docstring).

    pools: the runner's pools (updated in place); pages_per_block: kernel pages per scheduler block; num_blocks:
    scheduler blocks in the pool (checked against the KV groups; the page store's rows without them); k: pages
    per state, >= `state_pages(slot_bytes, page_bytes)`. max_workspace_bytes: the torch path's temporary of one
    tile of slots (a save or restore of n slots runs in tiles of max(1, max_workspace_bytes // (k * P)) slots).
    impl: "triton" (one launch per op; on CPU tensors only under TRITON_INTERPRET=1), "torch", or "auto" (Triton
    on CUDA when it is installed, else torch)."""

    def __init__(self, pools: DevicePools, *, pages_per_block: int, num_blocks: int, k: int,
                 max_workspace_bytes: int = DEFAULT_MAX_WORKSPACE_BYTES, impl: str = "auto") -> None:
        if not pools.state_groups:
            raise ValueError("the pools have no state groups: a runtime slot holds nothing to page")
        for kv in pools.kv_groups:
            if kv.shape[2] != num_blocks * pages_per_block:
                raise ValueError(f"a KV group of {kv.shape[2]} pages is not {num_blocks} blocks of "
                                 f"{pages_per_block} pages")
        device = pools.state_groups[0].device
        slot_rows = [_row_bytes(g, 1) for g in pools.state_groups]  # bytes of one slot in one layer
        page_rows = [pages_per_block * _row_bytes(kv, 2) for kv in pools.kv_groups]  # of one block in one row
        self.k = k
        self.slot_bytes = sum(g.shape[0] * row for g, row in zip(pools.state_groups, slot_rows))
        self.page_bytes = sum(kv.shape[0] * 2 * row for kv, row in zip(pools.kv_groups, page_rows))
        word = next(size for size in _WORDS if all(row % size == 0 for row in slot_rows + page_rows))
        dtype = _WORDS[word]
        self.page_store: torch.Tensor | None = None
        if self.page_bytes == 0:
            self.page_store = torch.zeros((num_blocks, self.slot_bytes // word), dtype=dtype, device=device)
            self.page_bytes = self.slot_bytes
        needed = state_pages(self.slot_bytes, self.page_bytes)
        if k < needed or (self.page_store is not None and k != 1):
            raise ValueError(f"k = {k} pages of {self.page_bytes} bytes for a state slot of {self.slot_bytes} "
                             f"bytes: it needs k = {needed}")
        self._word = word
        # [layers, num_slots, words of one slot's row] per state group; [rows, num_blocks, words of one block's
        # row] per page group (a KV group's rows are its (layer, K|V) pairs; the page store is one row)
        self._slots = tuple(g.view(g.shape[0], g.shape[1], -1).view(torch.uint8).view(dtype)
                            for g in pools.state_groups)
        if self.page_store is not None:
            self._pages = (self.page_store.view(1, num_blocks, -1),)
        else:
            self._pages = tuple(kv.view(kv.shape[0] * 2, num_blocks, -1).view(torch.uint8).view(dtype)
                                for kv in pools.kv_groups)
        self._tile_slots = max(1, max_workspace_bytes // (k * self.page_bytes))
        self._table: torch.Tensor | None = None  # the Triton path's tile table (`state_tiles`), None: torch
        if _use_triton(impl, device):
            from hybridcache.kernels.copy import triton_state

            base = self._slots[0]
            table = state_tiles([group_runs(g, base, word) for g in self._slots],
                                [page_group_runs(pages, base, word) for pages in self._pages], k,
                                triton_state.tile_words(word))
            self._align = triton_state.alignment(table, base, word)
            self._table = table.to(device)

    @staticmethod
    def state_pages(slot_bytes: int, page_bytes: int) -> int:
        """k from `pool_bytes` numbers: `hybridcache.engine.memory.state_pages` (ceil(S / P); 1 when P is 0)."""
        return state_pages(slot_bytes, page_bytes)

    def save(self, src_chunks: torch.Tensor, dst_pages: torch.Tensor) -> None:
        """Chunk `src_chunks[i]` (`slot * k + j`) -> page (scheduler block) `dst_pages[i]`, for every i; int64 ids on
        the pools' device (as `DeviceCopyOp` carries them; ids elsewhere are copied there), the k chunks of a slot
        together, j in order; destinations unique. Only the destination pages change."""
        self._check(src_chunks, dst_pages)
        if self._table is not None:
            return self._launch(src_chunks, dst_pages, to_pages=True)
        for start in range(0, src_chunks.numel(), self._tile_slots * self.k):
            stop = start + self._tile_slots * self.k
            self._save_tile(src_chunks[start:stop], dst_pages[start:stop])

    def restore(self, src_pages: torch.Tensor, dst_chunks: torch.Tensor) -> None:
        """Page `src_pages[i]` -> chunk `dst_chunks[i]`, for every i (sources may repeat; the k chunks of a
        destination slot together, j in order; destination slots unique). Only the destination slots change."""
        self._check(src_pages, dst_chunks)
        if self._table is not None:
            return self._launch(dst_chunks, src_pages, to_pages=False)
        for start in range(0, dst_chunks.numel(), self._tile_slots * self.k):
            stop = start + self._tile_slots * self.k
            self._restore_tile(src_pages[start:stop], dst_chunks[start:stop])

    def compile(self) -> None:
        """Compile the Triton path's kernel (both directions) without copying anything; nothing to do on the
        torch path."""
        if self._table is not None:
            from hybridcache.kernels.copy.triton_state import compile_state_pages

            ids = torch.zeros(self.k, dtype=torch.int64, device=self._slots[0].device)
            compile_state_pages(self._slots[0], self._table, ids, k=self.k, align=self._align)

    def _launch(self, chunks: torch.Tensor, pages: torch.Tensor, *, to_pages: bool) -> None:
        """The Triton path: one launch for every state of the op (ids moved to the pools' device as int64)."""
        from hybridcache.kernels.copy.triton_state import launch_state_pages

        device = self._slots[0].device
        launch_state_pages(self._slots[0], self._table, chunks.to(device, torch.int64).contiguous(),
                           pages.to(device, torch.int64).contiguous(), k=self.k, to_pages=to_pages,
                           align=self._align)

    def _check(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """The id counts (host-known shapes: no synchronisation): equal, whole states of k chunks."""
        if src.shape != dst.shape or src.dim() != 1 or src.numel() % self.k:
            raise ValueError(f"paged state op of {tuple(src.shape)} sources and {tuple(dst.shape)} destinations: "
                             f"both must be [N] with N a multiple of k = {self.k}")

    @property
    def page_words(self) -> int:
        """Words (of `word_dtype`) in one page: a block's bytes over every KV group, as `gather_pages` lays them."""
        return self.page_bytes // self._word

    @property
    def word_dtype(self) -> torch.dtype:
        return _WORDS[self._word]

    def gather_pages(self, blocks: torch.Tensor) -> torch.Tensor:
        """[n, page_words]: row i = the bytes of scheduler block `blocks[i]` (KV or a state page; the concatenation
        over the page groups, in order, of its row in each), on the pools' device."""
        device = self._slots[0].device
        src = blocks.to(device, torch.int64)
        n = src.numel()
        out = torch.empty((n, self.page_words), dtype=self.word_dtype, device=device)
        offset = 0
        for pages in self._pages:
            width = pages.shape[0] * pages.shape[2]
            out[:, offset: offset + width].view(n, pages.shape[0], pages.shape[2]).copy_(
                pages.index_select(1, src).transpose(0, 1))
            offset += width
        return out

    def scatter_pages(self, blocks: torch.Tensor, data: torch.Tensor) -> None:
        """The inverse of `gather_pages`: block `blocks[i]` takes row i of `data` [n, page_words] (blocks unique)."""
        device = self._slots[0].device
        dst = blocks.to(device, torch.int64)
        n = dst.numel()
        offset = 0
        for pages in self._pages:
            width = pages.shape[0] * pages.shape[2]
            part = data[:, offset: offset + width].view(n, pages.shape[0], pages.shape[2])
            pages.index_copy_(1, dst, part.transpose(0, 1))
            offset += width

    def slot_chunks(self, src_chunks: torch.Tensor) -> torch.Tensor:
        """[n * k, page_words]: the page each chunk `src_chunks` (whole slots, j in order) would be saved as."""
        k, word, device = self.k, self._word, self._slots[0].device
        slots = src_chunks[::k].to(device, torch.int64) // k
        n = slots.numel()
        streams = torch.empty((n, k * self.page_words), dtype=_WORDS[word], device=device)
        offset = 0
        for group in self._slots:
            width = group.shape[0] * group.shape[2]
            streams[:, offset: offset + width].view(n, group.shape[0], group.shape[2]).copy_(
                group.index_select(1, slots).transpose(0, 1))
            offset += width
        streams[:, offset:].zero_()
        return streams.view(n * k, self.page_words)

    def _save_tile(self, src_chunks: torch.Tensor, dst_pages: torch.Tensor) -> None:
        self.scatter_pages(dst_pages, self.slot_chunks(src_chunks))

    def _restore_tile(self, src_pages: torch.Tensor, dst_chunks: torch.Tensor) -> None:
        k, device = self.k, self._slots[0].device
        slots = dst_chunks[::k].to(device, torch.int64) // k
        n = slots.numel()
        chunks = self.gather_pages(src_pages)
        streams = chunks.view(n, -1)
        offset = 0
        for group in self._slots:
            width = group.shape[0] * group.shape[2]
            part = streams[:, offset: offset + width].view(n, group.shape[0], group.shape[2])
            group.index_copy_(1, slots, part.transpose(0, 1))
            offset += width


def _use_triton(impl: str, device: torch.device) -> bool:
    """Whether `impl` ("auto", "torch" or "triton") runs the Triton path on `device` (ValueError for "triton" where
    it cannot: a CPU device without TRITON_INTERPRET=1)."""
    if impl not in ("auto", "torch", "triton"):
        raise ValueError(f"impl must be 'auto', 'torch' or 'triton', got {impl!r}")
    if impl == "auto":
        return device.type == "cuda" and find_spec("triton") is not None
    if impl == "triton" and device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("impl='triton' on CPU tensors needs TRITON_INTERPRET=1 set before triton is imported")
    return impl == "triton"
