"""Greedy tokens on the device (`kernels/sampling/triton_argmax.py`) against torch.argmax, which they must equal
exactly: the first column of each row's largest value, NaN larger than every number.

Rows cover ties across lanes, blocks and splits (the first column must win wherever its equal sits), rows of -inf
only, NaNs (the first NaN wins, also over +inf), spans that leave splits empty (few columns, many splits), bf16 and
fp32 inputs, odd row and column counts, a strided row view. `test_cuda_*`: compiled on a CUDA device (skipped
without one); `test_interpreted_*`: the same checks under TRITON_INTERPRET=1 in a child process
(`test_greedy_argmax_in_a_triton_interpreter_subprocess`). The sampler's use of it (`sampling.sample_async`'s
all-greedy path) is checked in tests/engine/test_sampling.py.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.interpreter import interpreted_in_child, needs_cuda, needs_interpreter

DTYPES = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
# (rows, columns, splits, block): the engine's launch (8 x 4,096) on a vocabulary of odd size; small launches
# that put ties in other lanes, blocks and splits; more splits than whole blocks (empty splits)
# (the interpreter runs the small ones: it takes seconds per launch)
SMALL = [(5, 1000, 4, 64), (6, 333, 8, 16), (6, 40, 16, 16)]
SHAPES = pytest.mark.parametrize(("rows", "cols", "splits", "block"), [(7, 50003, 8, 4096), *SMALL],
                                 ids=["engine", "4x64", "8x16", "empty"])
SMALL_SHAPES = pytest.mark.parametrize(("rows", "cols", "splits", "block"), SMALL, ids=["4x64", "8x16", "empty"])


def logits_with_edge_rows(rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """Random rows (values rounded to a few levels, so ties are many), then: a tie of the row's maximum in the
    first and last column; a row of -inf; NaNs after a +inf; a constant row."""
    gen = torch.Generator().manual_seed(rows * 1000 + cols)
    x = (torch.randn(rows, cols, generator=gen) * 2).round() / 2
    x[0, 0] = x[0, cols - 1] = x[0].max() + 1
    x[1] = float("-inf")
    x[2, 1] = float("inf")
    x[2, cols // 2] = x[2, cols - 1] = float("nan")
    x[3] = 0.25
    x[4, cols - 1] = x[4].max() + 1  # the maximum in the last column
    return x.to(dtype)


def check_argmax(rows: int, cols: int, splits: int, block: int, dtype: torch.dtype, device: str) -> None:
    from hybridcache.kernels.sampling.triton_argmax import argmax_rows

    x = logits_with_edge_rows(rows, cols, dtype).to(device)
    want = x.cpu().float().argmax(dim=-1)
    assert want[:5].tolist() == [0, 0, cols // 2, 0, cols - 1]  # torch's own rule, which the kernel must follow
    got = argmax_rows(x, splits=splits, block=block)
    assert got.dtype == torch.int64 and got.device.type == torch.device(device).type
    assert torch.equal(got.cpu(), want)
    wide = torch.zeros(rows, cols + 9, dtype=dtype, device=device)  # rows of a wider buffer: stride != cols
    wide[:, :cols] = x
    assert torch.equal(argmax_rows(wide[:, :cols], splits=splits, block=block).cpu(), want)


@needs_cuda
@DTYPES
@SHAPES
def test_cuda_argmax_rows_is_torch_argmax(rows: int, cols: int, splits: int, block: int, dtype: torch.dtype) -> None:
    check_argmax(rows, cols, splits, block, dtype, "cuda")


@needs_cuda
def test_cuda_argmax_rows_at_a_decode_batch_and_in_a_graph() -> None:
    """64 rows of a 248,320-word vocabulary (dense-9b's decode step), random fp32 logits; then replayed in a CUDA
    graph on new logits written into the captured buffer; no rows at all."""
    from hybridcache.kernels.sampling.triton_argmax import argmax_rows

    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(64, 248320, device="cuda", generator=gen)
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = argmax_rows(x)
    x.copy_(torch.randn(64, 248320, device="cuda", generator=gen))
    graph.replay()
    assert torch.equal(out, x.argmax(dim=-1))
    assert argmax_rows(x[:0]).shape == (0,)


@interpreted_in_child("test_interpreted_ and not subprocess")
def test_greedy_argmax_in_a_triton_interpreter_subprocess() -> None:
    """This file's interpreted tests, in a child process (tests/kernels/interpreter.py)."""


@needs_interpreter
@DTYPES
@SMALL_SHAPES
def test_interpreted_argmax_rows_is_torch_argmax(rows: int, cols: int, splits: int, block: int,
                                                 dtype: torch.dtype) -> None:
    check_argmax(rows, cols, splits, block, dtype, "cpu")


@needs_interpreter
def test_interpreted_argmax_rows_refuses_what_it_cannot_read() -> None:
    from hybridcache.kernels.sampling.triton_argmax import argmax_rows

    with pytest.raises(ValueError, match="unit column stride"):
        argmax_rows(torch.zeros(4, 8).t())
    with pytest.raises(ValueError, match="unit column stride"):
        argmax_rows(torch.zeros(8))
    with pytest.raises(ValueError, match="no columns"):
        argmax_rows(torch.zeros(3, 0))
    assert argmax_rows(torch.zeros(0, 8)).shape == (0,)
