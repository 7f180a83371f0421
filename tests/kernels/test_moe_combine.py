"""The MoE combine with the shared expert's gated add in the same launch (`moe/triton_experts.combine(...,
shared=(gate, shared))`, what a Qwen3-Next MoE block's decode step runs; `shared=(None, shared)`, Granite's ungated
shared MLP, the same way with `routed + shared`) against the two launches it replaces
(`combine`, then `activation.sigmoid_gate_add`: the same roundings, so the same bits) and against torch (each
pick's weighted row summed in fp64, then the reference `sigmoid_gate_add`).

Cases: pair order and sorted order (`pos`), 5 and 37 tokens, top-3 and top-4, a hidden size of 200 (a partial
column block) and 1,500 (two programs per token), the gate a column of a router's fused [T, E + 1] output (rows
E + 1 apart, as the layer passes it), bf16 and fp32.
- `test_cuda_*`: on a CUDA device (skipped without one); `test_interpreted_*`: on the CPU under TRITON_INTERPRET=1,
  in a child process (`test_moe_combine_in_a_triton_interpreter_subprocess`).
- Against torch: fp32 1e-5 relative to sum_j |w_j y_j| + |sigmoid(gate) * shared| (the sum's order, the sigmoid's
  formula; relative to the sum's terms, not to the sum, which may cancel); bf16 three roundings (the routed sum,
  the product, the total): 2^-6 of that scale (doubled in the interpreter, which truncates).
- The backends: `ReferenceBackend.moe(..., shared)` is its routed experts then `sigmoid_gate_add`, exactly.

The combine's mirror on the grouped path, `spread` (each token row written to its k sorted rows), equals the gather
it replaces, `x.index_select(0, order // k)`, bit for bit: top-1, top-3 and top-8, repeated picks, x a column view
of a wider tensor, one and several column blocks per token.
"""

from __future__ import annotations

import pytest
import torch

from hybridcache.kernels.activation import reference as activation_ref
from tests.kernels.interpreter import interpreted_in_child, needs_cuda, needs_interpreter

DTYPES = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
CASES = pytest.mark.parametrize(("tokens", "top_k", "hidden", "sorted_rows"),
                                [(5, 3, 200, False), (37, 4, 1500, True), (5, 4, 1500, False), (37, 3, 200, True)])
TOL = {torch.bfloat16: 2.0**-6, torch.float32: 1e-5}


def check_combine_shared(tokens: int, top_k: int, hidden: int, sorted_rows: bool, dtype: torch.dtype,
                         device: str, slack: float) -> None:
    from hybridcache.kernels.activation import triton as activation
    from hybridcache.kernels.moe.triton_experts import combine

    gen = torch.Generator().manual_seed(tokens * top_k + hidden)
    y = torch.randn(tokens * top_k, hidden, generator=gen).to(device, dtype)
    weights = torch.rand(tokens, top_k, generator=gen).softmax(-1).to(device, dtype)
    router = (3 * torch.randn(tokens, 9, generator=gen)).to(device, dtype)
    gate = router[:, 8:]  # a column of the router's fused output
    shared = torch.randn(tokens, hidden, generator=gen).to(device, dtype)
    pos = torch.randperm(tokens * top_k, generator=gen).to(device) if sorted_rows else None
    got = combine(y, weights, pos, (gate, shared))
    assert got.shape == (tokens, hidden) and got.dtype == dtype and got.is_contiguous()
    assert torch.equal(got, activation.sigmoid_gate_add(combine(y, weights, pos), gate, shared))  # same roundings

    rows = (pos if pos is not None else torch.arange(tokens * top_k, device=device)).view(tokens, top_k)
    terms = weights.double()[:, :, None] * y.double()[rows]
    routed = terms.sum(1)
    want = activation_ref.sigmoid_gate_add(routed.to(dtype), gate, shared)
    scale = terms.abs().sum(1) + (torch.sigmoid(gate.double()) * shared.double()).abs()  # the sums may cancel
    assert ((got.double() - want.double()).abs() <= slack * TOL[dtype] * scale + 1e-30).all()

    # ungated (Granite's shared MLP): the two launches' bits, and torch's routed + shared
    got = combine(y, weights, pos, (None, shared))
    assert got.shape == (tokens, hidden) and got.dtype == dtype and got.is_contiguous()
    if device == "cuda" or dtype == torch.float32:  # (the interpreter truncates to bf16 where torch's add rounds)
        assert torch.equal(got, combine(y, weights, pos) + shared)
    scale = terms.abs().sum(1) + shared.double().abs()
    assert ((got.double() - (routed.to(dtype) + shared).double()).abs() <= slack * TOL[dtype] * scale + 1e-30).all()


@needs_cuda
@DTYPES
@CASES
def test_cuda_combine_with_the_shared_expert(tokens: int, top_k: int, hidden: int, sorted_rows: bool,
                                            dtype: torch.dtype) -> None:
    check_combine_shared(tokens, top_k, hidden, sorted_rows, dtype, "cuda", 1.0)


@needs_interpreter
@DTYPES
@CASES
def test_interpreted_combine_with_the_shared_expert(tokens: int, top_k: int, hidden: int, sorted_rows: bool,
                                                   dtype: torch.dtype) -> None:
    check_combine_shared(tokens, top_k, hidden, sorted_rows, dtype, "cpu", 2.0)


def check_spread(tokens: int, top_k: int, hidden: int, block_h: int, dtype: torch.dtype, device: str) -> None:
    from hybridcache.kernels.moe.grouped import pair_rows, sort_pairs_torch
    from hybridcache.kernels.moe.triton_experts import spread

    gen = torch.Generator().manual_seed(tokens * top_k + hidden)
    ids = torch.randint(0, 6, (tokens, top_k), generator=gen).to(device)  # a token may pick an expert twice
    order, _ = sort_pairs_torch(ids, 6)
    x = torch.randn(tokens, hidden + 9, generator=gen).to(device, dtype)[:, 3:hidden + 3]  # rows hidden + 9 apart
    got = spread(x, pair_rows(order), top_k, block_h=block_h)
    assert got.shape == (tokens * top_k, hidden) and got.is_contiguous()
    assert torch.equal(got, x.index_select(0, order // top_k))


SPREAD_CASES = pytest.mark.parametrize(("tokens", "top_k", "hidden", "block_h"),
                                       [(5, 1, 200, 1024), (37, 3, 1500, 512), (37, 8, 200, 64), (1, 8, 1500, 2048)])


@needs_cuda
@DTYPES
@SPREAD_CASES
def test_cuda_spread_equals_the_gather(tokens: int, top_k: int, hidden: int, block_h: int, dtype: torch.dtype) -> None:
    check_spread(tokens, top_k, hidden, block_h, dtype, "cuda")


@needs_interpreter
@SPREAD_CASES
def test_interpreted_spread_equals_the_gather(tokens: int, top_k: int, hidden: int, block_h: int) -> None:
    check_spread(tokens, top_k, hidden, block_h, torch.float32, "cpu")


def test_spread_refuses_strided_columns_and_a_wrong_pos() -> None:
    pytest.importorskip("triton")
    from hybridcache.kernels.moe.triton_experts import spread

    with pytest.raises(ValueError, match="unit stride"):
        spread(torch.zeros(16, 4).t(), torch.arange(8), 2)
    with pytest.raises(ValueError, match="pos 8 rows"):
        spread(torch.zeros(4, 16), torch.arange(6), 2)


@interpreted_in_child("test_interpreted_")
def test_moe_combine_in_a_triton_interpreter_subprocess() -> None:
    """This file's interpreted tests, in a child process (tests/kernels/interpreter.py)."""


def test_combine_refuses_a_misshapen_shared_expert() -> None:
    pytest.importorskip("triton")
    from hybridcache.kernels.moe.triton_experts import combine

    y, weights = torch.zeros(8, 16), torch.ones(4, 2)
    with pytest.raises(ValueError, match="gate \\[4, 1\\] and shared \\[4, 16\\]"):
        combine(y, weights, shared=(torch.zeros(4, 2), torch.zeros(4, 16)))
    with pytest.raises(ValueError, match="unit stride"):
        combine(y, weights, shared=(torch.zeros(4, 1), torch.zeros(16, 4).t()))


def test_reference_moe_adds_the_shared_expert_as_sigmoid_gate_add_or_plain() -> None:
    from hybridcache.kernels.backend import ReferenceBackend
    from hybridcache.layers.mlp import MLP

    gen = torch.Generator().manual_seed(0)
    experts = torch.nn.ModuleList(MLP(32, 16) for _ in range(4))
    x = torch.randn(6, 32, generator=gen)
    ids = torch.rand(6, 4, generator=gen).argsort(-1)[:, :2]
    weights = torch.rand(6, 2, generator=gen).softmax(-1)
    gate, shared = torch.randn(6, 1, generator=gen), torch.randn(6, 32, generator=gen)
    backend = ReferenceBackend()
    with torch.no_grad():
        want = activation_ref.sigmoid_gate_add(backend.moe(x, weights, ids, experts), gate, shared)
        assert torch.equal(backend.moe(x, weights, ids, experts, (gate, shared)), want)
        assert torch.equal(backend.moe(x, weights, ids, experts, (None, shared)),
                           backend.moe(x, weights, ids, experts) + shared)


def test_combine_with_the_shared_expert_compiles_for_hopper() -> None:
    pytest.importorskip("triton")
    from hybridcache.kernels.moe.triton_experts import _combine_kernel
    from tests.kernels.hopper import compile_for_hopper

    pointers = {"y_ptr": "*bf16", "pos_ptr": "*i64", "w_ptr": "*bf16", "out_ptr": "*bf16", "gate_ptr": "*bf16",
                "shared_ptr": "*bf16"}
    ints = [p.name for p in _combine_kernel.params if not p.name.endswith("_ptr") and not p.is_constexpr]
    ptx = {mode: compile_for_hopper(_combine_kernel, pointers, ints,
                                    dict(TOP_K=4, BLOCK_H=1024, SORTED=False, SHARED=mode)).asm["ptx"]
           for mode in (0, 1, 2)}
    assert "ex2" in ptx[1] and "ex2" not in ptx[0] and "ex2" not in ptx[2]  # the gate's sigmoid, only when gated
