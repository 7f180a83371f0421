"""The MoE op's expert activation (`KernelBackend.moe(..., activation=)`): "relu2", Nemotron-H's ungated experts
down(relu(up(x))^2), beside the default "silu_gated".

- the reference (`moe/reference.routed_experts`) equals transformers' `NemotronHExperts` exactly (fp32 weights and
  bf16 activations with fp32 routing weights, as its MoE block passes them), and `ReferenceBackend.moe` is it;
- an unknown activation is a ValueError naming it;
- the CUDA path: the Triton expert GEMM's relu^2 epilogue (few rows per expert) and the grouped GEMM path (many)
  equal the reference within rounding, the stack shares the experts' weights, a second activation on the same
  experts is refused. `test_cuda_*` on a CUDA device; `test_interpreted_*` on the CPU under TRITON_INTERPRET=1 in
  a child process (the Triton path, and the grouped path on torch's CPU grouped GEMM).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hybridcache.kernels.backend import ReferenceBackend
from hybridcache.kernels.moe import reference as moe_ref
from tests.kernels.interpreter import interpreted_in_child, needs_cuda, needs_interpreter

TOL = {torch.bfloat16: 2.0**-6, torch.float32: 1e-5}


class UngatedExpert(nn.Module):
    """An ungated expert as Nemotron-H's model holds one: up_proj [I, H], down_proj [H, I], no gate_proj."""

    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)


def ungated_experts(num_experts: int, hidden: int, inter: int, seed: int) -> nn.ModuleList:
    gen = torch.Generator().manual_seed(seed)
    experts = nn.ModuleList(UngatedExpert(hidden, inter) for _ in range(num_experts))
    with torch.no_grad():
        for expert in experts:
            expert.up_proj.weight.copy_(torch.randn(inter, hidden, generator=gen) / hidden**0.5)
            expert.down_proj.weight.copy_(torch.randn(hidden, inter, generator=gen) / inter**0.5)
    return experts


def routing(tokens: int, num_experts: int, top_k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] fp32, ids [T, k] int64): distinct experts a token, weights not summing to 1."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.rand(tokens, num_experts, generator=gen).argsort(-1)[:, :top_k]
    return 2.5 * torch.rand(tokens, top_k, generator=gen), ids


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_reference_equals_transformers_nemotron_experts(dtype: torch.dtype) -> None:
    import transformers
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHExperts

    config = transformers.NemotronHConfig(hidden_size=32, moe_intermediate_size=24, n_routed_experts=6,
                                          num_experts_per_tok=3)
    # transformers' own loop over the experts, named: a standalone module's default (None) is eager in 5.25, but
    # transformers 5.17 (the GPU image's) gave outputs one bf16 step apart, as a grouped GEMM that rounds otherwise
    config._experts_implementation = "eager"
    theirs = NemotronHExperts(config)
    experts = ungated_experts(6, 32, 24, seed=1).to(dtype)
    with torch.no_grad():
        theirs.up_proj.copy_(torch.stack([e.up_proj.weight for e in experts]))
        theirs.down_proj.copy_(torch.stack([e.down_proj.weight for e in experts]))
    theirs = theirs.to(dtype)
    x = torch.randn(40, 32, generator=torch.Generator().manual_seed(2)).to(dtype)
    weights, ids = routing(40, 6, 3, seed=3)  # fp32 weights, as NemotronHMoE passes its router's
    with torch.no_grad():
        want = theirs(x, ids, weights)
        ours = moe_ref.routed_experts(x, weights, ids, None, [e.up_proj.weight for e in experts],
                                      [e.down_proj.weight for e in experts], "relu2")
        assert torch.equal(ours, want)
        assert torch.equal(ReferenceBackend().moe(x, weights, ids, experts, activation="relu2"), want)


def test_relu2_is_not_the_silu_gated_mlp_and_unknown_activations_are_refused() -> None:
    experts = ungated_experts(4, 16, 8, seed=4)
    x = torch.randn(10, 16, generator=torch.Generator().manual_seed(5))
    weights, ids = routing(10, 4, 2, seed=6)
    up, down = [e.up_proj.weight for e in experts], [e.down_proj.weight for e in experts]
    with torch.no_grad():
        relu2 = moe_ref.routed_experts(x, weights, ids, None, up, down, "relu2")
        gated = moe_ref.routed_experts(x, weights, ids, up, up, down)  # silu(u) * u: another function
        t, j = 3, 1
        e = int(ids[t, j])
        one = torch.relu(x[t] @ up[e].T).square() @ down[e].T * weights[t, j]
        other = torch.relu(x[t] @ up[int(ids[t, 0])].T).square() @ down[int(ids[t, 0])].T * weights[t, 0]
        torch.testing.assert_close(relu2[t], one + other)
    assert not torch.allclose(relu2, gated)
    with pytest.raises(ValueError, match="'gelu'"):
        moe_ref.routed_experts(x, weights, ids, None, up, down, "gelu")


def check_cuda_paths(dtype: torch.dtype, device: str) -> None:
    """Both CUDA expert paths (or, on the CPU under the interpreter, the same functions) against the reference."""
    from hybridcache.kernels.moe.grouped import ExpertWeights, grouped_experts, tile_rows

    num_experts, top_k, hidden, inter = 8, 2, 96, 40
    experts = ungated_experts(num_experts, hidden, inter, seed=7).to(device, dtype)
    want_backend = ReferenceBackend()
    stacked = ExpertWeights.share(experts, "relu2")
    assert stacked.activation == "relu2" and tuple(stacked.gate_up.shape) == (num_experts, inter, hidden)
    assert experts[3].up_proj.weight.data_ptr() == stacked.gate_up[3].data_ptr()
    for tokens in (5, 300):  # the Triton expert GEMM (few rows per expert), the grouped GEMM (many)
        assert (tile_rows(tokens * top_k, num_experts) is None) == (tokens == 300)
        x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(tokens)).to(device, dtype)
        weights, ids = routing(tokens, num_experts, top_k, seed=tokens + 1)
        weights, ids = weights.to(device), ids.to(device)
        with torch.no_grad():
            want = want_backend.moe(x, weights, ids, experts, activation="relu2")
            got = grouped_experts(x, weights, ids, stacked)
        scale = float(want.float().abs().max())
        assert float((got.float() - want.float()).abs().max()) <= 2 * TOL[dtype] * scale, tokens


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_cuda_relu2_experts_match_the_reference(dtype: torch.dtype) -> None:
    check_cuda_paths(dtype, "cuda")


@needs_cuda
def test_cuda_backend_moe_keeps_the_activation_of_its_stack() -> None:
    from hybridcache.kernels.attention.reference_backend import ReferenceAttention
    from hybridcache.kernels.cuda_backend import CudaBackend

    backend = CudaBackend(ReferenceAttention())
    experts = ungated_experts(4, 64, 32, seed=8).to("cuda", torch.bfloat16)
    x = torch.randn(6, 64, device="cuda", dtype=torch.bfloat16)
    weights, ids = routing(6, 4, 2, seed=9)
    weights, ids = weights.to("cuda", torch.bfloat16), ids.cuda()
    with torch.no_grad():
        want = ReferenceBackend().moe(x, weights, ids, experts, activation="relu2")
        got = backend.moe(x, weights, ids, experts, activation="relu2")
        scale = float(want.float().abs().max())
        assert float((got.float() - want.float()).abs().max()) <= 2 * TOL[torch.bfloat16] * scale
        with pytest.raises(ValueError, match="stacked as 'relu2'"):
            backend.moe(x, weights, ids, experts)


@needs_interpreter
def test_interpreted_relu2_experts_match_the_reference() -> None:
    check_cuda_paths(torch.float32, "cpu")


@interpreted_in_child("interpreted")
def test_relu2_experts_in_a_triton_interpreter_subprocess() -> None:
    """This file's interpreted tests, in a child process (tests/kernels/interpreter.py)."""
