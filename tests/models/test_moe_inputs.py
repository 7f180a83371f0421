"""The sparse MoE block runs its four projections of x (the shared expert's gate and up, the router, the shared
expert's gate) as one GEMM (`SparseMoeBlock.inputs`), and gives what the two-GEMM path gives: the router and the
shared expert's gate fused, the shared expert's gate | up fused (fp32 on the CPU, random weights at std
1/sqrt(fan_in), 150+ tokens; the larger GEMM may sum in another order: 1e-6 relative)."""

from __future__ import annotations

import torch

from hybridcache.kernels.backend import ReferenceBackend
from hybridcache.layers.fused import padded_rows
from hybridcache.layers.mlp import SparseMoeBlock


class _Step:
    backend = ReferenceBackend()


def test_moe_block_fuses_its_four_input_projections() -> None:
    torch.manual_seed(0)
    block = SparseMoeBlock(64, num_experts=6, top_k=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                           norm_topk_prob=True)
    with torch.no_grad():
        for param in block.parameters():
            param.normal_(0, param.shape[-1] ** -0.5)
        x = torch.randn(160, 64)
        assert block.inputs.fused()
        fused = block(x, _Step())
        assert block.inputs.weight.shape == (padded_rows(2 * 48 + 6 + 1), 64)  # one GEMM reads all four (+ zero rows)
        base = block.inputs.weight.data_ptr()
        size = block.inputs.weight.element_size()
        assert block.gate.weight.data_ptr() == base + 2 * 48 * 64 * size  # the modules share its rows
        assert block.shared_expert_gate.weight.data_ptr() == base + (2 * 48 + 6) * 64 * size

        router_logits, shared_gate = block.gates(x)  # the two-GEMM path, as an unfusable block runs it
        gate, up = block.shared_expert.gate_up(x)
        top_weights, top_ids = _Step.backend.route(router_logits, 2, True)
        shared = block.shared_expert.down(gate, up, _Step())
        want = _Step.backend.moe(x, top_weights, top_ids, block.experts, (shared_gate, shared))
    torch.testing.assert_close(fused, want, rtol=1e-6, atol=1e-6)
