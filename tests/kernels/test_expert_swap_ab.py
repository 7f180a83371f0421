"""The expert GEMM's swap-AB tiles (`moe/triton_experts.expert_gemm(..., swap_ab=True)`: the weight tile as the MMA's
A operand) and the measured launch per shape (`moe/grouped.launch_tile`).

- swap-AB gives the plain tile's products within rounding (fp32 1e-5, bf16 2^-6 of the output's max), for the
  gate/up GEMM (gather, SiLU gate) and the down GEMM (scatter), partial column and depth tiles included.
- `launch_tile` picks `MEASURED_TILES`' launch for next-1b's experts at 32-row tiles and the default elsewhere;
  `expert_rows_triton` with those launches equals the default launches within rounding.
`test_cuda_*` on a CUDA device; `test_interpreted_*` on the CPU under TRITON_INTERPRET=1 in a child process.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.interpreter import interpreted_in_child, needs_cuda, needs_interpreter

TOL = {torch.bfloat16: 2.0**-6, torch.float32: 1e-5}


def _experts(experts: int, hidden: int, inter: int, dtype: torch.dtype, device: str, gen: torch.Generator):
    from hybridcache.kernels.moe.grouped import ExpertWeights

    gate, up = ((torch.randn(experts, inter, hidden, generator=gen) / hidden**0.5).to(device, dtype)
                for _ in range(2))
    down = (torch.randn(experts, hidden, inter, generator=gen) / inter**0.5).to(device, dtype)
    return ExpertWeights.stack(list(gate), list(up), list(down))


def check_swap_ab(dtype: torch.dtype, device: str) -> None:
    from hybridcache.kernels.moe.grouped import sort_pairs
    from hybridcache.kernels.moe.triton_experts import expert_gemm

    gen = torch.Generator().manual_seed(3)
    experts, top_k, hidden, inter, tokens = 5, 2, 96, 40, 19
    stacked = _experts(experts, hidden, inter, dtype, device, gen)
    x = torch.randn(tokens, hidden, generator=gen).to(device, dtype)
    h = torch.randn(tokens * top_k, inter, generator=gen).to(device, dtype)
    ids = torch.rand(tokens, experts, generator=gen).argsort(-1)[:, :top_k].to(device)
    order, counts = sort_pairs(ids, experts)
    for gather, weights, a in ((True, stacked.gate_up, x), (False, stacked.down, h)):
        runs = [expert_gemm(a, order, top_k, weights, counts, gather=gather, scatter=not gather, swiglu=gather,
                            block_m=16, block_n=32, block_k=32, swap_ab=swap) for swap in (False, True)]
        scale = float(runs[0].float().abs().max())
        assert float((runs[1].float() - runs[0].float()).abs().max()) <= TOL[dtype] * scale


def check_measured_launches(dtype: torch.dtype, device: str) -> None:
    from hybridcache.kernels.moe.grouped import DEFAULT_TILE, expert_rows_triton, sort_pairs

    gen = torch.Generator().manual_seed(5)
    experts, top_k, hidden, inter, tokens = 16, 4, 2048, 512, 64  # next-1b's experts at a 64-sequence step
    stacked = _experts(experts, hidden, inter, dtype, device, gen)
    x = torch.randn(tokens, hidden, generator=gen).to(device, dtype)
    ids = torch.rand(tokens, experts, generator=gen).argsort(-1)[:, :top_k].to(device)
    order, counts = sort_pairs(ids, experts)
    measured = expert_rows_triton(x, order, counts, top_k, stacked, 32)
    default = expert_rows_triton(x, order, counts, top_k, stacked, 32, **DEFAULT_TILE)
    scale = float(default.float().abs().max())
    assert float((measured.float() - default.float()).abs().max()) <= 2 * TOL[dtype] * scale


def test_launch_tile_picks_the_measured_launches() -> None:
    from hybridcache.kernels.moe.grouped import DEFAULT_TILE, MEASURED_TILES, launch_tile

    gate_up, down = torch.empty(16, 1024, 2048, device="meta"), torch.empty(16, 2048, 512, device="meta")
    assert launch_tile(gate_up, 32) == MEASURED_TILES[(1024, 2048, 32)] and launch_tile(gate_up, 32)["swap_ab"]
    assert launch_tile(down, 32) == MEASURED_TILES[(2048, 512, 32)]
    assert launch_tile(gate_up, 16) == launch_tile(down, 64) == DEFAULT_TILE  # other tile rows: unmeasured
    assert launch_tile(torch.empty(32, 2048, 4096, device="meta"), 32) == DEFAULT_TILE  # next-16b's gate/up


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_cuda_swap_ab(dtype: torch.dtype) -> None:
    check_swap_ab(dtype, "cuda")


@needs_cuda
def test_cuda_measured_launches_equal_the_default_within_rounding() -> None:
    check_measured_launches(torch.bfloat16, "cuda")


@needs_interpreter
def test_interpreted_swap_ab() -> None:
    check_swap_ab(torch.float32, "cpu")


@interpreted_in_child("interpreted")
def test_swap_ab_in_a_triton_interpreter_subprocess() -> None:
    """This file's interpreted tests, in a child process (tests/kernels/interpreter.py)."""
