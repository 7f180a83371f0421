"""The FP8 kernels against their torch references: the GEMMs (`kernels/gemm/reference.py`) and the paged attention
over an FP8 KV pool (`kernels/attention/reference.py` with kv_scales).

- The block-scaled GEMM and the FP8 grouped expert GEMM run on the CPU under TRITON_INTERPRET=1 (a child
  pytest, as in test_cuda_kernels.py; this process never imports triton) on small shapes with partial blocks.
  Their inputs are quantised by torch (the interpreter's float32 -> float8 conversion is wrong, its float8
  products are exact), so the kernel and `emulate_block_linear` multiply the same FP8 numbers and differ only by
  fp32 summation order: 1e-5 relative. The kernels' outputs are fp32 there.
- The Triton paged attention (prefill and split-KV decode) reading a float8_e4m3fn pool with k/v scales, in fp32
  (the interpreter's bf16 is wrong), against the reference, which dequantises the same stored bytes: 1e-5.
- On CUDA (skipped without one): `fp8_linear` for both formats against the dequantised reference in bf16, within
  the error of quantising the activations (a few e4m3 steps of 2^-4 relative): 6e-2 relative to max |ref|.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hybridcache.fp8_format import BLOCK, CHANNEL, Fp8Format
from hybridcache.kernels.gemm.reference import (
    dequantize,
    emulate_block_linear,
    linear,
    quantize,
    quantize_groups,
)

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
REPO_ROOT = Path(__file__).resolve().parents[2]
needs_interpreter = pytest.mark.skipif(not INTERPRETED, reason="runs in the TRITON_INTERPRET=1 child")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


@pytest.mark.skipif(INTERPRETED, reason="the parent of the interpreted tests (never spawns itself)")
def test_fp8_triton_kernels_in_a_triton_interpreter_subprocess() -> None:
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    # only the test_interpreted_* tests, never this one: a child that ran it would spawn children without end
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(Path(__file__)),
               "-k", "test_interpreted_ and not subprocess"]
    result = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout, result.stdout[-3000:]


@needs_interpreter
@pytest.mark.parametrize("m, n, k, block", [(5, 200, 300, (128, 128)), (33, 64, 96, (32, 32)),
                                           (1, 130, 128, (128, 128))])
def test_interpreted_block_fp8_gemm(m, n, k, block):
    from hybridcache.kernels.gemm.triton_block_fp8 import block_fp8_gemm

    generator = torch.Generator().manual_seed(m + n + k)
    fmt = Fp8Format("block", block)
    weight, scale = quantize(torch.randn(n, k, generator=generator), fmt)
    xq, x_scale = quantize_groups(torch.randn(m, k, generator=generator) * 3, block[1])
    got = block_fp8_gemm(xq, x_scale, weight, scale, block, torch.float32, block_m=16, block_n=32)
    want = emulate_block_linear(xq, x_scale, weight, scale, block)
    assert rel(got, want) <= 1e-5
    # and that is the dequantised product of the quantised operands
    dense = (xq.float() * x_scale.repeat_interleave(block[1], 1)[:, :k]) @ dequantize(weight, scale, fmt,
                                                                                       torch.float32).T
    assert rel(got, dense) <= 1e-5


@needs_interpreter
def test_interpreted_block_fp8_gemm_checks_its_inputs():
    from hybridcache.kernels.gemm.triton_block_fp8 import block_fp8_gemm

    weight, scale = quantize(torch.randn(64, 128), BLOCK)
    xq, x_scale = quantize_groups(torch.randn(4, 128))
    with pytest.raises(ValueError, match="must be torch.float8_e4m3fn"):
        block_fp8_gemm(xq.float(), x_scale, weight, scale, (128, 128), torch.float32)
    with pytest.raises(ValueError, match="scales"):
        block_fp8_gemm(xq, x_scale[:, :0], weight, scale, (128, 128), torch.float32)
    with pytest.raises(ValueError, match="unit stride"):
        block_fp8_gemm(xq.t().contiguous().t(), x_scale, weight, scale, (128, 128), torch.float32)


@needs_interpreter
@pytest.mark.parametrize("inter", [64, 96], ids=["I64", "I96-partial-groups"])
def test_interpreted_fp8_grouped_experts(inter):
    """The FP8 routed experts (gather, SwiGLU, scatter, combine) against the same arithmetic in torch: each pick's
    expert on its token's quantised activations, h re-quantised per 32 channels, weighted sum."""
    from hybridcache.kernels.gemm.triton_fp8_moe import Fp8ExpertWeights, fp8_grouped_experts

    generator = torch.Generator().manual_seed(inter)
    tokens, hidden, experts, top_k, block = 7, 64, 5, 2, (32, 32)
    fmt = Fp8Format("block", block)
    x = torch.randn(tokens, hidden, generator=generator)
    gate = [quantize(torch.randn(inter, hidden, generator=generator) / 8, fmt) for _ in range(experts)]
    up = [quantize(torch.randn(inter, hidden, generator=generator) / 8, fmt) for _ in range(experts)]
    down = [quantize(torch.randn(hidden, inter, generator=generator) / 8, fmt) for _ in range(experts)]
    stacked = Fp8ExpertWeights(
        gate_up=torch.stack([torch.cat([g[0], u[0]]) for g, u in zip(gate, up, strict=True)]),
        gate_up_scale=torch.stack([torch.cat([g[1], u[1]]) for g, u in zip(gate, up, strict=True)]),
        down=torch.stack([d[0] for d in down]), down_scale=torch.stack([d[1] for d in down]), block=block)
    top_ids = torch.stack([torch.randperm(experts, generator=generator)[:top_k] for _ in range(tokens)])
    top_weights = torch.rand(tokens, top_k, generator=generator)
    got = fp8_grouped_experts(x, top_weights, top_ids, stacked)
    xq, xs = quantize_groups(x, block[1])
    want = torch.zeros_like(x)
    for t in range(tokens):
        for j in range(top_k):
            e = int(top_ids[t, j])
            g = emulate_block_linear(xq[t : t + 1], xs[t : t + 1], *gate[e], block)
            u = emulate_block_linear(xq[t : t + 1], xs[t : t + 1], *up[e], block)
            hq, hs = quantize_groups(torch.nn.functional.silu(g) * u, block[1])
            want[t] += top_weights[t, j] * emulate_block_linear(hq, hs, *down[e], block)[0]
    assert rel(got, want) <= 1e-4  # h is re-quantised: a one-step e4m3 rounding flip moves a term by 2^-4


@needs_cuda
@pytest.mark.parametrize("fmt", [BLOCK, CHANNEL], ids=["block", "channel"])
@pytest.mark.parametrize("m", [1, 64, 300])
def test_cuda_fp8_linear(fmt, m):
    from hybridcache.kernels.backend import fp8_linear

    generator = torch.Generator().manual_seed(m)
    weight, scale = quantize(torch.randn(384, 512, generator=generator), fmt)
    x = torch.randn(m, 512, generator=generator).to("cuda", torch.bfloat16)
    got = fp8_linear(x, weight.cuda(), scale.cuda(), fmt)
    want = linear(x.float(), weight.cuda(), scale.cuda(), fmt)
    assert got.dtype == torch.bfloat16 and rel(got, want) <= 6e-2


@needs_interpreter
@pytest.mark.parametrize("fmt", [BLOCK, CHANNEL], ids=["block", "channel"])
def test_interpreted_fp8_experts_of_the_model_against_the_reference_backend(fmt):
    """The CUDA backend's FP8 MoE path (experts stacked from `Fp8Linear` modules by `Fp8ExpertWeights.share`,
    per-channel scales as (1, 128) blocks) against the reference backend's (dequantised weights, activations not
    quantised): within the activations' e4m3 rounding, 5e-2 relative."""
    from torch import nn

    from hybridcache.kernels.backend import ReferenceBackend
    from hybridcache.kernels.gemm.triton_fp8_moe import Fp8ExpertWeights, fp8_grouped_experts
    from hybridcache.models.quant import quantize_linears_

    generator = torch.Generator().manual_seed(7)
    hidden, inter, num_experts, top_k, tokens = 128, 96, 4, 2, 9
    experts = nn.ModuleList()
    for _ in range(num_experts):
        expert = nn.Module()
        expert.gate_proj, expert.up_proj = nn.Linear(hidden, inter, bias=False), nn.Linear(hidden, inter, bias=False)
        expert.down_proj = nn.Linear(inter, hidden, bias=False)
        for proj in (expert.gate_proj, expert.up_proj, expert.down_proj):
            proj.weight.data = torch.randn(proj.weight.shape, generator=generator) / proj.in_features**0.5
        experts.append(expert)
    quantize_linears_(experts, [n for n, m in experts.named_modules() if isinstance(m, nn.Linear)], fmt)
    x = torch.randn(tokens, hidden, generator=generator)
    top_ids = torch.stack([torch.randperm(num_experts, generator=generator)[:top_k] for _ in range(tokens)])
    top_weights = torch.rand(tokens, top_k, generator=generator)
    want = ReferenceBackend().moe(x, top_weights, top_ids, experts)
    got = fp8_grouped_experts(x, top_weights, top_ids, Fp8ExpertWeights.share(experts))
    assert rel(got, want) <= 5e-2
    assert rel(got, want) > 0  # the activations were quantised: not the reference's arithmetic bit for bit


@needs_interpreter
@pytest.mark.parametrize("decode", [False, True], ids=["prefill", "decode"])
def test_interpreted_paged_attention_reads_an_fp8_pool(decode):
    from hybridcache.kernels.attention import reference
    from hybridcache.kernels.attention.triton_paged import paged_attention

    generator = torch.Generator().manual_seed(int(decode))
    page, heads, kv_heads, dim, num_pages = 16, 4, 2, 32, 12
    context_lens = [40, 23, 70]
    query_lens = [1, 1, 1] if decode else [40, 5, 17]
    pool = (torch.randn(2, num_pages, page, kv_heads, dim, generator=generator) * 3).to(torch.float8_e4m3fn)
    order = torch.randperm(num_pages - 1, generator=generator) + 1
    block_tables = torch.stack([order[i * 5 : (i + 1) * 5] for i in range(2)] + [order[:5].flip(0)]).int()
    block_tables = block_tables[:, : -(-max(context_lens) // page)]
    q = torch.randn(sum(query_lens), heads, dim, generator=generator)
    cu = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    scales = (0.5, 2.0)
    args = (q, pool, block_tables, cu, torch.tensor(context_lens, dtype=torch.int32), query_lens, context_lens)
    got = paged_attention(*args, scale=dim**-0.5, kv_scales=scales)
    want = reference.paged_attention(q, pool, block_tables, cu, tuple(query_lens), tuple(context_lens),
                                     scale=dim**-0.5, kv_scales=scales)
    assert rel(got, want) <= 1e-5
    unscaled = reference.paged_attention(q, pool, block_tables, cu, tuple(query_lens), tuple(context_lens),
                                         scale=dim**-0.5)
    assert rel(unscaled, want) > 1e-2  # the scales matter: the check would notice them ignored


def test_gemm_backends_are_registered_by_name():
    from hybridcache.kernels.backend import fp8_linear, gemm_backend
    from hybridcache.kernels.registry import GEMM

    assert {"reference", "triton"} <= set(GEMM.names)
    assert type(gemm_backend(None, "cpu")).__name__ == "ReferenceGemm"
    with pytest.raises(ValueError, match="runs on cuda"):
        gemm_backend("triton", "cpu")
    weight, scale = quantize(torch.randn(32, 64), BLOCK)
    x = torch.randn(3, 64)
    assert torch.equal(fp8_linear(x, weight, scale, BLOCK, gemm="reference"), linear(x, weight, scale, BLOCK))
