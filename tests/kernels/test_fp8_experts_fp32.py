"""FP8 experts on fp32 activations on the CUDA backend: the exact path (`triton_fp8_moe.fp8_exact`).

An fp32 engine is the project's exact mode (cached == uncached within 1e-4 of the logits, token for token), and
its dense FP8 linears dequantise on CUDA as on the CPU. Its FP8 experts ran W8A8 before, quantising x and h to
e4m3 per token: a step function of x, so a cached and an uncached run whose x differ in the last fp32 bits
could round an element to neighbouring e4m3 values (1/16 of it apart), and the Granite FP8 folder's CUDA engine
test failed (tests/engine/test_fp8_mamba2_hybrids_engine.py). Now the backend's `moe` runs them W8A16 on the
checkpoint's own scales:

- Interpreted (TRITON_INTERPRET=1 child, tests/kernels/interpreter.py): `CudaBackend.moe` on fp32 x, per-channel
  and block-scaled experts, SiLU-gated and "relu2", at a decode and a prefill size (its start-up compile run
  too), equals the reference backend on the dequantised weights to fp32 summation order (1e-5 of the largest
  output; W8A8 is 1e-2 to 1e-1 off); every expert GEMM it launched took x / h unquantised (no activation
  scale), and block-scaled experts keep their blocks (not re-quantised per channel, which changes the weights).
- On the CPU without the interpreter: `fp8_exact` says fp32 only.
- On CUDA (skipped without one): the same against the reference backend at decode and prefill sizes, both
  formats and activations, to 1e-5 (the W8A16 kernel in IEEE fp32, `PRECISION` "ieee").
"""

from __future__ import annotations

import pytest
import torch

from hybridcache.fp8_format import BLOCK, CHANNEL
from tests.kernels.interpreter import interpreted_in_child, needs_cuda, needs_interpreter
from tests.kernels.test_fp8_relu2_experts import routes
from tests.kernels.test_fp8_rowwise_experts import block_experts, rel


@interpreted_in_child("test_interpreted_ and not subprocess")
def test_fp8_experts_fp32_in_a_triton_interpreter_subprocess() -> None:
    """This file's interpreted tests, in a child process (tests/kernels/interpreter.py)."""


def test_fp8_exact_is_fp32_only():
    from hybridcache.kernels.gemm.triton_fp8_moe import fp8_exact

    assert fp8_exact(torch.zeros(1, 4))
    assert not any(fp8_exact(torch.zeros(1, 4, dtype=dtype)) for dtype in (torch.bfloat16, torch.float16))


@needs_interpreter
@pytest.mark.parametrize("tokens", [9, 160], ids=["decode", "prefill"])
@pytest.mark.parametrize("activation", ["silu_gated", "relu2"])
@pytest.mark.parametrize("fmt", [CHANNEL, BLOCK], ids=["channel", "block"])
@torch.no_grad()
def test_interpreted_cuda_backend_runs_fp32_fp8_experts_exactly(fmt, activation, tokens, monkeypatch):
    """fp32 x through `CudaBackend.moe` (the stack, its start-up compile, the call) equals the reference backend
    to 1e-5 of the largest output, every expert GEMM unquantised; block-scaled experts stay block-scaled."""
    from hybridcache.kernels.attention.reference_backend import ReferenceAttention
    from hybridcache.kernels.backend import ReferenceBackend
    from hybridcache.kernels.cuda_backend import CudaBackend
    from hybridcache.kernels.gemm import triton_fp8_moe

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)  # a CPU-only torch has none
    a_scales: list[torch.Tensor | None] = []
    original = triton_fp8_moe.fp8_expert_gemm
    monkeypatch.setattr(triton_fp8_moe, "fp8_expert_gemm", lambda *a, **k: a_scales.append(a[1]) or original(*a, **k))
    generator = torch.Generator().manual_seed(tokens + len(activation))
    hidden, inter, num_experts, top_k = 256, 96, 4, 2  # 96: a partial column tile and a partial K group
    experts = block_experts(hidden, inter, num_experts, generator, fmt, gated=activation == "silu_gated")
    x = torch.randn(tokens, hidden, generator=generator)
    top_weights, top_ids = routes(tokens, num_experts, top_k, generator)
    want = ReferenceBackend().moe(x, top_weights, top_ids, experts, activation=activation)
    backend = CudaBackend(ReferenceAttention())
    got = backend.moe(x, top_weights, top_ids, experts, activation=activation)
    assert got.dtype == torch.float32 and len(a_scales) >= 2 and all(scale is None for scale in a_scales)
    assert all(expert.down_proj.fmt == fmt for expert in experts)
    assert backend._experts[experts].block == (fmt.block if fmt.kind == "block" else (1, 128))
    print(f"{fmt.describe()} {activation} at {tokens} tokens: {rel(got, want):.1e} of the largest output")
    assert rel(got, want) <= 1e-5


@needs_cuda
@pytest.mark.parametrize("tokens", [3, 64, 700], ids=["decode-3", "decode-64", "prefill-700"])
@pytest.mark.parametrize("activation", ["silu_gated", "relu2"])
@pytest.mark.parametrize("fmt", [CHANNEL, BLOCK], ids=["channel", "block"])
@torch.no_grad()
def test_cuda_backend_runs_fp32_fp8_experts_exactly(fmt, activation, tokens):
    """On the GPU: fp32 x through `CudaBackend.moe` (its start-up compile included) equals the reference backend on
    the dequantised weights to 1e-5 of the largest output (W8A8 would be 1e-2 to 1e-1 off), in fp32."""
    from hybridcache.kernels.attention.reference_backend import ReferenceAttention
    from hybridcache.kernels.backend import ReferenceBackend
    from hybridcache.kernels.cuda_backend import CudaBackend

    generator = torch.Generator().manual_seed(tokens)
    hidden, inter, num_experts, top_k = 256, 192, 8, 2
    experts = block_experts(hidden, inter, num_experts, generator, fmt, gated=activation == "silu_gated").cuda()
    x = torch.randn(tokens, hidden, generator=generator).cuda()
    top_weights, top_ids = (t.cuda() for t in routes(tokens, num_experts, top_k, generator))
    want = ReferenceBackend().moe(x, top_weights, top_ids, experts, activation=activation)
    got = CudaBackend(ReferenceAttention()).moe(x, top_weights, top_ids, experts, activation=activation)
    print(f"{fmt.describe()} {activation} at {tokens} tokens: {rel(got, want):.1e} of the largest output")
    assert got.dtype == torch.float32 and rel(got, want) <= 1e-5
