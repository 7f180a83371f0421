"""Greedy tokens on CUDA (Triton): the argmax of each row of the logits in two launches, reading them once.

torch's `argmax` over fp32 logits [64, 248,320] takes two kernels of ~35 us each on an H200 (docs/bench.md,
issue 32's dense-9b profile), about four times what reading the 64 MB takes. Here:

    stage 1, grid (rows, SPLITS):  program (r, s) scans columns [s * span, (s + 1) * span) of row r, BLOCK at a
                                   time, keeping per lane the largest value met and its first column; then reduces
                                   its lanes to one (value, column) pair -> partial[r, s]
    stage 2, grid (rows,):         row r's SPLITS pairs -> its token

The result is torch.argmax's: the first column of the row's largest value, where NaN counts as larger than every
number (the first NaN wins). Values are compared in fp32, which holds every bf16 / fp16 value exactly.
`rows` is not specialised on (a batch of 1, 16 or 64 rows runs the one compiled variant the warm-up made).
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from hybridcache.kernels import pdl

# The launch: 8 programs per row (512 at a 64-row step) scanning 4,096 columns a step, the fastest of five on the
# H200 (64 x 248,320 fp32: 20.7 us against torch.argmax's 32.2 and the sampler's former copy + argmax 65.0;
# docs/bench.md, issue 32's sixth pass)
_BLOCK = 4096  # columns per loop step of a stage-1 program
_SPLITS = 8  # stage-1 programs per row
_NONE = tl.constexpr(2147483647)  # the column of a lane or split that met no column (loses every comparison)


@triton.jit
def _wins(value, column, other_value, other_column):
    """(value, column) beats (other_value, other_column) in torch.argmax's order: larger (NaN largest), then the
    smaller column."""
    nan, other_nan = value != value, other_value != other_value
    larger = (value > other_value) | (nan & ~other_nan)
    same = (value == other_value) | (nan & other_nan)
    return larger | (same & (column < other_column))


@triton.jit
def _pick(value, column, other_value, other_column):  # tl.reduce's combine: the winner of two pairs
    first = _wins(value, column, other_value, other_column)
    return tl.where(first, value, other_value), tl.where(first, column, other_column)


@triton.jit(do_not_specialize=["num_rows"])
def _argmax_partial_kernel(x_ptr, value_ptr, column_ptr, num_rows, num_cols, stride_row, span,
                           SPLITS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl.start(PDL)
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    lanes = tl.arange(0, BLOCK)
    start = split * span
    stop = tl.minimum(start + span, num_cols)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_column = tl.full([BLOCK], _NONE, tl.int32)  # _NONE: the lane has met no column yet
    for offset in range(start, stop, BLOCK):  # each lane meets its columns in increasing order: a strict > keeps
        columns = offset + lanes  # the first of equal values
        valid = columns < stop
        x = tl.load(x_ptr + row * stride_row + columns, mask=valid, other=float("-inf")).to(tl.float32)
        better = valid & ((x > best) | ((x != x) & (best == best)) | (best_column == _NONE))
        best = tl.where(better, x, best)
        best_column = tl.where(better, columns, best_column)
    value, column = tl.reduce((best, best_column), 0, _pick)
    tl.store(value_ptr + row * SPLITS + split, value)
    tl.store(column_ptr + row * SPLITS + split, column)


@triton.jit(do_not_specialize=["num_rows"])
def _argmax_final_kernel(value_ptr, column_ptr, out_ptr, num_rows, SPLITS: tl.constexpr, PDL: tl.constexpr):
    pdl.start(PDL)
    row = tl.program_id(0).to(tl.int64)
    splits = tl.arange(0, SPLITS)
    values = tl.load(value_ptr + row * SPLITS + splits)
    columns = tl.load(column_ptr + row * SPLITS + splits)
    _, column = tl.reduce((values, columns), 0, _pick)
    tl.store(out_ptr + row, column.to(tl.int64))


def argmax_rows(x: torch.Tensor, *, splits: int = _SPLITS, block: int = _BLOCK) -> torch.Tensor:
    """x [rows, cols] (unit stride on the last dim; fp32, bf16 or fp16) -> [rows] int64: torch.argmax(x, dim=-1)
    (module docstring). `splits` and `block` (powers of two) are the launch's shape; the defaults are what the
    engine runs (any other value compiles another variant)."""
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"argmax_rows takes [rows, cols] with unit column stride, got {tuple(x.shape)} "
                         f"strides {x.stride()}")
    num_rows, num_cols = x.shape
    out = torch.empty(num_rows, dtype=torch.int64, device=x.device)
    if num_rows == 0:
        return out
    if num_cols == 0:
        raise ValueError("argmax_rows of rows with no columns")
    values = torch.empty(num_rows, splits, dtype=torch.float32, device=x.device)
    columns = torch.empty(num_rows, splits, dtype=torch.int32, device=x.device)
    span = triton.cdiv(triton.cdiv(num_cols, splits), block) * block  # whole blocks, so lanes stay aligned
    with torch.cuda.device(x.device) if x.device.type == "cuda" else contextlib.nullcontext():
        _argmax_partial_kernel[(num_rows, splits)](x, values, columns, num_rows, num_cols, x.stride(0), span,
                                                   SPLITS=splits, BLOCK=block, **pdl.options(x))
        _argmax_final_kernel[(num_rows,)](values, columns, out, num_rows, SPLITS=splits, **pdl.options(values))
    return out
