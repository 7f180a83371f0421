"""The fused small kernels of a decode step against the torch references, on the layouts the layers pass:

- `add_rms_norm` and `rms_norm` (`kernels/norm/triton.py`): a decoder layer's residual add and the next RMSNorm, and
  the norm alone on a strided head view (a q_norm), with each `Weighting` (zero-centred: Qwen's; the weight as it
  is, times the rounded norm or in fp32: the other families'); `gated_group_rms_norm`, Mamba2's gated norm per group of
  channels (the gate first, or the norm first as Falcon-H1's), on the scan's fp32 output and a strided gate;
- `norm_rotary` (`kernels/rotary/triton.py`): the attention layer's q_norm, k_norm and partial RoPE, on query and
  key head views of one fused q|gate / k / v projection (strided over tokens and heads), odd head counts, a
  rotary dim below the head dim;
- `sigmoid_mul` (`kernels/activation/triton.py`): the attention output gate, the gate a strided head view.

Each in bf16 and fp32 with odd row counts. `test_cuda_*`: compiled on a CUDA device (skipped without one).
`test_interpreted_*`: the same checks on the CPU under TRITON_INTERPRET=1, in a child process
(`test_fused_decode_kernels_in_a_triton_interpreter_subprocess`). Tolerances: fp32 1e-5 relative (the kernels
sum in another order than torch; the sigmoid's formula differs). bf16: the kernels round where torch rounds, so an
element may differ by one bf16 step (2^-8 relative) where an fp32 intermediate falls near a rounding boundary;
norm_rotary rounds the norm and then the rotation (two steps, and the rotation's two terms may cancel: bounded
relative to |n cos| + |n' sin|); the interpreter truncates to bf16 rather than rounding, so its bf16 bounds are
doubled (quadrupled for `Weighting.ROUNDED`'s three roundings). The residual sum of add_rms_norm is a single rounded
add on both sides: equal exactly on CUDA.
"""

from __future__ import annotations

import pytest
import torch

from hybridcache.kernels.activation import reference as activation_ref
from hybridcache.kernels.norm import reference as norm_ref
from hybridcache.kernels.norm.reference import Weighting
from hybridcache.kernels.rotary import reference as rotary_ref
from hybridcache.layers.rotary import rotary_cos_sin
from tests.kernels.interpreter import INTERPRETED, interpreted_in_child, needs_cuda, needs_interpreter

DTYPES = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
ULP = {torch.bfloat16: 2.0**-7, torch.float32: 1e-5}


def randn(shape: tuple[int, ...], seed: int, scale: float = 1.0) -> torch.Tensor:
    return scale * torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def check_add_rms_norm(rows: int, dim: int, dtype: torch.dtype, device: str, rtol: float,
                       weighting: Weighting = Weighting.ZERO_CENTRED, scale: float = 1.0) -> None:
    """`scale` (Granite's residual multiplier): the residual times it, rounded, then the add, as transformers'
    `residual + out * residual_multiplier` (the reference is torch's two ops)."""
    from hybridcache.kernels.norm import triton as fused

    x = randn((rows, dim), 1, 2.0).to(device, dtype)
    residual = randn((rows, dim), 2, 3.0).to(device, dtype)
    weight = randn((dim,), 3, 0.5).to(device, dtype)
    total, normed = fused.add_rms_norm(x, residual, weight, 1e-6, weighting, scale)
    want_total, want_normed = norm_ref.add_rms_norm(x, residual, weight, 1e-6, weighting, scale)
    if scale != 1.0:
        assert torch.equal(want_total, x + residual * scale)
    assert total.dtype == normed.dtype == dtype and total.is_contiguous() and normed.is_contiguous()
    if device == "cuda":  # one rounded add on both sides
        assert torch.equal(total, want_total)
    else:  # the interpreter truncates where torch rounds (a truncated scaled residual: an ulp of it, absolute,
        # which a cancelling sum does not shrink)
        atol = 0.0 if scale == 1.0 else rtol * float((residual.float() * scale).abs().max())
        torch.testing.assert_close(total, want_total, rtol=rtol, atol=atol)
    if device == "cuda" or scale == 1.0:  # (the interpreter's truncated scaled sums: checked above, then their norm)
        torch.testing.assert_close(normed, want_normed, rtol=rtol, atol=rtol * 1e-2)
    # the norm is of the rounded sum: against torch's norm of our own sum, bit-for-bit tolerances do not widen
    torch.testing.assert_close(normed, norm_ref.rms_norm(total, weight, 1e-6, weighting), rtol=rtol,
                               atol=rtol * 1e-2)


def check_gated_group_rms_norm(dtype: torch.dtype, device: str, rtol: float, group_size: int,
                               norm_before_gate: bool) -> None:
    """Mamba2's gated group norm (`norm/triton.gated_group_rms_norm`) against `mamba2.reference`: x the scan's fp32
    output [T, I], the gate a column view of a wider projection row in `dtype`, the output in the gate's dtype."""
    from hybridcache.kernels.mamba2 import reference as mamba2_ref
    from hybridcache.kernels.norm import triton as fused

    width = 240
    x = randn((9, width), 11, 2.0).to(device)
    gate = randn((9, width + 100), 12, 2.0).to(device, dtype)[:, 40 : 40 + width]
    weight = randn((width,), 13, 0.5).to(device, dtype)
    got = fused.gated_group_rms_norm(x, gate, weight, 1e-5, group_size, norm_before_gate)
    want = mamba2_ref.gated_group_rms_norm(x, gate, weight, 1e-5, group_size, norm_before_gate)
    assert got.dtype == dtype and got.shape == (9, width) and got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=rtol, atol=rtol * 1e-2)


def check_rms_norm_of_head_views(dtype: torch.dtype, device: str, rtol: float, weighting: Weighting) -> None:
    """The norm alone over each head of a strided [T, H, D] view (LFM2's and OLMo Hybrid's q_norm / k_norm read the
    heads of one fused projection), then over a 2-D tensor (a final norm), against the torch reference."""
    from hybridcache.kernels.norm import triton as fused

    mixed = randn((9, 7 * 64), 7, 2.0).to(device, dtype)
    heads = mixed[:, 64:5 * 64].view(9, 4, 64)  # 4 heads of 64 at column 64 of each 448-wide row
    weight = randn((64,), 8, 0.5).to(device, dtype)
    got = fused.rms_norm(heads, weight, 1e-5, weighting)
    assert got.shape == heads.shape and got.is_contiguous() and got.dtype == dtype
    torch.testing.assert_close(got, norm_ref.rms_norm(heads, weight, 1e-5, weighting), rtol=rtol, atol=rtol * 1e-2)
    flat = randn((5, 300), 9).to(device, dtype)
    wide = randn((300,), 10, 0.5).to(device, dtype)
    torch.testing.assert_close(fused.rms_norm(flat, wide, 1e-6, weighting), norm_ref.rms_norm(flat, wide, 1e-6,
                                                                                                 weighting),
                               rtol=rtol, atol=rtol * 1e-2)


def qkv_views(rows: int, q_heads: int, k_heads: int, head_dim: int, dtype: torch.dtype, device: str):
    """query, gate [rows, Hq, D] and key [rows, Hk, D]: views of one fused [rows, (2 Hq + 2 Hk) D] q|gate, k, v
    projection, as the attention layer slices them."""
    q_width, k_width = 2 * q_heads * head_dim, k_heads * head_dim
    mixed = randn((rows, q_width + 2 * k_width), 4, 2.0).to(device, dtype)
    query, gate = mixed[:, :q_width].view(rows, q_heads, 2 * head_dim).chunk(2, dim=-1)
    key = mixed[:, q_width:q_width + k_width].view(rows, k_heads, head_dim)
    return query, gate, key


def check_norm_rotary(rows: int, heads: tuple[int, int], head_dim: int, rotary_dim: int, dtype: torch.dtype,
                      device: str, rtol: float) -> None:
    from hybridcache.kernels.rotary import triton as fused

    query, _, key = qkv_views(rows, *heads, head_dim, dtype, device)
    assert not query.is_contiguous() and (rows == 1 or not key.is_contiguous())
    q_weight = randn((head_dim,), 5, 0.5).to(device, dtype)
    k_weight = randn((head_dim,), 6, 0.5).to(device, dtype)
    positions = torch.randint(0, 40000, (rows,), generator=torch.Generator().manual_seed(7)).to(device)
    cos, sin = rotary_cos_sin(positions, rotary_dim, 10000000.0, dtype)
    got = fused.norm_rotary(query, key, q_weight, k_weight, 1e-6, cos, sin)
    want = rotary_ref.norm_rotary(query, key, q_weight, k_weight, 1e-6, cos, sin)
    for out, ref, x, weight in zip(got, want, (query, key), (q_weight, k_weight), strict=True):
        assert out.dtype == dtype and out.is_contiguous() and out.shape == x.shape
        normed = norm_ref.rms_norm(x, weight, 1e-6).float()  # the rotation's terms: |n cos| + |n' sin| per element
        half = rotary_dim // 2
        partner = torch.cat([normed[..., half:rotary_dim], normed[..., :half], normed[..., rotary_dim:]], dim=-1)
        cos_full = torch.cat([cos.float(), torch.ones(rows, head_dim - rotary_dim, device=device)], dim=-1)
        sin_full = torch.cat([sin.float(), torch.zeros(rows, head_dim - rotary_dim, device=device)], dim=-1)
        scale = (normed * cos_full[:, None]).abs() + (partner * sin_full[:, None]).abs()
        err = (out.float() - ref.float()).abs()
        assert (err <= 2 * rtol * scale + 1e-30).all(), (err - 2 * rtol * scale).max()


def check_sigmoid_mul(rows: int, heads: int, head_dim: int, dtype: torch.dtype, device: str, rtol: float) -> None:
    from hybridcache.kernels.activation import triton as fused

    _, gate, _ = qkv_views(rows, heads, 1, head_dim, dtype, device)
    x = randn((rows, heads, head_dim), 8).to(device, dtype)
    assert rows == 1 or not gate.is_contiguous()
    got = fused.sigmoid_mul(x, gate)
    assert got.is_contiguous() and got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got, activation_ref.sigmoid_mul(x, gate), rtol=rtol, atol=rtol * 1e-2)


NORM_SHAPES = pytest.mark.parametrize("rows, dim", [(37, 300), (3, 2048), (1, 64), (5, 2500)])
ROTARY_SHAPES = pytest.mark.parametrize("rows, heads, head_dim, rotary_dim",
                                        [(37, (16, 2), 256, 64), (3, (5, 3), 96, 96), (1, (8, 1), 128, 32)])
GATE_SHAPES = pytest.mark.parametrize("rows, heads, head_dim", [(37, 16, 256), (3, 5, 96), (1, 1, 64)])


WEIGHTINGS = pytest.mark.parametrize("weighting", list(Weighting), ids=[w.name.lower() for w in Weighting])


@needs_cuda
@DTYPES
@NORM_SHAPES
@WEIGHTINGS
def test_cuda_add_rms_norm(rows: int, dim: int, dtype: torch.dtype, weighting: Weighting) -> None:
    check_add_rms_norm(rows, dim, dtype, "cuda", ULP[dtype], weighting)


@needs_cuda
@DTYPES
@NORM_SHAPES
def test_cuda_add_rms_norm_with_a_residual_multiplier(rows: int, dim: int, dtype: torch.dtype) -> None:
    """Granite's norms: x + round(residual * 0.22), then the rounded norm times the weight; the sum bit for bit."""
    check_add_rms_norm(rows, dim, dtype, "cuda", ULP[dtype], Weighting.ROUNDED, scale=0.22)


GROUPS = pytest.mark.parametrize(("group_size", "norm_before_gate"), [(240, False), (48, False), (80, True)],
                                 ids=["one-group", "five-groups", "three-groups-norm-first"])


@needs_cuda
@DTYPES
@GROUPS
def test_cuda_gated_group_rms_norm(dtype: torch.dtype, group_size: int, norm_before_gate: bool) -> None:
    check_gated_group_rms_norm(dtype, "cuda", ULP[dtype], group_size, norm_before_gate)


@needs_cuda
@DTYPES
@WEIGHTINGS
def test_cuda_rms_norm_of_head_views(dtype: torch.dtype, weighting: Weighting) -> None:
    check_rms_norm_of_head_views(dtype, "cuda", ULP[dtype], weighting)


@needs_cuda
@DTYPES
@ROTARY_SHAPES
def test_cuda_norm_rotary(rows: int, heads: tuple[int, int], head_dim: int, rotary_dim: int,
                          dtype: torch.dtype) -> None:
    check_norm_rotary(rows, heads, head_dim, rotary_dim, dtype, "cuda", ULP[dtype])


@needs_cuda
@DTYPES
@GATE_SHAPES
def test_cuda_sigmoid_mul(rows: int, heads: int, head_dim: int, dtype: torch.dtype) -> None:
    check_sigmoid_mul(rows, heads, head_dim, dtype, "cuda", ULP[dtype])


@needs_cuda
def test_cuda_norm_rotary_equals_the_unfused_kernels() -> None:
    """The fused kernel stores what rms_norm's kernel stores and rotates it with rotary's expression: in bf16 the
    same bits as the two kernels it replaces (so the engine's outputs do not move)."""
    from hybridcache.kernels.norm.triton import rms_norm
    from hybridcache.kernels.rotary.triton import norm_rotary, rotary

    query, _, key = qkv_views(29, 16, 2, 256, torch.bfloat16, "cuda")
    q_weight, k_weight = randn((256,), 5, 0.5).cuda().bfloat16(), randn((256,), 6, 0.5).cuda().bfloat16()
    cos, sin = rotary_cos_sin(torch.arange(1000, 1029, device="cuda"), 64, 10000000.0, torch.bfloat16)
    fused = norm_rotary(query, key, q_weight, k_weight, 1e-6, cos, sin)
    unfused = rotary(rms_norm(query, q_weight, 1e-6), rms_norm(key, k_weight, 1e-6), cos, sin)
    for got, want in zip(fused, unfused, strict=True):
        assert (got != want).float().mean().item() < 1e-3  # FMA contraction may differ in rare elements
        torch.testing.assert_close(got, want, rtol=2.0**-7, atol=1e-3)


@needs_cuda
def test_cuda_wrong_shapes_are_refused() -> None:
    from hybridcache.kernels.activation.triton import sigmoid_mul
    from hybridcache.kernels.norm.triton import add_rms_norm
    from hybridcache.kernels.rotary.triton import norm_rotary

    x = torch.zeros(4, 8, device="cuda")
    with pytest.raises(ValueError, match="add_rms_norm: residual"):
        add_rms_norm(x, torch.zeros(4, 9, device="cuda"), torch.zeros(8, device="cuda"), 1e-6)
    with pytest.raises(ValueError, match="sigmoid_mul"):
        sigmoid_mul(x, x)
    q = torch.zeros(4, 2, 8, device="cuda")
    with pytest.raises(ValueError, match="norm_rotary: key"):
        norm_rotary(q, torch.zeros(3, 1, 8, device="cuda"), x[0], x[0], 1e-6, x[:, :4], x[:, :4])
    empty = torch.zeros(0, 2, 8, device="cuda")
    assert norm_rotary(empty, empty, x[0], x[0], 1e-6, x[:0, :4], x[:0, :4])[0].shape == (0, 2, 8)
    assert add_rms_norm(x[:0], x[:0], x[0], 1e-6)[1].shape == (0, 8)


@interpreted_in_child("test_interpreted_ and not subprocess")
def test_fused_decode_kernels_in_a_triton_interpreter_subprocess() -> None:
    """This file's interpreted tests, in a child process (tests/kernels/interpreter.py)."""


@needs_interpreter
@DTYPES
@NORM_SHAPES
@WEIGHTINGS
def test_interpreted_add_rms_norm(rows: int, dim: int, dtype: torch.dtype, weighting: Weighting) -> None:
    # ROUNDED truncates three times here (the sum, the norm, its product with w) where torch rounds
    check_add_rms_norm(rows, dim, dtype, "cpu", (4 if weighting == Weighting.ROUNDED else 2) * ULP[dtype], weighting)


@needs_interpreter
@DTYPES
@NORM_SHAPES
def test_interpreted_add_rms_norm_with_a_residual_multiplier(rows: int, dim: int, dtype: torch.dtype) -> None:
    # four truncations where torch rounds: the scaled residual, the sum, the norm, its product with w
    check_add_rms_norm(rows, dim, dtype, "cpu", 6 * ULP[dtype], Weighting.ROUNDED, scale=0.22)


@needs_interpreter
@DTYPES
@GROUPS
def test_interpreted_gated_group_rms_norm(dtype: torch.dtype, group_size: int, norm_before_gate: bool) -> None:
    check_gated_group_rms_norm(dtype, "cpu", 2 * ULP[dtype], group_size, norm_before_gate)


@needs_interpreter
@DTYPES
@WEIGHTINGS
def test_interpreted_rms_norm_of_head_views(dtype: torch.dtype, weighting: Weighting) -> None:
    check_rms_norm_of_head_views(dtype, "cpu", (4 if weighting == Weighting.ROUNDED else 2) * ULP[dtype], weighting)


def test_a_rounded_norm_with_a_weight_of_another_dtype_runs_the_reference() -> None:
    """`Weighting.ROUNDED` multiplies the rounded norm by the weight in the product's dtype, which is the wider of
    the two: the kernel writes x's dtype, so such a call runs the torch reference (what the module computed)."""
    from hybridcache.kernels.norm import triton as fused

    x = randn((3, 16), 11).bfloat16()
    weight = randn((16,), 12, 0.5)  # fp32
    got = fused.rms_norm(x, weight, 1e-6, Weighting.ROUNDED)
    assert got.dtype == torch.float32
    assert torch.equal(got, weight * norm_ref.rms_norm(x, torch.ones(16), 1e-6, Weighting.FP32))
    total, normed = fused.add_rms_norm(x, x, weight, 1e-6, Weighting.ROUNDED)
    assert torch.equal(normed, norm_ref.add_rms_norm(x, x, weight, 1e-6, Weighting.ROUNDED)[1])


@needs_interpreter
@DTYPES
@ROTARY_SHAPES
def test_interpreted_norm_rotary(rows: int, heads: tuple[int, int], head_dim: int, rotary_dim: int,
                                 dtype: torch.dtype) -> None:
    check_norm_rotary(rows, heads, head_dim, rotary_dim, dtype, "cpu", 2 * ULP[dtype])


@needs_interpreter
@DTYPES
@GATE_SHAPES
def test_interpreted_sigmoid_mul(rows: int, heads: int, head_dim: int, dtype: torch.dtype) -> None:
    check_sigmoid_mul(rows, heads, head_dim, dtype, "cpu", 2 * ULP[dtype])


def check_step_gates(dtype: torch.dtype, device: str, exact: bool, dims: tuple[int, int] = (32, 64)) -> None:
    """The decode step kernel making the gates from a, b (`gates=`) against `delta_gates` then the same kernel, on
    equal pools: the same outputs and states (bit-for-bit on CUDA: one code for the gates), other slots untouched.
    a, b are strided column slices of one [N, 2 Hv] projection (Qwen3-Next's in_proj_ba); a + dt_bias spans
    softplus's three regimes; some sequences are fresh (context_len 1). `dims`: the key and value head dims."""
    from hybridcache.kernels.gated_delta.triton_gates import delta_gates
    from hybridcache.kernels.gated_delta.triton_step import gated_delta_rule_decode

    (num, hk, hv), (dk, dv) = (7, 2, 6), dims
    gen = torch.Generator().manual_seed(11)
    q, k = (torch.randn(num, hk, dk, generator=gen).to(device, dtype) for _ in range(2))
    v = torch.randn(num, hv, dv, generator=gen).to(device, dtype)
    ba = (torch.linspace(-30, 30, num * 2 * hv)[torch.randperm(num * 2 * hv, generator=gen)]).view(num, 2 * hv)
    b, a = ba.to(device, dtype).split([hv, hv], dim=-1)
    a_log = torch.randn(hv, generator=gen).to(device, dtype)
    dt_bias = torch.randn(hv, generator=gen).to(device, dtype)
    slots = torch.randperm(2 * num + 1, generator=gen)[:num].to(device)
    context_lens = torch.tensor([1, 5, 1, 9, 30, 2, 7], dtype=torch.int32, device=device)
    pool = (0.1 * torch.randn(2 * num + 1, hv, dk, dv, generator=gen)).to(device)
    fused_pool, plain_pool = pool.clone(), pool.clone()
    fused = gated_delta_rule_decode(q, k, v, a, b, fused_pool, slots, context_lens, gates=(a_log, dt_bias))
    g, beta = delta_gates(a, b, a_log, dt_bias)
    plain = gated_delta_rule_decode(q, k, v, g, beta, plain_pool, slots, context_lens)
    if exact:
        assert torch.equal(fused, plain) and torch.equal(fused_pool, plain_pool)
    else:  # the interpreter's numpy math may round the two programs' expressions differently
        torch.testing.assert_close(fused, plain, rtol=2 * ULP[dtype], atol=1e-5)
        torch.testing.assert_close(fused_pool, plain_pool, rtol=1e-5, atol=1e-6)
    keep = torch.ones(pool.shape[0], dtype=torch.bool, device=device)
    keep[slots] = False
    assert torch.equal(fused_pool[keep], pool[keep])
    assert not torch.equal(fused_pool[slots], pool[slots])


@needs_cuda
@DTYPES
def test_cuda_step_kernel_makes_the_gates(dtype: torch.dtype) -> None:
    check_step_gates(dtype, "cuda", exact=True)


@needs_interpreter
@DTYPES
def test_interpreted_step_kernel_makes_the_gates(dtype: torch.dtype) -> None:
    check_step_gates(dtype, "cpu", exact=False)


@pytest.mark.skipif(INTERPRETED, reason="torch only: runs in the parent")
@DTYPES
def test_rotary_cos_sin_keeps_its_formula(dtype: torch.dtype) -> None:
    """`rotary_cos_sin` keeps its doubled inverse-frequency table between steps: every element is still
    cos / sin(position * 1 / base^(2i / R)) as computed step by step, bit for bit, inside and outside inference mode."""
    positions = torch.randint(0, 200000, (123,), generator=torch.Generator().manual_seed(9))
    for rotary_dim, base in ((64, 10000000.0), (26, 10000.0)):
        exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(torch.float32)
        inv_freq = 1.0 / (base ** (exponents / rotary_dim))
        freqs = positions.float()[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        with torch.inference_mode():
            first = rotary_cos_sin(positions, rotary_dim, base, dtype)
        for got in (first, rotary_cos_sin(positions, rotary_dim, base, dtype)):
            assert torch.equal(got[0], emb.cos().to(dtype)) and torch.equal(got[1], emb.sin().to(dtype))
