"""The shared expert's down projection inside the routed experts' down launch (`moe/triton_experts.expert_gemm(...,
shared=SharedDown)`, `moe/grouped.grouped_experts(..., shared=SharedExpert)`), and the expert GEMM's swap-AB tiles.

- The shared tiles: shared.out equals silu_mul(gate, up) W^T (torch in fp64 on the same rounded inputs: fp32 1e-5,
  bf16 2^-7 relative to sum |terms|, doubled in the interpreter), gate and up column views of one fused projection
  output as the MoE block passes them, token counts that fill part of a tile and several tiles; the routed rows of
  the same launch equal those of a launch without the shared tiles bit for bit.
- `grouped_experts` with a `SharedExpert`: on the Triton path the fused launch (the expert's own `down` is not
  called) gives the unfused result within the down GEMM's rounding; with no plain weight, or on the grouped-GEMM
  path (many rows per expert), the expert's `down` runs and the result is the unfused one bit for bit.
- swap-AB (weights as the MMA's A operand): the same products as the plain tile within fp32 rounding.
- The reference backend's `moe` with a `SharedExpert` is exactly its `moe` with `output()`.
`test_cuda_*` on a CUDA device; `test_interpreted_*` on the CPU under TRITON_INTERPRET=1 in a child process.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from hybridcache.kernels.activation import reference as activation_ref
from tests.kernels.interpreter import run_interpreted

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
needs_interpreter = pytest.mark.skipif(not INTERPRETED, reason="runs in the TRITON_INTERPRET=1 child")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
TOL = {torch.bfloat16: 2.0**-7, torch.float32: 1e-5}


def _experts(experts: int, hidden: int, inter: int, dtype: torch.dtype, device: str, gen: torch.Generator):
    from hybridcache.kernels.moe.grouped import ExpertWeights

    gate, up = ((torch.randn(experts, inter, hidden, generator=gen) / hidden**0.5).to(device, dtype)
                for _ in range(2))
    down = (torch.randn(experts, hidden, inter, generator=gen) / inter**0.5).to(device, dtype)
    return ExpertWeights.stack(list(gate), list(up), list(down))


def _shared_inputs(tokens: int, hidden: int, inner: int, dtype: torch.dtype, device: str, gen: torch.Generator):
    """gate, up [T, inner] as column views of one [T, 2 * inner + 3] output (the block's fused projection: the
    router's columns after them), the gate logit [T, 1] a column of it, and the down weight [hidden, inner]."""
    fused = (2 * torch.randn(tokens, 2 * inner + 3, generator=gen)).to(device, dtype)
    gate, up, logit = fused[:, :inner], fused[:, inner:2 * inner], fused[:, 2 * inner + 2:]
    weight = (torch.randn(hidden, inner, generator=gen) / inner**0.5).to(device, dtype)
    return gate, up, logit, weight


def _within(got: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, slack: float) -> None:
    terms = h.double()[:, None, :] * weight.double()[None, :, :]
    want, scale = terms.sum(-1), terms.abs().sum(-1)
    assert ((got.double() - want).abs() <= slack * TOL[got.dtype] * scale + 1e-30).all()


def check_shared_down(tokens: int, block_m: int, dtype: torch.dtype, device: str, slack: float) -> None:
    from hybridcache.kernels.moe.grouped import expert_rows_triton, sort_pairs
    from hybridcache.kernels.moe.triton_experts import SharedDown

    gen = torch.Generator().manual_seed(tokens * 7 + block_m)
    experts, top_k, hidden, inter, inner = 6, 2, 80, 48, 40
    stacked = _experts(experts, hidden, inter, dtype, device, gen)
    x = torch.randn(tokens, hidden, generator=gen).to(device, dtype)
    ids = torch.rand(tokens, experts, generator=gen).argsort(-1)[:, :top_k].to(device)
    order, counts = sort_pairs(ids, experts)
    gate, up, _, weight = _shared_inputs(tokens, hidden, inner, dtype, device, gen)
    out = torch.full((tokens, hidden), float("nan"), dtype=dtype, device=device)
    fused = expert_rows_triton(x, order, counts, top_k, stacked, block_m, SharedDown(gate, up, weight, out))
    plain = expert_rows_triton(x, order, counts, top_k, stacked, block_m)
    assert torch.equal(fused, plain)  # the shared tiles leave the routed rows alone
    _within(out, activation_ref.silu_mul(gate, up), weight, slack)


def check_grouped_with_shared_expert(tokens: int, dtype: torch.dtype, device: str, slack: float) -> None:
    from hybridcache.kernels.backend import SharedExpert
    from hybridcache.kernels.moe.grouped import grouped_experts, tile_rows

    gen = torch.Generator().manual_seed(tokens)
    experts, top_k, hidden, inter, inner = 4, 2, 64, 32, 32
    stacked = _experts(experts, hidden, inter, dtype, device, gen)
    x = torch.randn(tokens, hidden, generator=gen).to(device, dtype)
    weights = torch.rand(tokens, top_k, generator=gen).softmax(-1).to(device, dtype)
    ids = torch.rand(tokens, experts, generator=gen).argsort(-1)[:, :top_k].to(device)
    gate, up, logit, weight = _shared_inputs(tokens, hidden, inner, dtype, device, gen)
    calls = []

    def down() -> torch.Tensor:
        calls.append(1)
        return F.linear(activation_ref.silu_mul(gate, up), weight)

    unfused = grouped_experts(x, weights, ids, stacked, (logit, down()))
    calls.clear()
    got = grouped_experts(x, weights, ids, stacked, SharedExpert(logit, gate, up, weight, down))
    triton_path = tile_rows(tokens * top_k, experts) is not None
    assert len(calls) == (0 if triton_path else 1)
    if triton_path:  # the down GEMM's rounding, then the combine's (bf16: a few roundings of the output's scale)
        assert float((got.float() - unfused.float()).abs().max()) <= slack * 4 * TOL[dtype] * float(
            unfused.float().abs().max()) + 1e-30
    else:
        assert torch.equal(got, unfused)
    calls.clear()
    assert torch.equal(grouped_experts(x, weights, ids, stacked, SharedExpert(logit, gate, up, None, down)), unfused)
    assert len(calls) == 1  # no plain weight: the expert's own down projection


def check_swap_ab(dtype: torch.dtype, device: str) -> None:
    from hybridcache.kernels.moe.grouped import sort_pairs
    from hybridcache.kernels.moe.triton_experts import expert_gemm

    gen = torch.Generator().manual_seed(3)
    experts, top_k, hidden, inter, tokens = 5, 2, 96, 40, 19
    stacked = _experts(experts, hidden, inter, dtype, device, gen)
    x = torch.randn(tokens, hidden, generator=gen).to(device, dtype)
    ids = torch.rand(tokens, experts, generator=gen).argsort(-1)[:, :top_k].to(device)
    order, counts = sort_pairs(ids, experts)
    for gather, weights, a in ((True, stacked.gate_up, x), (False, stacked.down, None)):
        if a is None:
            a = torch.randn(tokens * top_k, inter, generator=gen).to(device, dtype)
        runs = [expert_gemm(a, order, top_k, weights, counts, gather=gather, scatter=not gather, swiglu=gather,
                            block_m=16, block_n=32, block_k=32, swap_ab=swap) for swap in (False, True)]
        scale = float(runs[0].float().abs().max())
        assert float((runs[1].float() - runs[0].float()).abs().max()) <= 4 * TOL[dtype] * scale


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize(("tokens", "block_m"), [(1, 16), (37, 16), (64, 32), (50, 64)])
def test_cuda_shared_down(tokens: int, block_m: int, dtype: torch.dtype) -> None:
    check_shared_down(tokens, block_m, dtype, "cuda", 1.0)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("tokens", [3, 64, 300])
def test_cuda_grouped_experts_with_the_shared_expert(tokens: int, dtype: torch.dtype) -> None:
    check_grouped_with_shared_expert(tokens, dtype, "cuda", 1.0)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_cuda_swap_ab(dtype: torch.dtype) -> None:
    check_swap_ab(dtype, "cuda")


@needs_interpreter
@pytest.mark.parametrize(("tokens", "block_m"), [(1, 16), (37, 16), (50, 32)])
def test_interpreted_shared_down(tokens: int, block_m: int) -> None:
    check_shared_down(tokens, block_m, torch.float32, "cpu", 2.0)


@needs_interpreter
def test_interpreted_grouped_experts_with_the_shared_expert() -> None:
    check_grouped_with_shared_expert(3, torch.float32, "cpu", 2.0)  # (the grouped-GEMM path needs fla: CUDA only)


@needs_interpreter
def test_interpreted_swap_ab() -> None:
    check_swap_ab(torch.float32, "cpu")


def test_shared_down_in_a_triton_interpreter_subprocess() -> None:
    pytest.importorskip("triton")
    run_interpreted(__file__, "interpreted")


def test_shared_down_refuses_misshapen_inputs() -> None:
    pytest.importorskip("triton")
    from hybridcache.kernels.moe.triton_experts import SharedDown

    gate = torch.zeros(4, 8)
    with pytest.raises(ValueError, match="SharedDown"):
        SharedDown(gate, gate, torch.zeros(16, 8), torch.zeros(4, 12)).check(16, torch.float32)
    with pytest.raises(ValueError, match="SharedDown"):
        SharedDown(gate, gate, torch.zeros(16, 8, dtype=torch.bfloat16), torch.zeros(4, 16)).check(16, torch.float32)
    SharedDown(gate, gate, torch.zeros(16, 8), torch.zeros(4, 16)).check(16, torch.float32)


def test_reference_moe_with_a_shared_expert_is_its_output() -> None:
    from hybridcache.kernels.backend import ReferenceBackend, SharedExpert

    gen = torch.Generator().manual_seed(0)
    tokens, hidden, inner, experts = 5, 16, 8, 4
    modules = torch.nn.ModuleList()
    for _ in range(experts):
        expert = torch.nn.Module()
        expert.gate_proj = torch.nn.Linear(hidden, 6, bias=False)
        expert.up_proj = torch.nn.Linear(hidden, 6, bias=False)
        expert.down_proj = torch.nn.Linear(6, hidden, bias=False)
        modules.append(expert)
    x = torch.randn(tokens, hidden, generator=gen)
    weights = torch.rand(tokens, 2, generator=gen).softmax(-1)
    ids = torch.rand(tokens, experts, generator=gen).argsort(-1)[:, :2]
    gate, up, logit, weight = _shared_inputs(tokens, hidden, inner, torch.float32, "cpu", gen)
    shared = SharedExpert(logit, gate, up, weight, lambda: F.linear(activation_ref.silu_mul(gate, up), weight))
    backend = ReferenceBackend()
    assert torch.equal(backend.moe(x, weights, ids, modules, shared), backend.moe(x, weights, ids, modules,
                                                                                  shared.output()))
