"""The tile table of the one-launch paged state copy (`triton_state.py`): where each tile of a slot's stream lives
in the state groups and in the pages (the layout of `hybridcache.engine.paged_state`'s module docstring).

Everything is counted in words (the `PagedStates` word: 8, 4, 2 or 1 bytes) from one base tensor's address: every
group tensor is addressed as base + its offset from it (`delta`), so one kernel reads and writes all of them.

A slot's stream is two run sequences over the same positions [0, k * P):

- state runs: per state group g, per layer l, the slot's row of row_g words, at
  delta_g + l * num_slots * row_g + slot * row_g (positions [0, S); [S, k * P) is zero padding);
- page runs: per chunk j < k, per page group p, per row r (a (layer, K|V) pair), the block's bw_p words, at
  delta_p + r * num_blocks * bw_p + block * bw_p (the block: the op's page for chunk j).

Tiles cut the positions at every boundary of either sequence and then every `block` words, so each tile is one
contiguous run on both sides. Row t of the table, int64::

    state_off  slot_stride  page_off  block_stride  j  length  pad
    (word t' < length of the tile: state word state_off + slot * slot_stride + t' <-> page word
     page_off + block * block_stride + t'; pad = 1: a padding tile, zeros on the page side, nothing on the state side)

Worked example (words; one state group of 2 layers x 3 words, 4 slots; one page group of 2 rows x 2 words, 10
blocks; so S = 6, P = 4, k = 2, block 8)::

    positions     0 1 | 2 3 | 4 5 | 6 7        page runs (j, r): (0,0) (0,1) (1,0) (1,1)
    state runs    0 1 2 | 3 4 5 | pad          (layer 0, layer 1, padding)
    tiles         [0,2) [2,3) [3,4) [4,6) [6,8)
    tile [2,3):   state_off = delta + 0 * 12 + 2, slot_stride 3; page_off = delta_p + 1 * 20 + 0, block_stride 2,
                  j 0, length 1, pad 0
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

COLUMNS = 7  # state_off, slot_stride, page_off, block_stride, j, length, pad


@dataclass(frozen=True)
class Runs:
    """Equal runs of one tensor: `count` runs of `length` words; run i (i < count) of item x (a slot or a block)
    starts at `delta + i * run_stride + x * length` (run_stride: the words between two runs of one item)."""

    delta: int
    count: int
    length: int
    run_stride: int


def state_tiles(state_runs: Sequence[Runs], page_runs: Sequence[Runs], k: int, block: int) -> torch.Tensor:
    """The [T, COLUMNS] int64 tile table (module docstring) of a stream of `state_runs` (in stream order, the slot
    side) against `k` chunks of `page_runs` (in page order, the block side); tiles at most `block` words."""
    state = [(r.delta + i * r.run_stride, r.length) for r in state_runs for i in range(r.count)]
    pages = [(j, r.delta + i * r.run_stride, r.length) for j in range(k) for r in page_runs for i in range(r.count)]
    total_state = sum(length for _, length in state)
    total_pages = sum(length for _, _, length in pages)
    if total_state > total_pages:
        raise ValueError(f"a stream of {total_state} words does not fit in {k} pages of {total_pages // k} words")
    rows: list[tuple[int, ...]] = []
    s_index, s_used = 0, 0  # the state run holding the current position, and the words of it already tiled
    for j, page_off, page_len in pages:
        used = 0
        while used < page_len:
            if s_index < len(state):
                state_off, state_len = state[s_index]
                length = min(page_len - used, state_len - s_used, block)
                rows.append((state_off + s_used, state_len, page_off + used, page_len, j, length, 0))
                s_used += length
                if s_used == state_len:
                    s_index, s_used = s_index + 1, 0
            else:  # padding: the rest of the last chunk
                length = min(page_len - used, block)
                rows.append((0, 0, page_off + used, page_len, j, length, 1))
            used += length
    return torch.tensor(rows, dtype=torch.int64).reshape(-1, COLUMNS)


def group_runs(tensor: torch.Tensor, base: torch.Tensor, word: int) -> Runs:
    """A state group [layers, num_slots, *shape] as runs: one per layer, a slot's row each."""
    layers, num_slots = tensor.shape[:2]
    row = tensor[0, 0].numel() * tensor.element_size() // word
    return Runs(delta_words(tensor, base, word), layers, row, num_slots * row)


def page_group_runs(pages: torch.Tensor, base: torch.Tensor, word: int) -> Runs:
    """A page group viewed [rows, num_blocks, words of one block's row] as runs: one per row, a block's words."""
    rows, num_blocks, row = pages.shape
    return Runs(delta_words(pages, base, word), rows, row, num_blocks * row)


def delta_words(tensor: torch.Tensor, base: torch.Tensor, word: int) -> int:
    """`tensor`'s address minus `base`'s, in words (ValueError when it is not a whole number of words)."""
    delta = tensor.data_ptr() - base.data_ptr()
    if delta % word:
        raise ValueError(f"a pool lies {delta} bytes from the base: not a whole number of {word}-byte words")
    return delta // word
