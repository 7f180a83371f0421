"""The norms that also quantise for the FP8 linear after them (`kernels/norm/triton.py`: `add_rms_norm_fp8`,
`gated_rms_norm_fp8`) and the FP8 GEMMs on such pre-quantised input (`layers.linear.Fp8Rows`,
`triton_block_fp8.fp8_linear(..., quantized=...)`):

- the fused norm's quantisation equals `triton_quant.quantize_groups(out, 128, pad_rows=4, column_major=True)` of
  its own output bit for bit (the FP8 bytes, every scale, the padding tokens), its sum equals the plain kernel's,
  its output the plain kernel's bit for bit in the interpreter and within one rounding step compiled (the sum of
  squares reduced in the compiler's order), on a ragged last group, a row narrower than a group, strided inputs
  (column slices of a wider tensor, head views) and a row count that is not a multiple of 4; bf16 and fp32;
- the GEMMs read the activation scales through both strides: column-major scales give the bits of row-major ones
  (`fp8_gemm`, `fp8_gemm_splitk`), and `fp8_linear` on `quantized` gives the bits of `fp8_linear` quantising
  itself (the Triton W8A8 path here; on CUDA also cuBLAS's block-scaled GEMM and split-K at next-16b's shapes);
- `triton_quant.quantize_rows_scatter` (the row-wise experts' x, each token quantised once and written to its
  sorted rows) equals `quantize_rows` followed by the gather of both outputs in sorted order, bit for bit;
- the CPU fallbacks (`kernels/norm/fp8.py` off CUDA, through `layers/norm.py`) and the module plumbing: an
  `Fp8Linear`, `module_linear` and a `FusedProjection` of an FP8 and a dense linear give the same output for
  `Fp8Rows` as for their x.

Interpreted tests run in a TRITON_INTERPRET=1 child (`test_fp8_prequantized_in_a_triton_interpreter_subprocess`),
both sides of each comparison interpreted (the interpreter truncates bf16 where CUDA rounds, alike on both).
`test_cuda_*`: compiled on a CUDA device (skipped without one).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hybridcache.fp8_format import BLOCK, FP8_DTYPE
from hybridcache.kernels.gemm.reference import quantize
from hybridcache.kernels.norm import reference as norm_ref
from tests.kernels.interpreter import interpreted_in_child, needs_cuda, needs_interpreter


@interpreted_in_child("test_interpreted_ and not subprocess")
def test_fp8_prequantized_in_a_triton_interpreter_subprocess() -> None:
    """This file's interpreted tests, in a child process (tests/kernels/interpreter.py)."""


def randn(shape: tuple[int, ...], seed: int, scale: float = 1.0) -> torch.Tensor:
    return scale * torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def assert_same_quantization(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]):
    (q, scale), (want_q, want_scale) = got, want
    assert q.dtype == FP8_DTYPE and q.shape == want_q.shape
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    assert scale.shape == want_scale.shape and scale.stride() == want_scale.stride() == (1, q.shape[0])
    assert torch.equal(scale, want_scale)


def assert_same_norm(got: torch.Tensor, want: torch.Tensor, device: str) -> None:
    """The fused kernel's norm against the plain norm kernel's: the same bits in the interpreter. Compiled, the
    sum of squares may be reduced in another order (the compiler lays the fused kernel's tile out for its group
    maxima), so the two rstd differ by a few fp32 rounding steps (a tree reduction of n terms: at most log2(n)
    roundings apart, <= 16 x 2^-24 for rows of up to 65,536): fp32 outputs within 2^-19 relative; in bf16 / fp16
    that difference can flip each of the kernels' chained roundings to the output dtype (normed, w x normed and,
    gated, the product with silu(gate)), so within three rounding steps. The H200 gave exactly that: fp32 at
    64 x 4,096 and 16,385 x 4,096 apart by more than 2^-22, bf16 apart at 16,383 x 32 x 128 (gated), equal at every
    smaller bf16 shape. What is checked bit for bit is the quantisation, against that of the kernel's own output."""
    if device == "cpu":
        assert torch.equal(got, want)
    else:
        step = {torch.bfloat16: 3 * 2.0**-7, torch.float16: 3 * 2.0**-10, torch.float32: 2.0**-19}[got.dtype]
        torch.testing.assert_close(got, want, rtol=step, atol=step * 1e-3)


def check_add_rms_norm_fp8(rows: int, dim: int, dtype: torch.dtype, device: str) -> None:
    from hybridcache.kernels.gemm import triton_quant
    from hybridcache.kernels.norm import triton as fused

    wide = randn((rows, dim + 40), 1, 2.0).to(device, dtype)
    x = wide[:, 16:16 + dim]  # a column slice: row stride dim + 40
    residual = randn((rows, dim), 2, 3.0).to(device, dtype)
    weight = randn((dim,), 3, 0.5).to(device, dtype)
    total, normed, q, scale = fused.add_rms_norm_fp8(x, residual, weight, 1e-6)
    want_total, want_normed = fused.add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(total, want_total)
    assert_same_norm(normed, want_normed, device)
    assert q.shape == (-(-rows // 4) * 4, dim)
    assert_same_quantization((q, scale), triton_quant.quantize_groups(normed, 128, pad_rows=4, column_major=True))


def check_gated_rms_norm_fp8(rows: int, heads: int, head_dim: int, dtype: torch.dtype, device: str) -> None:
    from hybridcache.kernels.gemm import triton_quant
    from hybridcache.kernels.norm import triton as fused

    width = heads * head_dim
    mixed = randn((rows, 3 * width), 4, 2.0).to(device, dtype)  # x and the gate: head views of one wide row
    x = mixed[:, :width].view(rows, heads, head_dim) if heads > 1 else mixed[:, :width]
    gate = mixed[:, 2 * width:].view(rows, heads, head_dim) if heads > 1 else mixed[:, 2 * width:]
    assert rows == 1 or not (x.is_contiguous() or gate.is_contiguous())
    weight = randn((head_dim,), 5, 0.5).to(device, dtype)
    out, q, scale = fused.gated_rms_norm_fp8(x, gate, weight, 1e-6)
    want = fused.gated_rms_norm(x, gate, weight, 1e-6)
    assert out.shape == x.shape
    assert_same_norm(out, want, device)
    assert_same_quantization((q, scale), triton_quant.quantize_groups(out.reshape(rows, width), 128, pad_rows=4,
                                                                      column_major=True))


def check_gemms_read_column_major_scales(m: int, n: int, k: int, device: str) -> None:
    from hybridcache.kernels.gemm import triton_quant
    from hybridcache.kernels.gemm.triton_block_fp8 import SplitK, decode_config, fp8_gemm, fp8_gemm_splitk

    weight, scale = (t.to(device) for t in quantize(randn((n, k), 6), BLOCK))
    x = randn((m, k), 7, 3.0).to(device, torch.bfloat16)
    xq, rowwise = triton_quant.quantize_groups(x, 128)
    padded_q, columnwise = triton_quant.quantize_groups(x, 128, pad_rows=4, column_major=True)
    assert torch.equal(padded_q[:m].view(torch.uint8), xq.view(torch.uint8)) and columnwise.stride(0) == 1
    tile = decode_config(m) if m <= 64 else None
    assert torch.equal(fp8_gemm(padded_q[:m], columnwise[:m], weight, scale, BLOCK, torch.bfloat16, tile),
                       fp8_gemm(xq, rowwise, weight, scale, BLOCK, torch.bfloat16, tile))
    if m <= 64:
        config = SplitK(block_n=32, split_k=2)
        assert torch.equal(fp8_gemm_splitk(padded_q[:m], columnwise[:m], weight, scale, BLOCK, torch.bfloat16, config),
                           fp8_gemm_splitk(xq, rowwise, weight, scale, BLOCK, torch.bfloat16, config))


def check_fp8_linear_on_norm_output(m: int, n: int, k: int, device: str) -> None:
    from hybridcache.kernels.gemm.triton_block_fp8 import fp8_linear
    from hybridcache.kernels.norm import triton as fused

    weight, scale = (t.to(device) for t in quantize(randn((n, k), 8), BLOCK))
    x = randn((m, k), 9, 2.0).to(device, torch.bfloat16)
    residual = randn((m, k), 10).to(device, torch.bfloat16)
    norm_weight = randn((k,), 11, 0.3).to(device, torch.bfloat16)
    _, normed, q, q_scale = fused.add_rms_norm_fp8(x, residual, norm_weight, 1e-6)
    bias = randn((n,), 12).to(device, torch.bfloat16)
    want = fp8_linear(normed, weight, scale, BLOCK, bias)
    got = fp8_linear(normed, weight, scale, BLOCK, bias, quantized=(q, q_scale))
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="quantized input"):  # one row short of the padded rows
        fp8_linear(normed, weight, scale, BLOCK, quantized=(q[1:], q_scale))


def check_quantize_rows_scatter(tokens: int, cols: int, top_k: int, device: str) -> None:
    from hybridcache.kernels.gemm import triton_quant
    from hybridcache.kernels.moe.grouped import pair_rows

    x = randn((tokens, cols + 8), 21, 3.0).to(device, torch.bfloat16)[:, :cols]  # a row stride past K
    ids = torch.randint(0, 7, (tokens * top_k,), generator=torch.Generator().manual_seed(22)).to(device)
    order = torch.argsort(ids, stable=True)  # pairs sorted by a made-up expert id
    q, scale = triton_quant.quantize_rows_scatter(x, pair_rows(order), top_k)
    want_q, want_scale = triton_quant.quantize_rows(x)
    tokens_of = order // top_k
    assert torch.equal(q.view(torch.uint8), want_q.index_select(0, tokens_of).view(torch.uint8))
    assert torch.equal(scale, want_scale.reshape(-1).index_select(0, tokens_of))


DTYPES = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
ADD_SHAPES = pytest.mark.parametrize("rows, dim", [(37, 300), (3, 2048), (1, 64), (5, 2500), (6, 384)])
GATED_SHAPES = pytest.mark.parametrize("rows, heads, head_dim", [(37, 4, 128), (2, 3, 256), (5, 1, 200),
                                                                (1, 8, 128)])


@needs_interpreter
@DTYPES
@ADD_SHAPES
def test_interpreted_add_rms_norm_fp8_equals_the_norm_then_the_quantisation(rows, dim, dtype):
    check_add_rms_norm_fp8(rows, dim, dtype, "cpu")


@needs_interpreter
@DTYPES
@GATED_SHAPES
def test_interpreted_gated_rms_norm_fp8_equals_the_norm_then_the_quantisation(rows, heads, head_dim, dtype):
    check_gated_rms_norm_fp8(rows, heads, head_dim, dtype, "cpu")


@needs_interpreter
@pytest.mark.parametrize("m, n, k", [(5, 200, 300), (64, 96, 512), (70, 64, 256)])
def test_interpreted_gemms_read_column_major_activation_scales(m, n, k):
    check_gemms_read_column_major_scales(m, n, k, "cpu")


@needs_interpreter
@pytest.mark.parametrize("m, n, k", [(5, 200, 300), (3, 96, 256)])
def test_interpreted_fp8_linear_on_a_norms_quantisation_equals_quantising_itself(m, n, k):
    check_fp8_linear_on_norm_output(m, n, k, "cpu")


@needs_interpreter
@pytest.mark.parametrize("tokens, cols, top_k", [(7, 300, 3), (1, 64, 9), (12, 256, 1)])
def test_interpreted_quantize_rows_scatter_equals_quantising_then_gathering(tokens, cols, top_k):
    check_quantize_rows_scatter(tokens, cols, top_k, "cpu")


@needs_interpreter
def test_interpreted_fused_norms_refuse_a_group_cut_between_heads():
    from hybridcache.kernels.norm import triton as fused

    x = randn((3, 2, 96), 13)
    with pytest.raises(ValueError, match="cut a group"):
        fused.gated_rms_norm_fp8(x, x, torch.ones(96), 1e-6)


def test_cpu_fallbacks_equal_the_reference_norms_and_quantisation():
    from hybridcache.kernels.backend import ReferenceBackend
    from hybridcache.kernels.gemm.reference import quantize_groups
    from hybridcache.layers.norm import GatedRMSNorm, ZeroCenteredRMSNorm

    backend = ReferenceBackend()
    norm = ZeroCenteredRMSNorm(300)
    norm.weight.data = randn((300,), 14, 0.5)
    x, residual = randn((5, 300), 15), randn((5, 300), 16)
    total, rows = norm.add(x, residual, backend, fp8=True)
    want_total, want = norm_ref.add_rms_norm(x, residual, norm.weight, norm.eps)
    assert torch.equal(total, want_total) and torch.equal(rows.x, want) and rows.shape == (5, 300)
    want_q, want_scale = quantize_groups(torch.cat([want, want.new_zeros(3, 300)]), 128)
    assert torch.equal(rows.xq.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(rows.scale, want_scale) and rows.scale.stride() == (1, 8)
    gated = GatedRMSNorm(128)
    x, gate = randn((3, 2, 128), 17), randn((3, 2, 128), 18)
    rows = gated(x, gate, backend, fp8=True)
    assert torch.equal(rows.x, norm_ref.gated_rms_norm(x, gate, gated.weight, gated.eps).reshape(3, 256))
    assert rows.xq.shape == (4, 256) and rows.scale.shape == (4, 2)


def test_cpu_fp8_rows_reach_fp8_and_dense_linears_as_their_input():
    from hybridcache.kernels.norm.fp8 import quantize_for_gemm
    from hybridcache.layers.fused import FusedProjection
    from hybridcache.layers.linear import Fp8Linear, Fp8Rows, module_linear, wants_fp8_rows

    fp8 = Fp8Linear(256, 128, BLOCK)
    fp8.weight.data, fp8.weight_scale_inv.data = quantize(randn((128, 256), 19), BLOCK)
    dense = nn.Linear(256, 8, bias=False)
    x = randn((5, 256), 20)
    rows = Fp8Rows(x, *quantize_for_gemm(x, 128, 4))
    assert torch.equal(fp8(rows), fp8(x)) and torch.equal(module_linear(fp8, rows), module_linear(fp8, x))
    assert torch.equal(module_linear(dense, rows), module_linear(dense, x))
    fused = FusedProjection(fp8, dense)  # a mix of formats: one GEMM each
    for got, want in zip(fused(rows), fused(x), strict=True):
        assert torch.equal(got, want)
    assert not wants_fp8_rows(fused, x)  # on the CPU: the reference GEMM, no quantised input
    assert not wants_fp8_rows(dense, x) and not wants_fp8_rows(None, x)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("rows, dim", [(37, 300), (3, 2048), (1, 64), (5, 2500), (64, 4096), (16385, 4096)])
def test_cuda_add_rms_norm_fp8_equals_the_norm_then_the_quantisation(rows, dim, dtype):
    check_add_rms_norm_fp8(rows, dim, dtype, "cuda")


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("rows, heads, head_dim", [(37, 4, 128), (2, 3, 256), (5, 1, 200), (64, 32, 128),
                                                   (16383, 32, 128)])
def test_cuda_gated_rms_norm_fp8_equals_the_norm_then_the_quantisation(rows, heads, head_dim, dtype):
    check_gated_rms_norm_fp8(rows, heads, head_dim, dtype, "cuda")


@needs_cuda
@pytest.mark.parametrize("m", [1, 5, 16, 64, 300])
@pytest.mark.parametrize("n, k", [(12288, 4096), (4096, 4096), (9216, 4096), (200, 300)])
def test_cuda_fp8_linear_on_a_norms_quantisation_equals_quantising_itself(m, n, k):
    check_fp8_linear_on_norm_output(m, n, k, "cuda")


@needs_cuda
@pytest.mark.parametrize("tokens, cols, top_k", [(16384, 4096, 9), (37, 2048, 11), (1, 300, 3)])
def test_cuda_quantize_rows_scatter_equals_quantising_then_gathering(tokens, cols, top_k):
    check_quantize_rows_scatter(tokens, cols, top_k, "cuda")


@needs_cuda
@pytest.mark.parametrize("m", [5, 64])
def test_cuda_split_k_on_a_norms_quantisation_equals_quantising_itself(m, monkeypatch):
    from hybridcache.kernels.gemm import triton_block_fp8

    monkeypatch.setitem(triton_block_fp8.DECODE_SPLIT_K, (4096, 4096), triton_block_fp8.SplitK(64, 4))
    check_fp8_linear_on_norm_output(m, 4096, 4096, "cuda")
    check_gemms_read_column_major_scales(m, 4096, 4096, "cuda")


@pytest.mark.parametrize("kernel_name, rows, block", [("_add_rms_norm_fp8_kernel", 1, 4096),
                                                      ("_gated_rms_norm_fp8_kernel", 16, 128)])
def test_fused_fp8_norms_compile_for_hopper(kernel_name, rows, block):
    """Both kernels at next-16b's launches (a 4,096-wide row a program, 16 warps; 16 heads of 128 a program)
    compile for sm90 on the CPU (`tests/kernels/hopper.py`), writing e4m3 and the step's varying sizes not
    specialised."""
    pytest.importorskip("triton")
    from hybridcache.kernels.norm import triton as fused
    from tests.kernels.hopper import compile_for_hopper

    kernel = getattr(fused, kernel_name)
    pointers = {p.name: "*bf16" for p in kernel.params if p.name.endswith("_ptr")}
    pointers.update(q_ptr="*fp8e4nv", s_ptr="*fp32", w_ptr="*bf16")
    ints = [p.name for p in kernel.params if not p.name.endswith("_ptr") and not p.is_constexpr and p.name != "eps"]
    constants = dict(ROWS=rows, BLOCK=block, GROUP=128, QMAX=448.0)
    compiled = compile_for_hopper(kernel, pointers, ints, constants, num_warps=16 if rows == 1 else 4,
                                  floats=("eps",))
    assert "cvt.rn.satfinite.e4m3x2" in compiled.asm["ptx"] or "e4m3" in compiled.asm["ptx"]
    assert all(p.do_not_specialize for p in kernel.params if p.name in ("num_rows", "padded_rows", "stride_sg"))
