"""The fused element-wise tails of the feed-forward blocks (`kernels/activation/triton.py`) against the torch
reference (`kernels/activation/reference.py`, the layers' eager expressions), on column views of a fused
projection's output as the layers pass them (rows `row_stride` apart), with a row count and widths that leave
partial column blocks (one and two programs per row).

- `test_cuda_*`: compiled on a CUDA device (skipped without one). fp32: 1e-6 relative (only the sigmoid's
  formula differs from torch's). bf16: the kernels round where torch rounds, so an element may differ from torch's
  by one bf16 step (2^-8 relative) where an fp32 intermediate falls near a rounding boundary: silu_mul rtol 2^-7;
  sigmoid_gate_add rounds three times (sigmoid, product, sum), whose terms may cancel: 2^-6 of
  |routed| + |sigmoid(gate) * shared| per element. relu_square rounds once, as torch does: equal bit for bit.
- `test_interpreted_*`: the same kernels on the CPU under TRITON_INTERPRET=1, in a child process
  (`test_activation_kernels_in_a_triton_interpreter_subprocess`); the interpreter truncates to bf16 rather than
  rounding, so every bf16 bound is doubled there.
"""

from __future__ import annotations

import pytest
import torch

from hybridcache.kernels.activation import reference
from tests.kernels.interpreter import interpreted_in_child, needs_cuda, needs_interpreter

DTYPES = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
SHAPES = pytest.mark.parametrize("rows, width", [(37, 300), (3, 1500), (1, 64)])
ULP = {torch.bfloat16: 2.0**-7, torch.float32: 1e-6}


def fused_outputs(rows: int, widths: list[int], dtype: torch.dtype, device: str, seed: int) -> list[torch.Tensor]:
    """Column views of one [rows, sum(widths)] tensor, as `FusedProjection` returns them (scale 3: sigmoid and
    silu see their curved range)."""
    gen = torch.Generator().manual_seed(seed)
    whole = (3 * torch.randn(rows, sum(widths), generator=gen)).to(device, dtype)
    return list(whole.split(widths, dim=-1))


def check_silu_mul(rows: int, width: int, dtype: torch.dtype, device: str, rtol: float, fp32_up: bool = False) -> None:
    """fp32_up: Mamba2's ungated output y * silu(z), y in fp32 (`silu_mul(z, y)`), the product rounded once."""
    from hybridcache.kernels.activation import triton as fused

    gate, up = fused_outputs(rows, [width, width], dtype, device, seed=rows + width)
    assert rows == 1 or not gate.is_contiguous()  # the layers' case: read in place through the row stride
    if fp32_up:
        up = 3 * torch.randn(rows, width, generator=torch.Generator().manual_seed(rows)).to(device)
    got = fused.silu_mul(gate, up)
    assert got.is_contiguous() and got.dtype == dtype
    torch.testing.assert_close(got, reference.silu_mul(gate, up), rtol=rtol, atol=rtol * 1e-2)


def check_sigmoid_gate_add(rows: int, width: int, dtype: torch.dtype, device: str, rtol: float) -> None:
    from hybridcache.kernels.activation import triton as fused

    _, gate = fused_outputs(rows, [24, 1], dtype, device, seed=rows)  # the router's logits, then the shared gate
    routed, shared = fused_outputs(rows, [width, width], dtype, device, seed=width)
    got = fused.sigmoid_gate_add(routed, gate, shared)
    assert got.is_contiguous() and got.dtype == dtype
    want = reference.sigmoid_gate_add(routed, gate, shared)
    # routed + p cancels: a step of p's rounding is relative to |routed| + |p|, not to the (maybe tiny) sum
    scale = routed.float().abs() + (torch.sigmoid(gate.float()) * shared.float()).abs()
    assert ((got.float() - want.float()).abs() <= rtol * scale).all(), (got - want).abs().max()


def check_relu_square(rows: int, width: int, dtype: torch.dtype, device: str, rtol: float) -> None:
    from hybridcache.kernels.activation import triton as fused

    _, x = fused_outputs(rows, [7, width], dtype, device, seed=rows * width)  # a column view, as up_proj's never is
    assert (x < 0).any() and (x > 0).any()
    got = fused.relu_square(x)
    assert got.is_contiguous() and got.dtype == dtype and got.shape == x.shape
    want = reference.relu_square(x)
    if rtol == 0:
        assert torch.equal(got, want), (got.float() - want.float()).abs().max()
    else:
        torch.testing.assert_close(got, want, rtol=rtol, atol=0)


@needs_cuda
@DTYPES
@SHAPES
def test_cuda_relu_square(rows: int, width: int, dtype: torch.dtype) -> None:
    check_relu_square(rows, width, dtype, "cuda", 0)


@needs_cuda
@DTYPES
@SHAPES
def test_cuda_silu_mul(rows: int, width: int, dtype: torch.dtype) -> None:
    check_silu_mul(rows, width, dtype, "cuda", ULP[dtype])


@needs_cuda
@SHAPES
def test_cuda_silu_mul_of_an_fp32_up(rows: int, width: int) -> None:
    check_silu_mul(rows, width, torch.bfloat16, "cuda", ULP[torch.bfloat16], fp32_up=True)


@needs_cuda
@DTYPES
@SHAPES
def test_cuda_sigmoid_gate_add(rows: int, width: int, dtype: torch.dtype) -> None:
    check_sigmoid_gate_add(rows, width, dtype, "cuda", 2 * ULP[dtype])


@needs_cuda
def test_cuda_empty_and_wrong_shapes() -> None:
    from hybridcache.kernels.activation import triton as fused

    empty = torch.empty(0, 64, device="cuda")
    assert fused.silu_mul(empty, empty).shape == (0, 64)
    with pytest.raises(ValueError, match=r"up must be \[4, 8\]"):
        fused.silu_mul(torch.zeros(4, 8, device="cuda"), torch.zeros(4, 9, device="cuda"))
    assert fused.relu_square(empty).shape == (0, 64)
    with pytest.raises(ValueError, match=r"x must be \[N, I\]"):
        fused.relu_square(torch.zeros(2, 4, 8, device="cuda"))
    with pytest.raises(ValueError, match=r"gate must be \[4, 1\]"):
        fused.sigmoid_gate_add(torch.zeros(4, 8, device="cuda"), torch.zeros(4, 2, device="cuda"),
                               torch.zeros(4, 8, device="cuda"))


@interpreted_in_child("test_interpreted_ and not subprocess")
def test_activation_kernels_in_a_triton_interpreter_subprocess() -> None:
    """This file's interpreted tests, in a child process (tests/kernels/interpreter.py)."""


@needs_interpreter
@DTYPES
@SHAPES
def test_interpreted_silu_mul(rows: int, width: int, dtype: torch.dtype) -> None:
    check_silu_mul(rows, width, dtype, "cpu", 2 * ULP[dtype])


@needs_interpreter
@SHAPES
def test_interpreted_silu_mul_of_an_fp32_up(rows: int, width: int) -> None:
    check_silu_mul(rows, width, torch.bfloat16, "cpu", 2 * ULP[torch.bfloat16], fp32_up=True)


@needs_interpreter
@DTYPES
@SHAPES
def test_interpreted_sigmoid_gate_add(rows: int, width: int, dtype: torch.dtype) -> None:
    check_sigmoid_gate_add(rows, width, dtype, "cpu", 4 * ULP[dtype])


@needs_interpreter
@DTYPES
@SHAPES
def test_interpreted_relu_square(rows: int, width: int, dtype: torch.dtype) -> None:
    check_relu_square(rows, width, dtype, "cpu", 2 * ULP[dtype])
