"""`CudaBackend` against `ReferenceBackend`, op by op, on batches the engine builds: fresh, continuing and
decode sequences mixed (the prefill kernels), and an all-decode step (the decode kernels). Needs CUDA; the
CPU half checks that `get_backend` keeps CPU runs on the reference backend without importing Triton."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from hybridcache.engine.input_builder import SeqChunk, build_forward_batch
from hybridcache.kernels.backend import ReferenceBackend, get_backend
from hybridcache.layers.mlp import MLP

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
NUM_SLOTS = 8
BLOCK = 64


def test_cpu_gets_the_reference_backend_without_triton() -> None:
    code = ("import sys, torch; from hybridcache.kernels.backend import get_backend, ReferenceBackend; "
            "assert isinstance(get_backend('cpu'), ReferenceBackend); "
            "assert 'triton' not in sys.modules and 'fla' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def engine_batch(lengths: list[tuple[int, int]], slots: list[int]):
    """(tokens cached before, new tokens) per sequence; blocks handed out in reverse order."""
    chunks, next_block = [], 40
    for (start, num), slot in zip(lengths, slots, strict=True):
        blocks = -(-(start + num) // BLOCK)
        chunks.append(SeqChunk(token_ids=[1] * num, start=start, block_ids=list(range(next_block,
                                                                                      next_block - blocks, -1)),
                               slot=slot))
        next_block -= blocks
    return build_forward_batch(chunks, block_size=BLOCK, kernel_block_size=BLOCK // 4, device="cuda")


MIXED = ([(0, 70), (130, 1), (37, 200), (0, 1), (63, 65), (5, 1)], [4, 0, 2, 5, 7, 1])
DECODE = ([(130, 1), (0, 1), (63, 1), (200, 1)], [3, 6, 0, 1])
# decode rows first (one of them a fresh 1-token prompt), then chunks, then a decode row: the DeltaNet layers run the
# leading decode rows in the step kernel (`fla.LeadingDecodes`)
LEADING = ([(130, 1), (0, 1), (5, 1), (37, 200), (0, 70), (63, 1)], [6, 3, 0, 2, 5, 7])


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("case", [MIXED, DECODE, LEADING], ids=["mixed", "decode", "leading-decodes"])
def test_cuda_backend_matches_reference_backend(case, dtype: torch.dtype) -> None:
    backend = get_backend("cuda")
    assert type(backend).__name__ == "CudaBackend"
    reference = ReferenceBackend()
    raw = engine_batch(*case)
    fast, slow = backend.prepare(raw), reference.prepare(raw)
    gen = torch.Generator().manual_seed(0)
    dev = torch.device("cuda")
    tokens = raw.input_ids.shape[0]

    def rand(*shape: int, scale: float = 1.0, to: torch.dtype = dtype) -> torch.Tensor:
        return (scale * torch.randn(*shape, generator=gen)).to(dev, to)

    bf16_tol = {"rtol": 2e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {"rtol": 2e-3, "atol": 2e-3}

    # conv + gated delta rule (Hk 2, Hv 4, Dk = Dv = 128, C = 1024)
    x, weight = rand(tokens, 1024), rand(1024, 4, scale=0.5)
    conv = rand(NUM_SLOTS, 1024, 3)
    conv_ref = conv.clone()
    torch.testing.assert_close(backend.causal_conv1d(x, weight, None, conv, fast),
                               reference.causal_conv1d(x, weight, None, conv_ref, slow), **bf16_tol)
    torch.testing.assert_close(conv, conv_ref, rtol=0, atol=0)
    q, k, v = rand(tokens, 2, 128), rand(tokens, 2, 128), rand(tokens, 4, 128)
    g = -F.softplus(rand(tokens, 4, to=torch.float32) - 1)
    beta = rand(tokens, 4).sigmoid()
    ssm = rand(NUM_SLOTS, 4, 128, 128, scale=0.1, to=torch.float32)
    ssm_ref = ssm.clone()
    torch.testing.assert_close(backend.gated_delta_rule(q, k, v, g, beta, ssm, fast),
                               reference.gated_delta_rule(q, k, v, g, beta, ssm_ref, slow), **bf16_tol)
    torch.testing.assert_close(ssm, ssm_ref, rtol=1e-2, atol=1e-2)
    # the gates from raw a, b (what the layer calls: in a decode step or for leading decode rows, inside the step
    # kernel)
    a, b = rand(tokens, 4), rand(tokens, 4)
    a_log = torch.empty(4).uniform_(0.05, 1.0, generator=gen).log().to(dev, dtype)
    dt_bias = torch.empty(4).uniform_(-1, 1, generator=gen).to(dev, dtype)
    ssm, ssm_ref = ssm_ref.clone(), ssm_ref.clone()
    torch.testing.assert_close(backend.gated_delta(q, k, v, a, b, a_log, dt_bias, ssm, fast),
                               reference.gated_delta(q, k, v, a, b, a_log, dt_bias, ssm_ref, slow), **bf16_tol)
    torch.testing.assert_close(ssm, ssm_ref, rtol=1e-2, atol=1e-2)

    # paged attention (Hq 8, Hkv 2, D 256) over a pool with history
    pool = rand(2, 44 * 4, BLOCK // 4, 2, 256)
    pool_ref = pool.clone()
    query, key, value = rand(tokens, 8, 256), rand(tokens, 2, 256), rand(tokens, 2, 256)
    backend.write_kv(pool, key, value, fast)
    reference.write_kv(pool_ref, key, value, slow)
    torch.testing.assert_close(pool, pool_ref, rtol=0, atol=0)
    torch.testing.assert_close(backend.attention(query, pool, fast, scale=256**-0.5),
                               reference.attention(query, pool_ref, slow, scale=256**-0.5), **bf16_tol)
    if dtype == torch.bfloat16:  # an FP8 pool (`kv_cache_dtype="fp8"`): both kernels read it as stored x its scales
        scales = (0.05, 0.03)
        fp8 = torch.stack([(pool[i].float() / scales[i]).clamp(-448, 448) for i in range(2)]).to(torch.float8_e4m3fn)
        torch.testing.assert_close(backend.attention(query, fp8, fast, scale=256**-0.5, kv_scales=scales),
                                   reference.attention(query, fp8.clone(), slow, scale=256**-0.5, kv_scales=scales),
                                   **bf16_tol)

    # routed experts (8 experts of width 128, hidden 256, top-2)
    experts = torch.nn.ModuleList(MLP(256, 128) for _ in range(8)).to(dev, dtype)
    x_moe = rand(tokens, 256)
    ids = torch.rand(tokens, 8, generator=gen).argsort(-1)[:, :2].to(dev)
    weights = torch.rand(tokens, 2, generator=gen).softmax(-1).to(dev, dtype)
    with torch.no_grad():
        want = reference.moe(x_moe, weights, ids, experts)
        got = backend.moe(x_moe, weights, ids, experts)
        torch.testing.assert_close(got, want, **bf16_tol)
        # the experts now share the stacked weights; a second call reuses them and still matches
        torch.testing.assert_close(backend.moe(x_moe, weights, ids, experts), want, **bf16_tol)
        assert experts[3].up_proj.weight.data_ptr() == backend._experts[experts].gate_up[3, 128:].data_ptr()

    # the feed-forward tails on column views of one fused output (width 128 + 128, then the router's 8 + 1)
    gate_up, router = rand(tokens, 256, scale=3.0), rand(tokens, 9, scale=3.0)
    gate, up = gate_up.split([128, 128], dim=-1)
    torch.testing.assert_close(backend.silu_mul(gate, up), reference.silu_mul(gate, up), **bf16_tol)
    routed, shared = rand(tokens, 256), rand(tokens, 256)
    torch.testing.assert_close(backend.sigmoid_gate_add(routed, router[:, 8:], shared),
                               reference.sigmoid_gate_add(routed, router[:, 8:], shared), **bf16_tol)
