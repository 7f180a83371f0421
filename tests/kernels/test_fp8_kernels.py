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
from tests.kernels.interpreter import interpreted_in_child, needs_cuda, needs_interpreter


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


@interpreted_in_child("test_interpreted_ and not subprocess")
def test_fp8_triton_kernels_in_a_triton_interpreter_subprocess() -> None:
    """This file's interpreted tests, in a child process (tests/kernels/interpreter.py)."""


def dequantized_groups(xq: torch.Tensor, x_scale: torch.Tensor, group: int) -> torch.Tensor:
    """The activations an FP8 GEMM multiplies: xq * its per-token-group scale, fp32."""
    return xq.float() * x_scale.repeat_interleave(group, 1)[:, : xq.shape[1]]


@needs_interpreter
@pytest.mark.parametrize("m, n, k, fmt", [(5, 200, 300, BLOCK), (33, 64, 96, Fp8Format("block", (32, 32))),
                                         (1, 130, 128, BLOCK), (20, 48, 272, CHANNEL)])
@pytest.mark.parametrize("swap_ab", [False, True], ids=["tiles", "swap-ab"])
def test_interpreted_fp8_gemm_w8a8(m, n, k, fmt, swap_ab):
    from hybridcache.kernels.gemm.triton_block_fp8 import TileConfig, fp8_gemm

    generator = torch.Generator().manual_seed(m + n + k)
    group = fmt.block[1] if fmt.kind == "block" else 128
    weight, scale = quantize(torch.randn(n, k, generator=generator), fmt)
    xq, x_scale = quantize_groups(torch.randn(m, k, generator=generator) * 3, group)
    got = fp8_gemm(xq, x_scale, weight, scale, fmt, torch.float32, TileConfig(16, 32, group_m=2, swap_ab=swap_ab))
    if fmt.kind == "block":
        assert rel(got, emulate_block_linear(xq, x_scale, weight, scale, fmt.block)) <= 1e-5
    # the dequantised product of the quantised operands
    dense = dequantized_groups(xq, x_scale, group) @ dequantize(weight, scale, fmt, torch.float32).T
    assert rel(got, dense) <= 1e-5


@needs_interpreter
@pytest.mark.parametrize("m, n, k, fmt", [(5, 200, 300, BLOCK), (16, 64, 96, Fp8Format("block", (32, 32))),
                                         (1, 130, 128, BLOCK), (3, 48, 272, CHANNEL)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("swap_ab", [False, True], ids=["tiles", "swap-ab"])
def test_interpreted_fp8_gemm_w8a16(m, n, k, fmt, dtype, swap_ab):
    """W8A16 (decode): the activations are not quantised, the weight tiles are converted to their dtype (exact:
    e4m3 values are fp16 values) in the kernel and scaled in fp32, so the result is the dequantised weight's
    product with the same activations up to fp32 summation order. (bf16 is the GPU's case; this interpreter
    multiplies bf16 wrongly, fp16 takes the same path.)"""
    from hybridcache.kernels.gemm.triton_block_fp8 import TileConfig, fp8_gemm

    generator = torch.Generator().manual_seed(m * n + k)
    weight, scale = quantize(torch.randn(n, k, generator=generator), fmt)
    x = torch.randn(m, k, generator=generator).to(dtype)
    got = fp8_gemm(x, None, weight, scale, fmt, torch.float32, TileConfig(16, 32, group_m=4, swap_ab=swap_ab))
    assert rel(got, linear(x.float(), weight, scale, fmt)) <= 1e-5


@needs_interpreter
@pytest.mark.parametrize("group", [128, 32])
def test_interpreted_quantize_groups_equals_the_reference(group):
    """One Triton launch against torch's `quantize_groups`: the same scales bit for bit and the same FP8 values,
    except where this interpreter's float32 -> e4m3 conversion is wrong: it loses the carry when rounding up
    reaches the next power of two (gives half of it) and flushes subnormals (|q| < 2^-6, at most 2^-9 off). The
    GPU converts exactly (`benchmarks/fp8_sweep.py`'s `quant_check` checks there, bit for bit)."""
    from hybridcache.kernels.gemm import triton_quant

    generator = torch.Generator().manual_seed(group)
    x = torch.randn(9, 300, generator=generator) * torch.logspace(-3, 3, 300)
    x[4, :group] = 0  # an all-zero group: scale 1e-12 / 448, zeros
    got_q, got_s = triton_quant.quantize_groups(x, group)
    want_q, want_s = quantize_groups(x, group)
    assert torch.equal(got_s, want_s)
    got, want = got_q.float(), want_q.float()
    lost_carry = (want != 0) & (torch.frexp(want.abs())[0] == 0.5) & (got == want / 2)
    flushed = (want.abs() < 2.0**-6) & ((got - want).abs() <= 2.0**-9)
    assert bool(((got == want) | lost_carry | flushed).all())
    assert float((got == want).float().mean()) > 0.9
    # cuBLAS's layout: rows padded to a multiple of 4 (zeros), the scales stored column-major
    pad_q, pad_s = triton_quant.quantize_groups(x, group, pad_rows=4, column_major=True)
    assert pad_q.shape == (12, 300) and pad_s.shape == (12, got_s.shape[1]) and pad_s.stride() == (1, 12)
    assert torch.equal(pad_s[:9], want_s) and torch.equal(pad_q[:9].float(), got)
    assert not pad_q[9:].float().any() and bool((pad_s[9:] == 1e-12 / 448).all())
    assert float(want_q.float().abs().amax()) == 448.0


@needs_interpreter
@pytest.mark.parametrize("k", [300, 64, 16])
def test_interpreted_quantize_rows_equals_the_reference(k):
    """Per token in one launch (the per-channel format's activations) against torch's `quantize_rows`: the same
    scales bit for bit, the same FP8 values but for this interpreter's faults (the quantize_groups test)."""
    from hybridcache.kernels.gemm import triton_quant
    from hybridcache.kernels.gemm.reference import quantize_rows

    generator = torch.Generator().manual_seed(k)
    x = torch.randn(7, k, generator=generator) * torch.logspace(-1, 1, k)  # few e4m3 subnormals per row
    x[3] = 0  # an all-zero row: scale 1e-12 / 448, zeros
    got_q, got_s = triton_quant.quantize_rows(x)
    want_q, want_s = quantize_rows(x)
    assert got_s.shape == (7, 1) and torch.equal(got_s, want_s)
    got, want = got_q.float(), want_q.float()
    lost_carry = (want != 0) & (torch.frexp(want.abs())[0] == 0.5) & (got == want / 2)
    flushed = (want.abs() < 2.0**-6) & ((got - want).abs() <= 2.0**-9)
    assert bool(((got == want) | lost_carry | flushed).all()) and float((got == want).float().mean()) > 0.9
    with pytest.raises(ValueError, match="x \\[M, K\\] needed"):
        triton_quant.quantize_rows(x[0])


@needs_interpreter
@pytest.mark.parametrize("rows", [5, 64, 67], ids=["decode-5", "decode-64", "prefill-67"])
def test_interpreted_fp8_linear_quantises_its_activations(rows, monkeypatch):
    """`fp8_linear` off cuBLAS's path (fp32 here; on the GPU: shapes it does not take): W8A8 with the decode tiles
    up to 64 rows and the prefill tile above, activations quantised by the Triton kernel (interpreted inexactly,
    see the quantize_groups test; bit for bit on the GPU), so the GEMM is checked against the product of the very
    numbers that kernel wrote; with `DECODE_W8A16`, up to 64 rows, the unquantised product."""
    from hybridcache.kernels.gemm import triton_block_fp8, triton_quant

    generator = torch.Generator().manual_seed(rows)
    weight, scale = quantize(torch.randn(64, 256, generator=generator), BLOCK)
    x = torch.randn(rows, 256, generator=generator)
    xq, x_scale = triton_quant.quantize_groups(x)
    want = dequantized_groups(xq, x_scale, 128) @ dequantize(weight, scale, BLOCK, torch.float32).T
    got = triton_block_fp8.fp8_linear(x[None], weight, scale, BLOCK)[0]
    assert rel(got, want) <= 1e-5
    assert rel(got, linear(x, weight, scale, BLOCK)) > 1e-4  # the activations were quantised
    monkeypatch.setattr(triton_block_fp8, "DECODE_W8A16", True)
    w8a16 = triton_block_fp8.fp8_linear(x, weight, scale, BLOCK)
    if rows <= triton_block_fp8.DECODE_ROWS:
        assert rel(w8a16, linear(x, weight, scale, BLOCK)) <= 1e-5
    else:
        assert torch.equal(w8a16, got)


@needs_interpreter
def test_interpreted_fp8_gemm_checks_its_inputs():
    from hybridcache.kernels.gemm.triton_block_fp8 import fp8_gemm

    weight, scale = quantize(torch.randn(200, 128), BLOCK)
    xq, x_scale = quantize_groups(torch.randn(4, 128))
    with pytest.raises(ValueError, match="a too exactly when a_scale is given"):
        fp8_gemm(xq.float(), x_scale, weight, scale, BLOCK, torch.float32)
    with pytest.raises(ValueError, match="a_scale"):
        fp8_gemm(xq, x_scale[:, :0], weight, scale, BLOCK, torch.float32)
    with pytest.raises(ValueError, match="scale"):
        fp8_gemm(xq.float(), None, weight, scale[:1], BLOCK, torch.float32)  # [1, 1] for [2, 1]
    with pytest.raises(ValueError, match="unit stride"):
        fp8_gemm(xq.t().contiguous().t(), x_scale, weight, scale, BLOCK, torch.float32)


def torch_quantisation(monkeypatch) -> None:
    """The FP8 experts' W8A8 path quantises its activations with torch's `quantize_groups` instead of the Triton
    kernel, whose interpreted float32 -> e4m3 conversion is wrong (the quantize_groups test): an interpreted test
    of the expert GEMM then multiplies exactly quantised numbers."""
    from hybridcache.kernels.gemm import triton_quant

    monkeypatch.setattr(triton_quant, "quantize_groups", quantize_groups)


def stacked_experts(gate, up, down, block):
    from hybridcache.kernels.gemm.triton_fp8_moe import Fp8ExpertWeights

    return Fp8ExpertWeights(
        gate_up=torch.stack([torch.cat([g[0], u[0]]) for g, u in zip(gate, up, strict=True)]),
        gate_up_scale=torch.stack([torch.cat([g[1], u[1]]) for g, u in zip(gate, up, strict=True)]),
        down=torch.stack([d[0] for d in down]), down_scale=torch.stack([d[1] for d in down]), block=block)


@needs_interpreter
@pytest.mark.parametrize("prefill", [False, True], ids=["decode-tile", "prefill-tile-grouped-order"])
@pytest.mark.parametrize("swap_ab", [False, True], ids=["tiles", "swap-ab"])
@pytest.mark.parametrize("w8a16", [False, True], ids=["w8a8", "w8a16"])
@pytest.mark.parametrize("inter", [64, 96], ids=["I64", "I96-partial-groups"])
def test_interpreted_fp8_grouped_experts(inter, w8a16, swap_ab, prefill, monkeypatch):
    """The FP8 routed experts (gather, SwiGLU, scatter, combine) against the same arithmetic in torch: each pick's
    expert on its token's activations (W8A8: quantised per 32 channels, h re-quantised), weighted sum. The
    activations are quantised by torch here (`torch_quantisation`). `prefill`: a `PrefillTile` launch (1-D grid
    in groups of 2 row tiles, the down GEMM twice as wide as the gate/up one)."""
    from hybridcache.kernels.gemm.fp8_tiles import PrefillTile
    from hybridcache.kernels.gemm.triton_fp8_moe import fp8_grouped_experts

    torch_quantisation(monkeypatch)

    generator = torch.Generator().manual_seed(inter)
    tokens, hidden, experts, top_k, block = 7, 64, 5, 2, (32, 32)
    fmt = Fp8Format("block", block)
    x = torch.randn(tokens, hidden, generator=generator)
    gate = [quantize(torch.randn(inter, hidden, generator=generator) / 8, fmt) for _ in range(experts)]
    up = [quantize(torch.randn(inter, hidden, generator=generator) / 8, fmt) for _ in range(experts)]
    down = [quantize(torch.randn(hidden, inter, generator=generator) / 8, fmt) for _ in range(experts)]
    top_ids = torch.stack([torch.randperm(experts, generator=generator)[:top_k] for _ in range(tokens)])
    top_weights = torch.rand(tokens, top_k, generator=generator)
    tile = PrefillTile(block_m=16, block_n=32, down_block_n=64, num_warps=4, group_m=2) if prefill else None
    got = fp8_grouped_experts(x, top_weights, top_ids, stacked_experts(gate, up, down, block), w8a16=w8a16,
                              swap_ab=swap_ab, prefill=tile)
    want = torch.zeros_like(x)
    for t in range(tokens):
        for j in range(top_k):
            e = int(top_ids[t, j])
            if w8a16:
                g, u = linear(x[t : t + 1], *gate[e], fmt), linear(x[t : t + 1], *up[e], fmt)
                want[t] += top_weights[t, j] * linear(torch.nn.functional.silu(g) * u, *down[e], fmt)[0]
                continue
            xq, xs = quantize_groups(x[t : t + 1], block[1])
            g = emulate_block_linear(xq, xs, *gate[e], block)
            u = emulate_block_linear(xq, xs, *up[e], block)
            hq, hs = quantize_groups(torch.nn.functional.silu(g) * u, block[1])
            want[t] += top_weights[t, j] * emulate_block_linear(hq, hs, *down[e], block)[0]
    # W8A8: h is re-quantised (by the interpreter, which flushes e4m3 subnormals), so a one-step rounding flip
    # moves a term by 2^-4; W8A16: fp32 summation order only
    assert rel(got, want) <= (1e-5 if w8a16 else 1e-4)


@needs_interpreter
def test_interpreted_fp8_experts_launch_the_module_tiles(monkeypatch):
    """`fp8_grouped_experts` launches both GEMMs with the `DECODE_*` tile (pipeline depth included) while
    `moe.grouped.tile_rows` gives a tile, and above with the `PREFILL_TILES` tile of the rows' bucket (its own
    width for the down GEMM, its pipeline depth and launch order): the module choices
    `fp8_bench.choose_decode_kernels` sets from a sweep are what the engine runs."""
    from hybridcache.kernels.gemm import fp8_tiles, triton_fp8_moe

    torch_quantisation(monkeypatch)
    launches: list[dict] = []
    original = triton_fp8_moe.fp8_expert_gemm

    def recording(*args, **kwargs):
        launches.append({key: kwargs.get(key) for key in ("block_m", "block_n", "swap_ab", "num_warps",
                                                          "num_stages", "group_m")})
        return original(*args, **kwargs)

    monkeypatch.setattr(triton_fp8_moe, "fp8_expert_gemm", recording)
    for name, value in (("DECODE_BLOCK_N", 32), ("DECODE_NUM_WARPS", 2), ("DECODE_NUM_STAGES", 5)):
        monkeypatch.setattr(triton_fp8_moe, name, value)
    monkeypatch.setattr(fp8_tiles, "PREFILL_SMALL_ROWS", 100)
    monkeypatch.setattr(fp8_tiles, "PREFILL_TILES", {"small": fp8_tiles.PrefillTile(32, 32, 64, 2, 3, 0),
                                                      "large": fp8_tiles.PrefillTile(16, 64, 32, 4, 4, 2)})
    generator = torch.Generator().manual_seed(3)
    hidden, inter, experts, top_k, block = 64, 32, 2, 2, (32, 32)
    fmt = Fp8Format("block", block)
    gate, up = ([quantize(torch.randn(inter, hidden, generator=generator) / 8, fmt) for _ in range(experts)]
                for _ in range(2))
    down = [quantize(torch.randn(hidden, inter, generator=generator) / 8, fmt) for _ in range(experts)]
    stacked = stacked_experts(gate, up, down, block)
    for tokens in (3, 70, 130):  # rows per expert: a decode tile (16 rows), the small prefill bucket, the large
        ids = torch.arange(top_k).repeat(tokens, 1)
        triton_fp8_moe.fp8_grouped_experts(torch.randn(tokens, hidden, generator=generator),
                                           torch.rand(tokens, top_k, generator=generator), ids, stacked)
    decode = dict(block_m=16, block_n=32, swap_ab=True, num_warps=2, num_stages=5, group_m=None)
    small = dict(block_m=32, block_n=32, swap_ab=None, num_warps=2, num_stages=3, group_m=0)  # swap-AB: the default
    large = dict(block_m=16, block_n=64, swap_ab=None, num_warps=4, num_stages=4, group_m=2)
    assert launches == [decode, decode, small, small | dict(block_n=64), large, large | dict(block_n=32)]


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


@needs_cuda
@pytest.mark.parametrize("tokens", [3, 64, 700], ids=["decode-3", "decode-64", "prefill-700"])
def test_cuda_fp8_grouped_experts(tokens):
    """The FP8 routed experts as the engine runs them (decode: the `DECODE_*` tile; prefill: W8A8), at decode
    sizes both swap-AB tiles (W8A16 and W8A8), at prefill sizes other `PrefillTile`s (grouped launch order, 128
    rows, a wider down GEMM, 2 stages), against the dequantised experts in fp32: within bf16 rounding (W8A16) or
    the activations' e4m3 rounding (W8A8)."""
    from hybridcache.kernels.gemm import triton_fp8_moe
    from hybridcache.kernels.gemm.triton_fp8_moe import fp8_grouped_experts

    generator = torch.Generator().manual_seed(tokens)
    hidden, inter, experts, top_k = 256, 128, 8, 2
    gate = [quantize(torch.randn(inter, hidden, generator=generator) / 16, BLOCK) for _ in range(experts)]
    up = [quantize(torch.randn(inter, hidden, generator=generator) / 16, BLOCK) for _ in range(experts)]
    down = [quantize(torch.randn(hidden, inter, generator=generator) / 11, BLOCK) for _ in range(experts)]
    x = torch.randn(tokens, hidden, generator=generator)
    top_ids = torch.stack([torch.randperm(experts, generator=generator)[:top_k] for _ in range(tokens)])
    top_weights = torch.rand(tokens, top_k, generator=generator)
    want = torch.zeros_like(x)
    for t in range(tokens):
        for j in range(top_k):
            e = int(top_ids[t, j])
            g, u = linear(x[t : t + 1], *gate[e], BLOCK), linear(x[t : t + 1], *up[e], BLOCK)
            want[t] += top_weights[t, j] * linear(torch.nn.functional.silu(g) * u, *down[e], BLOCK)[0]
    stacked = stacked_experts([(w.cuda(), s.cuda()) for w, s in gate], [(w.cuda(), s.cuda()) for w, s in up],
                              [(w.cuda(), s.cuda()) for w, s in down], BLOCK.block)
    from hybridcache.kernels.gemm.fp8_tiles import PrefillTile

    prefill_tiles = [PrefillTile(128, 64, 128, 8, 2, 8), PrefillTile(64, 128, 256, 8, 3, 8),
                     PrefillTile(64, 128, 128, 4, 4, 8)]  # the sweep's kinds: 128 rows, 256-wide down, 4 warps
    modes = [{}] + ([dict(w8a16=True, swap_ab=True), dict(w8a16=False, swap_ab=True),
                     dict(w8a16=False, swap_ab=True, num_stages=5)] if tokens <= 64 else
                    [dict(prefill=tile) for tile in prefill_tiles])
    for mode in modes:
        got = fp8_grouped_experts(x.cuda().bfloat16(), top_weights.cuda().bfloat16(), top_ids.cuda(), stacked,
                                  **mode)
        w8a16 = tokens <= 64 and mode.get("w8a16", triton_fp8_moe.DECODE_W8A16)
        # W8A8: x and h each rounded to e4m3 (steps of 2^-4 relative); an indexing or scale bug is O(1)
        assert got.dtype == torch.bfloat16 and rel(got.cpu(), want) <= (2e-2 if w8a16 else 1e-1), mode


@needs_cuda
def test_cuda_fp8_compile_tiles_covers_every_sort_bucket(monkeypatch):
    """The FP8 experts' start-up compile runs the one-launch sort at every pair-count bucket it launches with (as
    the bf16 experts' does), so no request compiles one."""
    from hybridcache.kernels.gemm.triton_fp8_moe import compile_tiles
    from hybridcache.kernels.moe import triton_sort

    pair_counts: list[int] = []
    original = triton_sort.sort_pairs_triton

    def recording(top_ids: torch.Tensor, num_experts: int, shared: bool = False):
        pair_counts.append(top_ids.numel())
        return original(top_ids, num_experts, shared)

    monkeypatch.setattr(triton_sort, "sort_pairs_triton", recording)
    generator = torch.Generator().manual_seed(0)
    gate, up, down = ([tuple(t.cuda() for t in quantize(torch.randn(128, 128, generator=generator), BLOCK))
                       for _ in range(4)] for _ in range(3))
    compile_tiles(torch.zeros(1, 128, device="cuda", dtype=torch.bfloat16), stacked_experts(gate, up, down,
                                                                                           BLOCK.block), 2)
    assert set(triton_sort.block_sizes()) <= set(pair_counts)


@needs_interpreter
@pytest.mark.parametrize("w8a16", [False, True], ids=["w8a8", "w8a16"])
@pytest.mark.parametrize("fmt", [BLOCK, CHANNEL], ids=["block", "channel"])
def test_interpreted_fp8_experts_of_the_model_against_the_reference_backend(fmt, w8a16, monkeypatch):
    """The CUDA backend's FP8 MoE path (experts stacked from `Fp8Linear` modules by `Fp8ExpertWeights.share`,
    per-channel scales as (1, 128) blocks) against the reference backend's (dequantised weights, activations not
    quantised): W8A8 within the activations' e4m3 rounding, 5e-2 relative; W8A16 to fp32 summation order."""
    from hybridcache.kernels.backend import ReferenceBackend
    from hybridcache.kernels.gemm.triton_fp8_moe import Fp8ExpertWeights, fp8_grouped_experts
    from tests.kernels.test_fp8_rowwise_experts import block_experts

    torch_quantisation(monkeypatch)
    generator = torch.Generator().manual_seed(7)
    hidden, inter, num_experts, top_k, tokens = 128, 96, 4, 2, 9
    experts = block_experts(hidden, inter, num_experts, generator, fmt)
    x = torch.randn(tokens, hidden, generator=generator)
    top_ids = torch.stack([torch.randperm(num_experts, generator=generator)[:top_k] for _ in range(tokens)])
    top_weights = torch.rand(tokens, top_k, generator=generator)
    want = ReferenceBackend().moe(x, top_weights, top_ids, experts)
    got = fp8_grouped_experts(x, top_weights, top_ids, Fp8ExpertWeights.share(experts, per_channel=False),
                              w8a16=w8a16)
    if w8a16:
        assert rel(got, want) <= 1e-5
        return
    assert rel(got, want) <= 5e-2
    assert rel(got, want) > 1e-4  # the activations were quantised: not the reference's arithmetic bit for bit


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
