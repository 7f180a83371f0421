"""FusedProjection: one GEMM for several projections, one copy of the weights (layers/fused.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hybridcache.layers.fused import FusedProjection


def _linears(bias: tuple[bool, ...] = (False, True, False)) -> list[nn.Linear]:
    torch.manual_seed(0)
    return [nn.Linear(24, size, bias=b) for size, b in zip((16, 8, 3), bias, strict=True)]


def test_outputs_equal_the_separate_projections() -> None:
    linears = _linears()
    x = torch.randn(5, 24)
    expected = [linear(x) for linear in linears]
    outputs = FusedProjection(*linears)(x)
    assert [o.shape for o in outputs] == [(5, 16), (5, 8), (5, 3)]
    for out, ref in zip(outputs, expected, strict=True):
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)


def test_one_copy_of_the_weights_and_the_state_dict_unchanged() -> None:
    linears = _linears()
    layer = nn.ModuleList(linears)
    keys = sorted(layer.state_dict())
    fused = FusedProjection(*linears)
    fused(torch.randn(2, 24))
    base = fused.weight.untyped_storage().data_ptr()
    assert all(linear.weight.untyped_storage().data_ptr() == base for linear in linears)
    assert sorted(layer.state_dict()) == keys
    with torch.no_grad():  # an in-place write through the module is what the fused GEMM reads
        linears[1].weight.mul_(2.0)
    x = torch.randn(3, 24)
    torch.testing.assert_close(fused(x)[1], linears[1](x), rtol=1e-6, atol=1e-6)


def test_replaced_weights_are_fused_again() -> None:
    linears = _linears()
    fused = FusedProjection(*linears)
    x = torch.randn(4, 24)
    fused(x)
    with torch.no_grad():
        linears[0].weight.data = torch.randn(16, 24)  # a new storage, as a loader or .to() would give
    torch.testing.assert_close(fused(x)[0], linears[0](x), rtol=1e-6, atol=1e-6)
    nn.ModuleList(linears).to(torch.float64)
    outputs = fused(x.double())
    assert outputs[2].dtype == torch.float64
    torch.testing.assert_close(outputs[1], linears[1](x.double()))


def test_first_call_in_inference_mode_leaves_ordinary_parameters() -> None:
    linears = _linears(bias=(True, True, True))
    fused = FusedProjection(*linears)
    with torch.inference_mode():
        fused(torch.randn(2, 24))
    assert not any(linear.weight.is_inference() for linear in linears)
    out = linears[0](torch.randn(2, 24, requires_grad=True)).sum()
    out.backward()  # usable outside inference mode afterwards


def test_rejects_mismatched_inputs() -> None:
    with pytest.raises(ValueError, match="one size"):
        FusedProjection(nn.Linear(4, 2), nn.Linear(5, 2))
    with pytest.raises(ValueError, match="at least two"):
        FusedProjection(nn.Linear(4, 2))


def test_fused_rows_are_padded_to_aligned_rows() -> None:
    """16 + 8 + 3 = 27 outputs: the fused weight (and bias) gets 5 zero rows, so each output row of the one GEMM
    starts 32 elements after the last (cuBLAS's Hopper kernels need 16-byte aligned rows); the views stop at 27."""
    linears = _linears(bias=(True, False, True))
    fused = FusedProjection(*linears)
    x = torch.randn(5, 24)
    outputs = fused(x)
    assert fused.weight.shape == (32, 24) and fused.bias.shape == (32,)
    assert torch.count_nonzero(fused.weight[27:]) == 0 and torch.count_nonzero(fused.bias[27:]) == 0
    assert [o.shape for o in outputs] == [(5, 16), (5, 8), (5, 3)]
    assert all(o.stride(0) == 32 for o in outputs)
    for out, linear in zip(outputs, linears, strict=True):
        torch.testing.assert_close(out, linear(x), rtol=1e-6, atol=1e-6)
    aligned = [nn.Linear(24, 8), nn.Linear(24, 16)]
    fused_aligned = FusedProjection(*aligned)
    fused_aligned(x)
    assert fused_aligned.weight.shape == (24, 24)


def test_groups_give_consecutive_projections_as_one_view() -> None:
    """groups=(2, 1): the first two projections' columns side by side in one view of the fused output (OLMo Hybrid's
    conv input q | k | v without a copy); wrong counts are refused."""
    linears = _linears()
    x = torch.randn(5, 24)
    first, last = FusedProjection(*linears, groups=(2, 1))(x)
    assert first.shape == (5, 24) and last.shape == (5, 3)
    assert first.untyped_storage().data_ptr() == last.untyped_storage().data_ptr()
    torch.testing.assert_close(first, torch.cat([linears[0](x), linears[1](x)], dim=-1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(last, linears[2](x), rtol=1e-6, atol=1e-6)
    for groups in ((2, 2), (3, 0), (1, 1)):
        with pytest.raises(ValueError, match="groups"):
            FusedProjection(*linears, groups=groups)
