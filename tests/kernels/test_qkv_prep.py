"""`gated_delta/qkv_prep.qkv_prep`: q and k l2-normalised and v copied, in one launch, from head views of one conv
output row (as `_GatedDeltaNetBase._recur` passes them), against torch (`gated_delta.reference.l2norm` in fp32 and
v itself, bit for bit): under TRITON_INTERPRET=1 on the CPU (a child process, as tests/kernels/test_cuda_kernels.py
does) and compiled on CUDA, where q and k also equal `norm.triton.l2norm` bit for bit (the same tiles and math: fla's
rule then sees the very inputs it saw before)."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.interpreter import interpreted_in_child, needs_cuda, needs_interpreter


def _views(tokens: int, heads_k: int, heads_v: int, dim_k: int, dim_v: int, dtype: torch.dtype, device: str,
           seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v as head views of one [T, 2*Hk*Dk + Hv*Dv] tensor (the conv output's layout)."""
    gen = torch.Generator().manual_seed(seed)
    key = heads_k * dim_k
    conv_out = (3 * torch.randn(tokens, 2 * key + heads_v * dim_v, generator=gen)).to(device, dtype)
    return (conv_out[:, :key].view(tokens, heads_k, dim_k), conv_out[:, key:2 * key].view(tokens, heads_k, dim_k),
            conv_out[:, 2 * key:].view(tokens, heads_v, dim_v))


def check(tokens: int, heads: tuple[int, int], dims: tuple[int, int], dtype: torch.dtype, device: str) -> None:
    from hybridcache.kernels.gated_delta.qkv_prep import qkv_prep
    from hybridcache.kernels.gated_delta.reference import l2norm

    q, k, v = _views(tokens, *heads, *dims, dtype, device)
    qn, kn, vc = qkv_prep(q, k, v)
    for out in (qn, kn, vc):
        assert out.is_contiguous() and out.dtype == dtype
    assert torch.equal(vc, v)
    bound = 1e-6 if dtype == torch.float32 else 8e-3  # fp32: another summation order; bf16: one rounding
    for got, x in ((qn, q), (kn, k)):
        want = l2norm(x.float())
        assert (got.float() - want).abs().max().item() <= bound * want.abs().max().item()


@interpreted_in_child("interpreted")
def test_interpreter_in_subprocess() -> None:
    """This file's interpreted tests, in a child process (tests/kernels/interpreter.py)."""


@needs_interpreter
@pytest.mark.parametrize(("tokens", "heads", "dims"),
                         [(5, (2, 4), (16, 16)), (37, (3, 2), (32, 8)), (1, (1, 1), (20, 12))],
                         ids=["ratio2", "uneven", "padded"])
def test_interpreted_qkv_prep(tokens: int, heads: tuple[int, int], dims: tuple[int, int]) -> None:
    check(tokens, heads, dims, torch.float32, "cpu")


@needs_interpreter
def test_interpreted_bad_inputs_are_refused() -> None:
    from hybridcache.kernels.gated_delta.qkv_prep import qkv_prep

    q, k, v = _views(4, 2, 2, 16, 16, torch.float32, "cpu")
    with pytest.raises(ValueError, match="same T"):
        qkv_prep(q, k, v[:3])
    with pytest.raises(ValueError, match="share a dtype"):
        qkv_prep(q, k, v.double())
    with pytest.raises(ValueError, match="unit stride"):
        qkv_prep(q.transpose(1, 2), k.transpose(1, 2), v)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_cuda_qkv_prep_equals_l2norm_and_the_old_fla_call(dtype: torch.dtype) -> None:
    from hybridcache.kernels.gated_delta.qkv_prep import qkv_prep
    from hybridcache.kernels.norm.triton import l2norm

    for tokens in (1, 200, 1500):
        check(tokens, (16, 32), (128, 128), dtype, "cuda")  # next-1b's DeltaNet heads
        q, k, v = _views(tokens, 16, 32, 128, 128, dtype, "cuda")
        qn, kn, _ = qkv_prep(q, k, v)
        assert torch.equal(qn, l2norm(q)) and torch.equal(kn, l2norm(k))
