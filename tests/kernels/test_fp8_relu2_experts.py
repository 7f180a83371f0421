"""FP8 routed experts of either activation on the CUDA path, "relu2" (Nemotron-H's ungated experts
down(relu(up(x))^2), as NVIDIA-Nemotron-3-Nano-30B-A3B-FP8 holds them) beside "silu_gated": the stack of up_proj
alone (`Fp8ExpertWeights.share(..., activation="relu2")`), the expert GEMM's relu^2 epilogue (`fp8_expert_gemm(...,
relu2=True)`) and the CUDA backend's `moe`.

- Interpreted (TRITON_INTERPRET=1 child, tests/kernels/interpreter.py): `fp8_grouped_experts` on both
  activations' stacks at each path the Triton kernels take (decode W8A8 per 128 channels in swap-AB and plain
  tiles, W8A16, per-channel decode with per-token x and h scaled once, a forced prefill tile, a prefill-sized batch
  taking the `PREFILL_TILES` bucket; the launches recorded to prove it) against the same arithmetic in torch
  (activations quantised by torch, `test_fp8_kernels.torch_quantisation`: 1e-4 of the largest output, h's e4m3
  rounding may flip a step) and against the reference backend on the dequantised weights (`moe/reference.py`,
  activations unquantised): within the activations' e4m3 rounding in W8A8 (`W8A8_TOL`), to fp32 order in W8A16
  (1e-5).
  The CUDA backend's `moe` on "relu2" FP8 experts and Nemotron-H's MoE block on it (its shared expert two dense
  FP8 linears) against the reference backend, on bf16's paths (`bf16_paths`; fp32's own, the exact W8A16:
  tests/kernels/test_fp8_experts_fp32.py).
- On the CPU without the interpreter: the "relu2" stack's layout and sharing, and the refusals (a shared expert in
  a "relu2" stack, an unknown activation, both epilogues at once).
- On CUDA (skipped without one): the CUDA backend's `moe` against the reference backend in bf16 for both
  activations at decode and prefill sizes (its start-up compile included), and the row-wise prefill path of
  "relu2" experts against its arithmetic in torch.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hybridcache.fp8_format import BLOCK, CHANNEL
from hybridcache.kernels.gemm.fp8_tiles import PrefillTile
from hybridcache.kernels.gemm.reference import emulate_block_linear, quantize_groups, quantize_rows
from tests.kernels.interpreter import interpreted_in_child, needs_cuda, needs_interpreter
from tests.kernels.test_fp8_kernels import torch_quantisation
from tests.kernels.test_fp8_rowwise_experts import block_experts, emulated_rowwise, fro, rel

ACTIVATIONS = ["silu_gated", "relu2"]
# W8A8 against the reference (unquantised activations), relative to the largest output: x and h each rounded to
# e4m3 (3 mantissa bits), measured 3-5e-2 here for both activations (max and Frobenius alike)
W8A8_TOL = 7e-2


@interpreted_in_child("test_interpreted_ and not subprocess")
def test_fp8_relu2_experts_in_a_triton_interpreter_subprocess() -> None:
    """This file's interpreted tests, in a child process (tests/kernels/interpreter.py)."""


def routes(tokens: int, num_experts: int, top_k: int, generator: torch.Generator) -> tuple[torch.Tensor, ...]:
    """(top_weights [T, k] fp32, not summing to 1 (Nemotron-H's scaled weights), top_ids [T, k] distinct picks)."""
    top_ids = torch.stack([torch.randperm(num_experts, generator=generator)[:top_k] for _ in range(tokens)])
    return 2.5 * torch.rand(tokens, top_k, generator=generator), top_ids


def emulated(x: torch.Tensor, top_weights: torch.Tensor, top_ids: torch.Tensor, stacked, per_token: bool
             ) -> torch.Tensor:
    """The W8A8 experts' arithmetic in torch: per pick, x quantised per token (`per_token`) or per token per 128
    channels, the first GEMM on the FP8 numbers (`emulate_block_linear`, fp32), the stack's activation, h rounded
    to x's dtype and quantised the same way, the down GEMM, the weighted sum in fp32."""
    bk = stacked.block[1]

    def quantized(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not per_token:
            return quantize_groups(rows, bk)
        q, scale = quantize_rows(rows)
        return q, scale.expand(-1, -(-rows.shape[1] // bk))

    def activated(xq: torch.Tensor, x_scale: torch.Tensor, e: int) -> torch.Tensor:
        weight, scale = stacked.gate_up[e], stacked.gate_up_scale[e]
        if stacked.activation == "relu2":
            return F.relu(emulate_block_linear(xq, x_scale, weight, scale, stacked.block)).square()
        inter, groups = weight.shape[0] // 2, scale.shape[0] // 2  # the gate's rows and scale rows come first
        gate = emulate_block_linear(xq, x_scale, weight[:inter], scale[:groups], stacked.block)
        return F.silu(gate) * emulate_block_linear(xq, x_scale, weight[inter:], scale[groups:], stacked.block)

    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for j in range(top_ids.shape[1]):
            e = int(top_ids[t, j])
            h = activated(*quantized(x[t : t + 1]), e)
            y = emulate_block_linear(*quantized(h.to(x.dtype)), stacked.down[e], stacked.down_scale[e],
                                     stacked.block)
            out[t] += top_weights[t, j] * y[0]
    return out


# mode -> (the experts' format, tokens, `fp8_grouped_experts` overrides, what the first GEMM's launch must be)
MODES = {
    "decode-swap-ab": (BLOCK, 9, {}, dict(block_m=16, swap_ab=True, scale_once=None)),
    "decode-plain-tile": (BLOCK, 9, dict(swap_ab=False), dict(block_m=16, swap_ab=False)),
    "decode-w8a16": (BLOCK, 9, dict(w8a16=True), dict(block_m=16, swap_ab=True)),
    "decode-token-scales": (CHANNEL, 9, {}, dict(block_m=16, swap_ab=True, scale_once=True)),
    "prefill-tile": (CHANNEL, 9, dict(prefill=PrefillTile(16, 32, 64, 4, 3, 2)), dict(block_m=16, group_m=2)),
    "prefill-rows": (BLOCK, 160, {}, dict(block_m=64, group_m=8)),  # 80 rows per expert: PREFILL_TILES' tile
}


@needs_interpreter
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_interpreted_fp8_experts_equal_their_arithmetic_and_the_reference(activation, mode, monkeypatch):
    from hybridcache.kernels.backend import ReferenceBackend
    from hybridcache.kernels.gemm import triton_fp8_moe
    from hybridcache.kernels.gemm.triton_fp8_moe import Fp8ExpertWeights, fp8_grouped_experts

    fmt, tokens, overrides, launch = MODES[mode]
    torch_quantisation(monkeypatch)
    launches: list[dict] = []
    original = triton_fp8_moe.fp8_expert_gemm
    monkeypatch.setattr(triton_fp8_moe, "fp8_expert_gemm", lambda *a, **k: launches.append(k) or original(*a, **k))
    generator = torch.Generator().manual_seed(len(mode))
    hidden, inter, num_experts, top_k = 256, 96, 4, 2  # 96: a partial column tile and a partial K group
    experts = block_experts(hidden, inter, num_experts, generator, fmt, gated=activation == "silu_gated")
    stacked = Fp8ExpertWeights.share(experts, per_channel=False, activation=activation)
    x = torch.randn(tokens, hidden, generator=generator)
    top_weights, top_ids = routes(tokens, num_experts, top_k, generator)
    got = fp8_grouped_experts(x, top_weights, top_ids, stacked, **overrides)
    first = launches[0]
    assert (first["swiglu"], first["relu2"]) == (activation == "silu_gated", activation == "relu2")
    assert not launches[1]["swiglu"] and not launches[1].get("relu2")  # the down GEMM
    assert {key: first.get(key) for key in launch} == launch, first
    want = ReferenceBackend().moe(x, top_weights, top_ids, experts, activation=activation)
    if overrides.get("w8a16"):
        assert rel(got, want) <= 1e-5
        return
    arithmetic = emulated(x, top_weights, top_ids, stacked, per_token=bool(launch.get("scale_once")))
    print(f"{activation} {mode}: {rel(got, arithmetic):.1e} from its arithmetic, {rel(got, want):.1e} "
          f"({fro(got, want):.1e} in the Frobenius norm) from the reference")
    assert rel(got, arithmetic) <= 1e-4
    assert 1e-4 < rel(got, want) <= W8A8_TOL  # the activations were quantised: not the reference's arithmetic


def test_share_relu2_stacks_up_proj_alone_and_refuses_what_it_cannot_run():
    """A "relu2" stack is up_proj alone ([E, I, H]), the modules viewing their slices of it; block-scaled experts
    re-quantised per channel as SiLU-gated ones are; a shared expert (its sigmoid-gated pick), an unknown
    activation and both epilogues at once are ValueErrors; ungated experts never fuse their shared expert."""
    from hybridcache.kernels.attention.reference_backend import ReferenceAttention
    from hybridcache.kernels.cuda_backend import CudaBackend
    from hybridcache.kernels.gemm.triton_fp8_moe import Fp8ExpertWeights, fp8_expert_gemm, shared_fits

    generator = torch.Generator().manual_seed(3)
    hidden, inter, num_experts = 256, 96, 3
    experts = block_experts(hidden, inter, num_experts, generator, gated=False)
    shared = block_experts(hidden, inter, 1, generator, gated=False)[0]
    assert not shared_fits(experts, shared)
    assert not CudaBackend(ReferenceAttention()).fuses_shared_expert(experts, shared)
    with pytest.raises(ValueError, match="SiLU-gated experts only.*'relu2'"):
        Fp8ExpertWeights.share(experts, shared=shared, activation="relu2")
    with pytest.raises(ValueError, match="'gelu'"):
        Fp8ExpertWeights.share(experts, activation="gelu")
    stacked = Fp8ExpertWeights.share(experts, per_channel=True, activation="relu2")
    assert stacked.activation == "relu2" and not stacked.shared and stacked.block == (1, 128)
    assert stacked.gate_up.shape == (num_experts, inter, hidden) and stacked.gate_up_rows.shape == (num_experts, inter)
    assert stacked.gate_up_scale.shape == (num_experts, inter, 2) and stacked.down.shape == (num_experts, hidden, inter)
    for e, expert in enumerate(experts):
        assert expert.up_proj.fmt == CHANNEL and not hasattr(expert, "gate_proj")
        assert expert.up_proj.weight.data_ptr() == stacked.gate_up[e].data_ptr()
        assert expert.down_proj.weight.data_ptr() == stacked.down[e].data_ptr()
        assert torch.equal(expert.up_proj.scale[:, 0], stacked.gate_up_rows[e])
    order, counts = torch.arange(2), torch.tensor([1, 1, 0], dtype=torch.int32)
    with pytest.raises(ValueError, match="pick one"):
        fp8_expert_gemm(torch.zeros(2, hidden), None, order, 1, stacked.gate_up, stacked.gate_up_scale, counts,
                        stacked.block, torch.float32, gather=True, scatter=False, swiglu=True, relu2=True, block_m=16)


def bf16_paths(monkeypatch) -> None:
    """The CUDA backend's `moe` takes the paths of bf16 x (W8A8, `EXPERTS_PER_CHANNEL`) on the fp32 x of an
    interpreted test (the interpreter's bf16 products are wrong), not fp32's exact path (`triton_fp8_moe.fp8_exact`:
    W8A16, tests/kernels/test_fp8_experts_fp32.py)."""
    from hybridcache.kernels import cuda_backend

    monkeypatch.setattr(cuda_backend, "fp8_exact", lambda x: False)


@needs_interpreter
@pytest.mark.parametrize("tokens", [9, 160], ids=["decode", "prefill"])
@torch.no_grad()
def test_interpreted_cuda_backend_moe_runs_fp8_relu2_experts(tokens, monkeypatch):
    """The CUDA backend's `moe` on per-channel "relu2" FP8 experts (ModelOpt's, as loaded) stacks them as "relu2"
    (its start-up compile running every launch on the CPU here) and equals the reference backend within the
    activations' rounding; the same experts called as SiLU-gated, and an unknown activation, are ValueErrors."""
    from hybridcache.kernels.attention.reference_backend import ReferenceAttention
    from hybridcache.kernels.backend import ReferenceBackend
    from hybridcache.kernels.cuda_backend import CudaBackend

    torch_quantisation(monkeypatch)
    bf16_paths(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)  # a CPU-only torch has none
    generator = torch.Generator().manual_seed(tokens)
    hidden, inter, num_experts, top_k = 128, 64, 4, 2
    experts = block_experts(hidden, inter, num_experts, generator, CHANNEL, gated=False)
    x = torch.randn(tokens, hidden, generator=generator)
    top_weights, top_ids = routes(tokens, num_experts, top_k, generator)
    backend = CudaBackend(ReferenceAttention())
    got = backend.moe(x, top_weights, top_ids, experts, activation="relu2")
    assert backend._experts[experts].activation == "relu2"
    want = ReferenceBackend().moe(x, top_weights, top_ids, experts, activation="relu2")
    assert 1e-4 < rel(got, want) <= W8A8_TOL
    with pytest.raises(ValueError, match="stacked as 'relu2', not 'silu_gated'"):
        backend.moe(x, top_weights, top_ids, experts)
    with pytest.raises(ValueError, match="'gelu'"):
        backend.moe(x, top_weights, top_ids, block_experts(hidden, inter, 2, generator, CHANNEL, gated=False),
                    activation="gelu")


def nemotron_moe_block(generator: torch.Generator) -> nn.Module:
    """A tiny Nemotron-H MoE mixer (tests/models/nemotron_helpers.py's "moe-groups": 8 experts of 32 in 4 groups,
    top 3, a shared expert of 48) with weights at std 1/sqrt(fan_in), a router correction bias, and its experts
    and shared expert per-channel FP8 (what a ModelOpt checkpoint loads as); the router stays float32."""
    from hybridcache.models.config import ModelConfig
    from hybridcache.models.nemotron_h import NemotronHMoE
    from hybridcache.models.quant import quantize_linears_
    from tests.models.nemotron_helpers import nemotron_config

    block = NemotronHMoE(ModelConfig.from_dict(nemotron_config("moe-groups").to_dict()))
    with torch.no_grad():
        for param in block.parameters():
            fan_in = param.shape[-1] if param.dim() > 1 else 10
            param.copy_(torch.randn(param.shape, generator=generator) / fan_in**0.5)
    names = [n for n, m in block.named_modules() if isinstance(m, nn.Linear) and "expert" in n]
    quantize_linears_(block, names, CHANNEL)
    return block


@needs_interpreter
@torch.no_grad()
def test_interpreted_nemotron_moe_block_on_the_cuda_backend_equals_the_reference(monkeypatch):
    """Nemotron-H's MoE mixer in FP8 on the CUDA backend (routed "relu2" experts in the Triton FP8 kernels; the
    shared expert, relu^2 too and wider than a routed one, two dense FP8 linears: never stacked) against the
    reference backend: within the activations' rounding."""
    from hybridcache.kernels.attention.reference_backend import ReferenceAttention
    from hybridcache.kernels.backend import ReferenceBackend
    from hybridcache.kernels.cuda_backend import CudaBackend
    from hybridcache.layers.linear import Fp8Linear
    from hybridcache.layers.step import StepContext

    torch_quantisation(monkeypatch)
    bf16_paths(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    block = nemotron_moe_block(torch.Generator().manual_seed(5))
    assert isinstance(block.shared_experts.up_proj, Fp8Linear) and isinstance(block.experts[0].down_proj, Fp8Linear)
    x = torch.randn(11, 64, generator=torch.Generator().manual_seed(6))
    want = block(x, StepContext(batch=None, backend=ReferenceBackend(), rope=(None, None)), None)
    backend = CudaBackend(ReferenceAttention())
    got = block(x, StepContext(batch=None, backend=backend, rope=(None, None)), None)
    stacked = backend._experts[block.experts]
    assert stacked.activation == "relu2" and not stacked.shared and stacked.gate_up.shape == (8, 32, 64)
    assert 1e-4 < rel(got, want) <= W8A8_TOL


@needs_cuda
@pytest.mark.parametrize("tokens", [3, 64, 700], ids=["decode-3", "decode-64", "prefill-700"])
@pytest.mark.parametrize("activation", ACTIVATIONS)
@torch.no_grad()
def test_cuda_backend_moe_with_fp8_experts_matches_the_reference(activation, tokens):
    """The CUDA backend's `moe` on per-channel FP8 experts (ModelOpt's layout) in bf16, Nemotron-H's float32
    routing weights, against the reference backend on the dequantised weights: within the activations' e4m3
    rounding (W8A8 at decode; the Triton prefill tile at 700 tokens, 175 rows per expert): 1e-1 of the largest
    output as the SiLU-gated experts' CUDA test bounds it, and `W8A8_TOL` in the Frobenius norm (this test's
    arithmetic emulated in fp32 on the CPU: 3.7-4.9e-2; an indexing or scale bug is O(1))."""
    from hybridcache.kernels.attention.reference_backend import ReferenceAttention
    from hybridcache.kernels.backend import ReferenceBackend
    from hybridcache.kernels.cuda_backend import CudaBackend

    generator = torch.Generator().manual_seed(tokens)
    hidden, inter, num_experts, top_k = 256, 192, 8, 2
    experts = block_experts(hidden, inter, num_experts, generator, CHANNEL, gated=activation == "silu_gated").cuda()
    x = torch.randn(tokens, hidden, generator=generator).cuda().bfloat16()
    top_weights, top_ids = (t.cuda() for t in routes(tokens, num_experts, top_k, generator))
    backend = CudaBackend(ReferenceAttention())
    got = backend.moe(x, top_weights, top_ids, experts, activation=activation)
    want = ReferenceBackend().moe(x, top_weights, top_ids, experts, activation=activation)
    print(f"{activation} at {tokens} tokens: {rel(got, want):.2e} of the largest output, {fro(got, want):.2e}")
    assert got.dtype == torch.bfloat16 and backend._experts[experts].activation == activation
    assert rel(got, want) <= 1e-1 and fro(got, want) <= W8A8_TOL


@needs_cuda
@torch.no_grad()
def test_cuda_rowwise_relu2_experts_against_torch():
    """"relu2" experts above the decode sizes on torch's row-wise scaled grouped GEMM (`rowwise_expert_rows`,
    forced: from 2,048 rows per expert it runs by itself) with `relu2_quantize_rows` between the GEMMs, against the
    same arithmetic in torch (`emulated_rowwise`), with the SiLU-gated row-wise test's bounds (full accumulation)."""
    from hybridcache.kernels.gemm.triton_fp8_moe import Fp8ExpertWeights, fp8_grouped_experts, rowwise_fits

    generator = torch.Generator().manual_seed(9)
    hidden, inter, num_experts, top_k, tokens = 256, 192, 8, 2, 600
    experts = block_experts(hidden, inter, num_experts, generator, CHANNEL, gated=False).cuda()
    stacked = Fp8ExpertWeights.share(experts, activation="relu2")
    x = torch.randn(tokens, hidden, generator=generator).cuda().bfloat16()
    top_weights, top_ids = (t.cuda() for t in routes(tokens, num_experts, top_k, generator))
    top_weights = top_weights.bfloat16()
    assert rowwise_fits(x, stacked)
    got = fp8_grouped_experts(x, top_weights, top_ids, stacked, rowwise=True)
    want = emulated_rowwise(x, top_weights, top_ids, stacked)
    print(f"row-wise relu2: {rel(got, want):.2e} of the largest output, {fro(got, want):.2e}")
    assert got.dtype == torch.bfloat16 and rel(got, want) <= 5e-2 and fro(got, want) <= 1.5e-2
