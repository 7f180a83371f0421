"""The split-K W8A8 decode GEMM (`triton_block_fp8.fp8_gemm_splitk`, `DECODE_SPLIT_K`; issue 29).

- Interpreted (TRITON_INTERPRET=1 child, as test_fp8_kernels.py; activations quantised by torch): against the
  dequantised product of the same FP8 numbers to fp32 summation order, for even and uneven splits (a part of
  fewer K steps, more parts asked for than K steps), partial blocks, per-channel scales, 1 to 64 rows; a second
  call gives the same bits (the counters are back at zero, the parts summed in a fixed order); `fp8_linear` takes
  it on the shapes of `DECODE_SPLIT_K` from their `min_rows` up to `DECODE_ROWS` rows only; bad input is refused.
- It compiles for sm90 on the CPU (`tests/kernels/hopper.py`), reaching wgmma, split and unsplit.
- `fp8_decode_choice`: its candidates fill the SMs within K's steps; `splitk_config` takes `DECODE_SPLIT_K`'s
  launch from its `min_rows`, measures a shape once outside a capture (from `FROM_ROWS`, bf16 / fp16 on CUDA,
  with `MEASURE`) and keeps the result; never measures in a capture.
- On CUDA (skipped without one): against `fp8_gemm`'s W8A8 decode tile on next-16b's projection shapes, replayed
  in a CUDA graph, and `decide` on a real shape (a choice recorded with every candidate's time).
"""

from __future__ import annotations

import pytest
import torch

from hybridcache.fp8_format import BLOCK, CHANNEL, Fp8Format
from hybridcache.kernels.gemm.reference import dequantize, quantize, quantize_groups
from tests.kernels.interpreter import interpreted_in_child, needs_cuda, needs_interpreter


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


@interpreted_in_child("test_interpreted_ and not subprocess")
def test_fp8_splitk_in_a_triton_interpreter_subprocess() -> None:
    """This file's interpreted tests, in a child process (tests/kernels/interpreter.py)."""


def operands(m: int, n: int, k: int, fmt: Fp8Format, seed: int):
    generator = torch.Generator().manual_seed(seed)
    group = fmt.block[1] if fmt.kind == "block" else 128
    weight, scale = quantize(torch.randn(n, k, generator=generator), fmt)
    xq, x_scale = quantize_groups(torch.randn(m, k, generator=generator) * 3, group)
    dense = (xq.float() * x_scale.repeat_interleave(group, 1)[:, :k]) @ dequantize(weight, scale, fmt, torch.float32).T
    return xq, x_scale, weight, scale, dense


@needs_interpreter
@pytest.mark.parametrize("m, n, k, fmt", [(5, 200, 300, BLOCK), (64, 96, 512, BLOCK), (1, 130, 384, CHANNEL),
                                         (33, 64, 160, Fp8Format("block", (32, 32)))])
@pytest.mark.parametrize("block_n, split_k", [(32, 1), (32, 2), (64, 3), (16, 8)])
def test_interpreted_splitk_equals_the_dequantised_product(m, n, k, fmt, block_n, split_k):
    from hybridcache.kernels.gemm.triton_block_fp8 import SplitK, fp8_gemm_splitk

    xq, x_scale, weight, scale, dense = operands(m, n, k, fmt, m + n + k)
    config = SplitK(block_n=block_n, split_k=split_k)
    got = fp8_gemm_splitk(xq, x_scale, weight, scale, fmt, torch.float32, config)
    assert got.shape == (m, n) and rel(got, dense) <= 1e-5
    assert torch.equal(fp8_gemm_splitk(xq, x_scale, weight, scale, fmt, torch.float32, config), got)


@needs_interpreter
def test_interpreted_fp8_linear_takes_splitk_on_its_shapes_from_its_min_rows_to_the_decode_rows(monkeypatch):
    from hybridcache.kernels.gemm import triton_block_fp8

    calls = []
    original = triton_block_fp8.fp8_gemm_splitk
    monkeypatch.setattr(triton_block_fp8, "fp8_gemm_splitk", lambda *a: calls.append(a[-1]) or original(*a))
    monkeypatch.setattr(triton_block_fp8, "DECODE_SPLIT_K", {(64, 256): triton_block_fp8.SplitK(32, 2, min_rows=2)})
    generator = torch.Generator().manual_seed(2)
    weight, scale = quantize(torch.randn(64, 256, generator=generator), BLOCK)
    other, other_scale = quantize(torch.randn(128, 256, generator=generator), BLOCK)
    for rows in (1, 3, 64, 65):
        x = torch.randn(rows, 256, generator=generator)
        got = triton_block_fp8.fp8_linear(x, weight, scale, BLOCK)
        triton_block_fp8.fp8_linear(x, other, other_scale, BLOCK)  # not in the table
        xq, x_scale = triton_block_fp8.triton_quant.quantize_groups(x)
        want = (xq.float() * x_scale.repeat_interleave(128, 1)) @ dequantize(weight, scale, BLOCK, torch.float32).T
        assert rel(got, want) <= 1e-5
    assert calls == [triton_block_fp8.SplitK(32, 2, min_rows=2)] * 2  # 3 and 64 rows: not 1, not 65, not the other


@needs_interpreter
def test_interpreted_splitk_checks_its_inputs():
    from hybridcache.kernels.gemm.triton_block_fp8 import SplitK, fp8_gemm_splitk

    xq, x_scale, weight, scale, _ = operands(4, 64, 256, BLOCK, 0)
    with pytest.raises(ValueError, match="W8A8 with at most 64 rows"):
        fp8_gemm_splitk(xq.float(), x_scale, weight, scale, BLOCK, torch.float32, SplitK())
    with pytest.raises(ValueError, match="W8A8 with at most 64 rows"):
        fp8_gemm_splitk(torch.cat([xq] * 17), torch.cat([x_scale] * 17), weight, scale, BLOCK, torch.float32,
                        SplitK())
    with pytest.raises(ValueError, match="power-of-two block_n"):
        fp8_gemm_splitk(xq, x_scale, weight, scale, BLOCK, torch.float32, SplitK(block_n=48))
    with pytest.raises(ValueError, match="fp8_gemm_splitk: a_scale"):
        fp8_gemm_splitk(xq, x_scale[:, :1], weight, scale, BLOCK, torch.float32, SplitK())


@pytest.mark.parametrize(("block_m", "block_n", "split_k", "num_warps"), [(64, 64, 4, 4), (16, 128, 2, 8),
                                                                          (32, 64, 1, 4)])
def test_splitk_compiles_for_hopper(block_m, block_n, split_k, num_warps):
    pytest.importorskip("triton")
    from hybridcache.kernels.gemm.triton_block_fp8 import _fp8_gemm_splitk_kernel
    from tests.kernels.hopper import compile_for_hopper

    pointers = {"a_ptr": "*fp8e4nv", "a_scale_ptr": "*fp32", "w_ptr": "*fp8e4nv", "w_scale_ptr": "*fp32",
                "out_ptr": "*bf16", "ws_ptr": "*fp32", "count_ptr": "*i32"}
    ints = ["M", "N", "K", "k_part", "stride_am", "stride_wn", "stride_om", "stride_asm", "stride_asg", "stride_wsn",
            "stride_wsk"]
    constants = dict(GROUP_N=128, GROUP_K=128, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=128, SPLIT_K=split_k)
    compiled = compile_for_hopper(_fp8_gemm_splitk_kernel, pointers, ints, constants, num_warps)
    assert "wgmma" in compiled.asm["ptx"]
    assert ("atom" in compiled.asm["ptx"]) == (split_k > 1)


@needs_cuda
@pytest.mark.parametrize("n, k", [(12288, 4096), (4096, 4096)])
@pytest.mark.parametrize("m", [1, 64])
def test_cuda_splitk_equals_the_decode_tile(n, k, m):
    """On the GPU against the W8A8 decode tile on the same quantised operands: fp32 summation order apart, then
    one bf16 rounding each (2^-8 relative of an output); repeated calls give the same bits."""
    from hybridcache.kernels.gemm.triton_block_fp8 import SplitK, decode_config, fp8_gemm, fp8_gemm_splitk

    generator = torch.Generator("cuda").manual_seed(m)
    weight, scale = quantize(torch.randn(n, k, generator=generator, device="cuda") / k**0.5, BLOCK)
    xq, x_scale = quantize_groups(torch.randn(m, k, generator=generator, device="cuda").bfloat16())
    want = fp8_gemm(xq, x_scale, weight, scale, BLOCK, torch.bfloat16, decode_config(m))
    for config in (SplitK(64, 4), SplitK(128, 2, num_warps=8), SplitK(64, 8, num_stages=3)):
        got = fp8_gemm_splitk(xq, x_scale, weight, scale, BLOCK, torch.bfloat16, config)
        assert rel(got, want) <= 1e-2, config
        assert torch.equal(fp8_gemm_splitk(xq, x_scale, weight, scale, BLOCK, torch.bfloat16, config), got)


@needs_cuda
def test_cuda_splitk_replays_in_a_cuda_graph():
    """After an eager call (which makes its buffers), a captured launch replays to the eager call's bits, twice
    (the counters are back at zero after each replay); the first call of a new size inside a capture is refused."""
    from hybridcache.kernels.gemm.triton_block_fp8 import SplitK, fp8_gemm_splitk

    generator = torch.Generator("cuda").manual_seed(3)
    weight, scale = quantize(torch.randn(4096, 4096, generator=generator, device="cuda") / 64, BLOCK)
    xq, x_scale = quantize_groups(torch.randn(64, 4096, generator=generator, device="cuda").bfloat16())
    config = SplitK(64, 4)
    eager = fp8_gemm_splitk(xq, x_scale, weight, scale, BLOCK, torch.bfloat16, config)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8_gemm_splitk(xq, x_scale, weight, scale, BLOCK, torch.bfloat16, config)
    for _ in range(2):
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)
    with pytest.raises(RuntimeError, match="outside a CUDA graph capture"), torch.cuda.graph(torch.cuda.CUDAGraph()):
        fp8_gemm_splitk(xq, x_scale, weight, scale, BLOCK, torch.bfloat16, SplitK(64, 3))


def test_decode_choice_candidates_fill_the_sms_within_the_k_steps():
    pytest.importorskip("triton")
    from hybridcache.kernels.gemm.fp8_decode_choice import FROM_ROWS, candidates
    from hybridcache.kernels.gemm.triton_block_fp8 import SplitK

    # 4,096 x 4,096 on 132 SMs: 64 tiles of 64 -> 4 and 8 parts; 32 tiles of 128 -> 8 and 16 parts (of 32 K steps)
    assert candidates(4096, 4096, 132) == [SplitK(64, 4, 4, 4, FROM_ROWS), SplitK(64, 8, 4, 4, FROM_ROWS),
                                           SplitK(128, 8, 8, 3, FROM_ROWS), SplitK(128, 16, 8, 3, FROM_ROWS)]
    # 12,288 rows: 192 tiles of 64 fill them unsplit; K of 256 has 2 steps: at most 2 parts
    assert [(c.block_n, c.split_k) for c in candidates(12288, 4096, 132)] == [(64, 1), (64, 2), (128, 2), (128, 4)]
    assert [(c.block_n, c.split_k) for c in candidates(256, 256, 132)] == [(64, 2), (128, 2)]


def test_splitk_config_takes_the_table_else_measures_once_outside_a_capture(monkeypatch):
    pytest.importorskip("triton")
    from hybridcache.kernels.gemm import fp8_decode_choice, triton_block_fp8
    from hybridcache.kernels.gemm.triton_block_fp8 import SplitK

    class Rows:  # what `splitk_config` reads of the rows: count, device, dtype
        def __init__(self, m, cuda=True, dtype=torch.bfloat16):
            self.shape, self.is_cuda, self.dtype, self.device = (m, 256), cuda, dtype, "cuda:0"

    weight, scale = torch.zeros(128, 256, dtype=torch.float8_e4m3fn), torch.ones(1, 2)
    monkeypatch.setattr(fp8_decode_choice, "_CHOICES", {})
    monkeypatch.setattr(triton_block_fp8, "DECODE_SPLIT_K", {(128, 256): SplitK(32, 2, min_rows=8)})
    assert fp8_decode_choice.splitk_config(Rows(8), weight, scale, BLOCK) == SplitK(32, 2, min_rows=8)
    assert fp8_decode_choice.splitk_config(Rows(7), weight, scale, BLOCK) is None
    assert fp8_decode_choice.splitk_config(Rows(65), weight, scale, BLOCK) is None
    monkeypatch.setattr(triton_block_fp8, "DECODE_SPLIT_K", {})
    decided = []

    def decide(w, s, fmt, dtype):
        decided.append(dtype)
        fp8_decode_choice._CHOICES[("cuda:0", dtype, 128, 256, fmt)] = fp8_decode_choice.Choice(SplitK(64, 4), ())

    monkeypatch.setattr(fp8_decode_choice, "decide", decide)
    capturing = [True]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    assert fp8_decode_choice.splitk_config(Rows(64), weight, scale, BLOCK) is None  # first met in a capture
    capturing[0] = False
    for m in (64, 33, 40):
        assert fp8_decode_choice.splitk_config(Rows(m), weight, scale, BLOCK) == SplitK(64, 4)
    assert decided == [torch.bfloat16]  # once
    assert fp8_decode_choice.splitk_config(Rows(32), weight, scale, BLOCK) is None  # below FROM_ROWS
    assert fp8_decode_choice.splitk_config(Rows(64, cuda=False), weight, scale, BLOCK) is None
    assert fp8_decode_choice.splitk_config(Rows(64, dtype=torch.float32), weight, scale, BLOCK) is None
    monkeypatch.setattr(fp8_decode_choice, "MEASURE", False)
    assert fp8_decode_choice.splitk_config(Rows(64), weight, scale, BLOCK) is None


@needs_cuda
def test_cuda_decide_records_the_fastest_with_every_candidates_time(monkeypatch):
    from hybridcache.kernels.gemm import fp8_decode_choice

    monkeypatch.setattr(fp8_decode_choice, "_CHOICES", {})
    generator = torch.Generator("cuda").manual_seed(4)
    weight, scale = quantize(torch.randn(4096, 4096, generator=generator, device="cuda") / 64, BLOCK)
    fp8_decode_choice.decide(weight, scale, BLOCK, torch.bfloat16)
    (key, choice), = fp8_decode_choice.choices().items()
    times = dict(choice.times_us)
    print(f"4096 x 4096 at 64 rows, us: {times}")
    assert key[1:] == (torch.bfloat16, 4096, 4096, BLOCK) and "library" in times and len(times) >= 3
    if choice.config is not None:
        assert min(times.values()) <= fp8_decode_choice.MARGIN * times["library"]
