"""The expert GEMM's TMA weight tiles (`moe/triton_experts.expert_gemm(..., swap_ab=True, tma=True)`: the stacked
weights read through one descriptor of [E * N_w, K]).

- The same products as the pointer-load swap-AB launch (fp32: 1e-5 of the output's max, bf16: the same rounding
  up to 2^-6), for the gate/up GEMM (gather, SiLU gate) and the down GEMM (scatter), with N not a multiple of the
  column tile (a tile's last rows read the up half or the next expert's rows, never stored) and a short last depth
  tile.
- A launch it cannot take (plain tiles, weights that are not contiguous) is refused before it starts.
`test_cuda_*` on a CUDA device; `test_interpreted_*` on the CPU under TRITON_INTERPRET=1 in a child process.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.interpreter import needs_cuda, needs_interpreter, run_interpreted

TOL = {torch.bfloat16: 2.0**-6, torch.float32: 1e-5}


def check_tma(dtype: torch.dtype, device: str, experts: int = 5, top_k: int = 2, hidden: int = 96, inter: int = 40,
              tokens: int = 19, block_m: int = 16, block_n: int = 32, block_k: int = 32) -> None:
    from hybridcache.kernels.moe.grouped import ExpertWeights, sort_pairs
    from hybridcache.kernels.moe.triton_experts import expert_gemm

    gen = torch.Generator().manual_seed(7)
    gate, up = ((torch.randn(experts, inter, hidden, generator=gen) / hidden**0.5).to(device, dtype)
                for _ in range(2))
    down = (torch.randn(experts, hidden, inter, generator=gen) / inter**0.5).to(device, dtype)
    stacked = ExpertWeights.stack(list(gate), list(up), list(down))
    x = torch.randn(tokens, hidden, generator=gen).to(device, dtype)
    h = torch.randn(tokens * top_k, inter, generator=gen).to(device, dtype)
    ids = torch.rand(tokens, experts, generator=gen).argsort(-1)[:, :top_k].to(device)
    order, counts = sort_pairs(ids, experts)
    for gather, weights, a in ((True, stacked.gate_up, x), (False, stacked.down, h)):
        runs = [expert_gemm(a, order, top_k, weights, counts, gather=gather, scatter=not gather, swiglu=gather,
                            block_m=block_m, block_n=block_n, block_k=block_k, swap_ab=True, tma=tma)
                for tma in (False, True)]
        scale = float(runs[0].float().abs().max())
        assert float((runs[1].float() - runs[0].float()).abs().max()) <= TOL[dtype] * scale, (gather, dtype)


def test_tma_refuses_what_it_cannot_launch() -> None:
    pytest.importorskip("triton")
    from hybridcache.kernels.moe.triton_experts import expert_gemm

    a, order, counts = torch.zeros(4, 64), torch.arange(4), torch.tensor([4], dtype=torch.int32)
    with pytest.raises(ValueError, match="tma needs swap_ab"):
        expert_gemm(a, order, 1, torch.zeros(1, 32, 64), counts, gather=True, scatter=False, swiglu=False,
                    block_m=16, tma=True)
    with pytest.raises(ValueError, match="tma needs swap_ab"):
        expert_gemm(a, order, 1, torch.zeros(1, 32, 128)[:, :, :64], counts, gather=True, scatter=False,
                    swiglu=False, block_m=16, swap_ab=True, tma=True)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_cuda_expert_tma(dtype: torch.dtype) -> None:
    check_tma(dtype, "cuda")
    if dtype == torch.bfloat16:  # next-1b's experts at a 64-sequence step, its measured tiles
        check_tma(dtype, "cuda", experts=16, top_k=4, hidden=2048, inter=512, tokens=64, block_m=32, block_n=64,
                  block_k=64)


@needs_interpreter
def test_interpreted_expert_tma() -> None:
    check_tma(torch.float32, "cpu")


def test_expert_tma_in_a_triton_interpreter_subprocess() -> None:
    pytest.importorskip("triton")
    run_interpreted(__file__, "interpreted")
