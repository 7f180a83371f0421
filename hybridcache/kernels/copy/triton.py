"""The Triton kernel behind `copy_blocks`: one launch copies every pair of a plan.

The pool is reinterpreted as a flat array of the widest integer "word" (8, 4, 2 or 1 bytes) that divides
a page row and the pool's address, so any dtype is copied bit for bit. In words, a pool is
`[num_outer, num_pages * page_words]` and block `b` of outer row `o` is the contiguous run
`o * outer_stride + b * block_words + [0, block_words)`, `block_words = pages_per_block * page_words`.

Grid (2-D)::

    axis 0: num_pairs * num_chunks programs; program p copies chunk (p % num_chunks) of pair
            (p // num_chunks): words [chunk * BLOCK, chunk * BLOCK + BLOCK) of the block, masked at its end
    axis 1: grid_1 = the largest divisor of num_outer that is <= 65535 (num_outer itself in practice);
            program r copies outer rows r, r + grid_1, ..., num_outer / grid_1 rows

Use it through `hybridcache.kernels.copy.block_copy`, which checks the arguments; set TRITON_INTERPRET=1 before
this module is imported to run it on CPU tensors.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import triton
import triton.language as tl

from hybridcache.kernels.copy.geometry import PoolGeometry

_WORD_DTYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
_TILE_BYTES = 16 << 10
_MAX_GRID_1 = 65535
_MAX_GRID_0 = 2**31 - 1


@triton.jit
def _copy_blocks_kernel(
    words_ptr,
    src_ids_ptr,
    dst_ids_ptr,
    outer_stride,
    block_words,
    num_chunks,
    num_row_programs,
    BLOCK: tl.constexpr,
    ROWS_PER_PROGRAM: tl.constexpr,
):
    pid = tl.program_id(0)
    pair = pid // num_chunks
    chunk = pid % num_chunks
    src = tl.load(src_ids_ptr + pair).to(tl.int64)
    dst = tl.load(dst_ids_ptr + pair).to(tl.int64)
    offsets = chunk.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < block_words
    src_offsets = src * block_words + offsets
    dst_offsets = dst * block_words + offsets
    row = tl.program_id(1).to(tl.int64)
    # ROWS_PER_PROGRAM * num_row_programs == num_outer exactly. The bound is a constexpr (1 unless
    # num_outer > 65535): Triton 3.6's interpreter with NumPy >= 2.4 fails on runtime loop bounds.
    for _ in range(ROWS_PER_PROGRAM):
        base = row * outer_stride
        words = tl.load(words_ptr + base + src_offsets, mask=mask)
        tl.store(words_ptr + base + dst_offsets, words, mask=mask)
        row += num_row_programs


def word_size(pool: torch.Tensor, page_bytes: int) -> int:
    """The widest word (bytes) dividing both a page row's bytes and the pool's address."""
    for size in (8, 4, 2):
        if page_bytes % size == 0 and pool.data_ptr() % size == 0:
            return size
    return 1


def _num_row_programs(num_outer: int) -> int:
    """The largest divisor of `num_outer` that fits in grid axis 1."""
    if num_outer <= _MAX_GRID_1:
        return num_outer
    return next(d for d in range(_MAX_GRID_1, 0, -1) if num_outer % d == 0)


def launch_copy_blocks(
    pool: torch.Tensor, src_ids: torch.Tensor, dst_ids: torch.Tensor, geometry: PoolGeometry
) -> None:
    """One kernel launch copying block `src_ids[i]` onto `dst_ids[i]` in every outer row of `pool`.

    pool: contiguous, viewed as [num_outer, num_pages, page_numel] by `geometry`; src_ids, dst_ids: [N]
    int32/int64 on the pool's device, N >= 1, already checked by `geometry.check_copy_args`.
    """
    word = word_size(pool, geometry.page_bytes)
    words = pool.view(-1).view(_WORD_DTYPES[word])
    page_words = geometry.page_bytes // word
    block_words = geometry.pages_per_block * page_words
    tile = min(_TILE_BYTES // word, triton.next_power_of_2(block_words))
    num_chunks = triton.cdiv(block_words, tile)
    num_pairs = src_ids.numel()
    if num_pairs * num_chunks > _MAX_GRID_0:
        raise ValueError(f"{num_pairs} pairs x {num_chunks} chunks exceed the launch grid; split the plan")
    num_row_programs = _num_row_programs(geometry.num_outer)
    grid = (num_pairs * num_chunks, num_row_programs)
    num_warps = 4 if tile * word >= 4096 else 1
    with torch.cuda.device(pool.device) if pool.device.type == "cuda" else nullcontext():
        _copy_blocks_kernel[grid](
            words,
            src_ids.contiguous(),
            dst_ids.contiguous(),
            geometry.num_pages * page_words,
            block_words,
            num_chunks,
            num_row_programs,
            BLOCK=tile,
            ROWS_PER_PROGRAM=geometry.num_outer // num_row_programs,
            num_warps=num_warps,
        )

