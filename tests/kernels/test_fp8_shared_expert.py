"""The FP8 shared expert as one more routed expert (`fp8_tiles.SHARED_AS_EXPERT`, issue 29): `triton_fp8_moe.
with_shared` (every token's last pick: the shared expert, weight sigmoid(gate)), `Fp8ExpertWeights.share(...,
shared=...)` and the CUDA backend's MoE block with it.

- `shared_fits`: FP8 projections of one format and the routed experts' widths only.
- Interpreted (TRITON_INTERPRET=1 child, as test_fp8_kernels.py): `with_shared` against torch exactly;
  `shared_prologue` (the decode step's sort, shared weights and x quantisation in one launch) equal to the three
  launches' results bit for bit (the sort against torch's stable argsort of the [T, k + 1] ids); the stack's
  last expert is the shared module's weights (re-pointed, one copy), and the experts with it (W8A16: no activation
  rounding) equal the reference backend's routed experts + sigmoid(gate) * shared expert to fp32 summation order;
  `SparseMoeBlock` on the CUDA backend (which then never runs the shared expert's own projections) against the
  same block on the reference backend, block-scaled (to fp32 order) and re-quantised per channel (against the
  reference on the re-quantised modules, to fp32 order).
- On CUDA (skipped without one): `shared_prologue` as interpreted; the row-wise prefill path with the shared
  expert against the same arithmetic in torch on the extended routes (`test_fp8_rowwise_experts.emulated_rowwise`).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hybridcache.fp8_format import BLOCK, CHANNEL
from tests.kernels.interpreter import interpreted_in_child, needs_cuda, needs_interpreter
from tests.kernels.test_fp8_relu2_experts import bf16_paths
from tests.kernels.test_fp8_rowwise_experts import block_experts, emulated_rowwise, fro, rel


@interpreted_in_child("test_interpreted_ and not subprocess")
def test_fp8_shared_expert_kernels_in_a_triton_interpreter_subprocess() -> None:
    """This file's interpreted tests, in a child process (tests/kernels/interpreter.py)."""


def torch_routes(top_weights, top_ids, gate, shared_id):
    """`with_shared` in torch."""
    weights = torch.cat([top_weights, torch.sigmoid(gate.float()).to(top_weights.dtype)], dim=1)
    return weights, torch.cat([top_ids, torch.full_like(top_ids[:, :1], shared_id)], dim=1)


def test_shared_fits_needs_one_fp8_format_and_the_routed_width(monkeypatch):
    pytest.importorskip("triton")
    from hybridcache.kernels.gemm import fp8_tiles
    from hybridcache.kernels.gemm.triton_fp8_moe import shared_fits

    generator = torch.Generator().manual_seed(1)
    experts = block_experts(256, 128, 3, generator)
    assert shared_fits(experts, block_experts(256, 128, 1, generator)[0])
    assert not shared_fits(experts, block_experts(256, 256, 1, generator)[0])  # wider than the routed experts
    assert not shared_fits(experts, block_experts(256, 128, 1, generator, CHANNEL)[0])  # another format
    dense = nn.Module()
    dense.gate_proj, dense.up_proj = nn.Linear(256, 128, bias=False), nn.Linear(256, 128, bias=False)
    dense.down_proj = nn.Linear(128, 256, bias=False)
    assert not shared_fits(experts, dense)
    monkeypatch.setattr(fp8_tiles, "SHARED_AS_EXPERT", False)
    assert not shared_fits(experts, block_experts(256, 128, 1, generator)[0])


@needs_interpreter
@pytest.mark.parametrize("tokens, top_k", [(5, 2), (70, 8), (1, 1)])
def test_interpreted_with_shared_appends_the_shared_pick(tokens, top_k):
    from hybridcache.kernels.gemm.triton_fp8_moe import with_shared

    generator = torch.Generator().manual_seed(tokens)
    top_weights = torch.rand(tokens, top_k, generator=generator)
    top_ids = torch.randint(0, 9, (tokens, top_k), generator=generator)
    gate = torch.randn(tokens + 3, 4, generator=generator)[:tokens, 2:3]  # a column of a wider output
    weights, ids = with_shared(top_weights, top_ids, gate, 9)
    want_weights, want_ids = torch_routes(top_weights, top_ids, gate, 9)
    assert torch.equal(ids, want_ids) and ids.dtype == torch.int64
    assert torch.allclose(weights, want_weights, rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match="gate \\[T, 1\\]"):
        with_shared(top_weights, top_ids, gate[:, :0], 9)


PROLOGUE_CASES = [(64, 8, 32), (3, 10, 512), (1, 1, 4), (128, 8, 32)]  # (tokens, routed top-k, routed experts)


@needs_interpreter
@pytest.mark.parametrize("tokens, top_k, routed", PROLOGUE_CASES)
def test_interpreted_shared_prologue_equals_its_three_launches(tokens, top_k, routed):
    check_shared_prologue(tokens, top_k, routed, torch.device("cpu"))


@needs_cuda
@pytest.mark.parametrize("tokens, top_k, routed", PROLOGUE_CASES)
def test_cuda_shared_prologue_equals_its_three_launches(tokens, top_k, routed):
    check_shared_prologue(tokens, top_k, routed, torch.device("cuda"))


def check_shared_prologue(tokens: int, top_k: int, routed: int, device: torch.device) -> None:
    from hybridcache.kernels.gemm import triton_quant
    from hybridcache.kernels.gemm.triton_fp8_moe import shared_prologue, with_shared
    from hybridcache.kernels.moe.grouped import sort_pairs_torch

    generator = torch.Generator().manual_seed(tokens + top_k)
    top_ids = torch.rand(tokens, routed, generator=generator).argsort(dim=-1)[:, :top_k].contiguous().to(device)
    top_weights = torch.rand(tokens, top_k, generator=generator).to(device, torch.bfloat16)
    gate = torch.randn(tokens, routed + 1, generator=generator).to(device, torch.bfloat16)[:, -1:]  # a router column
    x = (torch.randn(tokens, 200, generator=generator) * 3).to(device, torch.bfloat16)
    order, counts, weights, xq, x_scale = shared_prologue(x, top_weights, top_ids, gate, routed + 1)
    want_order, want_counts = sort_pairs_torch(torch_routes(top_weights, top_ids, gate, routed)[1], routed + 1)
    want_xq, want_scale = triton_quant.quantize_rows(x)
    assert torch.equal(order, want_order) and torch.equal(counts, want_counts)
    assert torch.equal(weights, with_shared(top_weights, top_ids, gate, routed)[0])
    assert torch.equal(xq.view(torch.uint8), want_xq.view(torch.uint8)) and torch.equal(x_scale, want_scale)


@needs_interpreter
def test_interpreted_experts_with_the_shared_expert_equal_the_reference_block(monkeypatch):
    from hybridcache.kernels.activation import reference as activation_ref
    from hybridcache.kernels.backend import ReferenceBackend
    from hybridcache.kernels.gemm.triton_fp8_moe import Fp8ExpertWeights, fp8_grouped_experts

    generator = torch.Generator().manual_seed(4)
    hidden, inter, num_experts, top_k, tokens = 256, 128, 4, 2, 9
    experts = block_experts(hidden, inter, num_experts, generator)
    shared = block_experts(hidden, inter, 1, generator)[0]
    x = torch.randn(tokens, hidden, generator=generator)
    top_ids = torch.stack([torch.randperm(num_experts, generator=generator)[:top_k] for _ in range(tokens)])
    top_weights = torch.rand(tokens, top_k, generator=generator)
    gate = torch.randn(tokens, 1, generator=generator)
    reference = ReferenceBackend()
    shared_out = shared.down_proj(activation_ref.silu_mul(shared.gate_proj(x), shared.up_proj(x)))
    want = reference.moe(x, top_weights, top_ids, experts, (gate, shared_out))
    stacked = Fp8ExpertWeights.share(experts, per_channel=False, shared=shared)
    assert stacked.shared and stacked.gate_up.shape[0] == num_experts + 1
    assert shared.up_proj.weight.data_ptr() == stacked.gate_up[num_experts, inter:].data_ptr()
    assert shared.down_proj.weight.data_ptr() == stacked.down[num_experts].data_ptr()
    got = fp8_grouped_experts(x, top_weights, top_ids, stacked, w8a16=True, shared_gate=gate)
    assert rel(got, want) <= 1e-5
    with pytest.raises(ValueError, match="shared_gate is needed exactly"):
        fp8_grouped_experts(x, top_weights, top_ids, stacked, w8a16=True)


def moe_block(fmt, generator: torch.Generator) -> nn.Module:
    """A `SparseMoeBlock` (hidden 256, 4 experts top-2 and a shared expert of width 128) with its experts and
    shared expert quantised to `fmt`, the router and the shared expert's gate bf16-style plain linears."""
    from hybridcache.layers.mlp import SparseMoeBlock
    from hybridcache.models.quant import quantize_linears_

    block = SparseMoeBlock(256, num_experts=4, top_k=2, moe_intermediate_size=128, shared_expert_intermediate_size=128,
                           norm_topk_prob=True)
    for module in block.modules():
        if isinstance(module, nn.Linear):
            module.weight.data = torch.randn(module.weight.shape, generator=generator) / module.in_features**0.5
    names = [n for n, m in block.named_modules() if isinstance(m, nn.Linear) and ("expert." in n or "experts." in n)]
    quantize_linears_(block, names, fmt)
    return block


@needs_interpreter
@pytest.mark.parametrize("per_channel", [False, True], ids=["block", "requantised-per-channel"])
@torch.no_grad()
def test_interpreted_moe_block_runs_its_shared_expert_in_the_experts_launch(per_channel, monkeypatch):
    """The CUDA backend stacks the shared expert with the routed ones (it never runs the shared expert's own
    projections) and the block's output equals the reference backend's (the decode tile in W8A16, so only fp32
    summation order differs); re-quantised per channel, against the reference on the re-quantised modules."""
    from hybridcache.kernels import cuda_backend
    from hybridcache.kernels.attention.reference_backend import ReferenceAttention
    from hybridcache.kernels.backend import ReferenceBackend
    from hybridcache.kernels.gemm import fp8_tiles, triton_fp8_moe
    from hybridcache.layers.fused import FusedProjection
    from hybridcache.layers.step import StepContext

    monkeypatch.setattr(triton_fp8_moe, "DECODE_W8A16", True)
    monkeypatch.setattr(fp8_tiles, "EXPERTS_PER_CHANNEL", per_channel)
    bf16_paths(monkeypatch)  # bf16's stacks (re-quantised with `per_channel`) on this fp32 x; fp32 keeps the blocks
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)  # a CPU-only torch has none
    generator = torch.Generator().manual_seed(5)
    block = moe_block(BLOCK, generator)
    x = torch.randn(6, 256, generator=generator)
    reference = StepContext(batch=None, backend=ReferenceBackend(), rope=(None, None))
    want = block(x, reference)
    backend = cuda_backend.CudaBackend(ReferenceAttention())
    assert backend.fuses_shared_expert(block.experts, block.shared_expert)
    calls = []
    original = FusedProjection.__call__
    monkeypatch.setattr(FusedProjection, "__call__", lambda self, x: calls.append(self) or original(self, x))
    got = block(x, StepContext(batch=None, backend=backend, rope=(None, None)))
    assert calls == [block.gates] and backend._experts[block.experts].shared  # not the shared expert's gate_up
    monkeypatch.setattr(FusedProjection, "__call__", original)
    assert block.shared_expert.gate_proj.fmt == (CHANNEL if per_channel else BLOCK)
    if per_channel:  # the modules now hold the re-quantised weights: the reference on them
        assert 1e-4 < rel(got, want) <= 1e-1
        want = block(x, reference)
    assert rel(got, want) <= 1e-5
    assert backend.fuses_shared_expert(block.experts, block.shared_expert)  # from the stack, once stacked


@needs_cuda
def test_cuda_rowwise_experts_with_the_shared_expert_against_torch():
    """Above the decode sizes (per channel, full accumulation): the row-wise path on the routes with the shared
    expert appended, against the same arithmetic in torch on those routes; the decode tile too."""
    from hybridcache.kernels.gemm.triton_fp8_moe import Fp8ExpertWeights, compile_tiles, fp8_grouped_experts

    generator = torch.Generator().manual_seed(8)
    hidden, inter, num_experts, top_k, tokens = 256, 128, 8, 2, 600
    experts = block_experts(hidden, inter, num_experts, generator).cuda()
    shared = block_experts(hidden, inter, 1, generator)[0].cuda()
    x = torch.randn(tokens, hidden, generator=generator).cuda().bfloat16()
    top_ids = torch.stack([torch.randperm(num_experts, generator=generator)[:top_k] for _ in range(tokens)]).cuda()
    top_weights = torch.rand(tokens, top_k, generator=generator).cuda().bfloat16()
    gate = torch.randn(tokens, 1, generator=generator).cuda().bfloat16()
    stacked = Fp8ExpertWeights.share(experts, per_channel=True, shared=shared)
    compile_tiles(x[:1], stacked, top_k)
    want = emulated_rowwise(x, *torch_routes(top_weights, top_ids, gate, num_experts), stacked)
    got = fp8_grouped_experts(x, top_weights, top_ids, stacked, rowwise=True, shared_gate=gate)
    # full accumulation's bounds (test_fp8_rowwise_experts: Hopper's FP8 MMA keeps ~14 bits between promotions)
    print(f"row-wise with the shared expert: {rel(got, want):.2e} of the largest output, {fro(got, want):.2e}")
    assert got.dtype == torch.bfloat16 and rel(got, want) <= 5e-2 and fro(got, want) <= 1.5e-2
    decode = fp8_grouped_experts(x[:16], top_weights[:16], top_ids[:16], stacked, shared_gate=gate[:16])
    want = emulated_rowwise(x[:16], *torch_routes(top_weights[:16], top_ids[:16], gate[:16], num_experts), stacked)
    assert rel(decode, want) <= 1e-1  # the decode tile: x per token per 128 channels, not per token
