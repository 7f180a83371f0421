"""The skinny dense GEMM (`kernels/gemm/triton_skinny.py`) and the measured choice (`kernels/gemm/dense.py`).

- `test_interpreted_*`: the kernel on the CPU under TRITON_INTERPRET=1 (child process,
  `test_skinny_gemm_in_a_triton_interpreter_subprocess`), fp32 and fp16 (the interpreter's bf16 matrix products are
  wrong: bf16 is checked on CUDA), odd M, N, K, unsplit and split-K (2 and 3 slices, the last one short), with and
  without bias: against the fp32 product of the same rounded inputs; the same bits on a second launch; every split-K
  counter back at 0 after a launch.
- The TMA variant (`SkinnyConfig.tma`), interpreted: the same shapes, unsplit and 3 slices, 64 x 128 and 128 x 64
  tiles; a weight whose rows are not 16-byte aligned is refused; with `up` the weight comes by TMA and the gate / up
  by pointer loads; an x whose rows are not aligned is copied first (the same result). On CUDA: bf16 at the models'
  shapes (1,048 and 2,088 rows, 12,352 x 2,048, ...) with 64 x 128, 128 x 64 and 256 x 64 (8 warps) tiles, unsplit
  and 3 slices, and in a graph replay.
- `test_cuda_*` (skipped without a device): bf16 at next-1b's projection shapes and others (N not a multiple of
  the tile; N a multiple of 16 but for the router's 17, to keep the compiled variants few), 64 and 128 weight rows
  per tile, unsplit and 3 slices (a short last one), no bias (the variants a bf16 model compiles); an odd K with a
  bias in bf16 and fp32;
  a CUDA graph replay equals the eager launch bit for bit; `dense.linear` after its measurement equals the chosen
  kernel (cuBLAS, cuBLASLt's zero-bias epilogue or a skinny launch) and is within bf16 rounding of `F.linear`.
- With `up` (an MLP's down projection, `dense.swiglu_linear`): silu(gate) * up made as the tiles load equals the
  activation kernel's output fed to the plain kernel, bit for bit (interpreted in fp32 / fp16, bf16 on CUDA), and
  `dense.swiglu_linear` equals its two launches at 1 to 100 rows on CUDA.
- The CPU path of `dense.linear` is `F.linear` exactly (`swiglu_linear`: the backend's silu_mul, then `F.linear`);
  bad shapes and dtypes are refused before a launch.

Tolerances: fp32 products summed in another order (and the split-K slices' partial sums): 1e-5 of max |ref|;
fp16 / bf16 outputs are rounded once from an fp32 sum: one rounding step, 2^-10 / 2^-8 relative, of max |ref|
(doubled for the interpreter, which truncates).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridcache.kernels.gemm import dense
from tests.kernels.interpreter import interpreted_in_child, needs_cuda, needs_interpreter

STEP = {torch.float32: 1e-5, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-8}
SHAPES = [(1, 70, 300), (5, 130, 384), (17, 64, 520), (33, 200, 640), (64, 96, 384)]  # (M, N, K): K % 128 != 0 too


def operands(m: int, n: int, k: int, dtype: torch.dtype, device: str, bias: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(device, dtype)
    w = (torch.randn(n, k, generator=gen) * k**-0.5).to(device, dtype)
    b = torch.randn(n, generator=gen).to(device, dtype) if bias else None
    return x, w, b


def check_skinny(m: int, n: int, k: int, split: int, dtype: torch.dtype, device: str, bias: bool,
                 block_n: int = 64, slack: float = 1.0, tma: bool = False, block_k: int = 128, num_warps: int = 4
                 ) -> None:
    from hybridcache.kernels.gemm.triton_skinny import SkinnyConfig, fits, scratch, skinny_linear

    config = SkinnyConfig(block_n=block_n, block_k=block_k, split_k=split, num_warps=num_warps,
                          num_stages=4 if block_n == 64 else 3, tma=tma)  # as `candidates`
    assert fits(n, k, m, config)
    x, w, b = operands(m, n, k, dtype, device, bias)
    out = skinny_linear(x, w, b, config)
    ref = x.double() @ w.double().T + (b.double() if bias else 0)
    assert out.shape == (m, n) and out.dtype == dtype
    err = (out.double() - ref).abs().max().item() / ref.abs().max().item()
    assert err <= slack * STEP[dtype], (m, n, k, split, dtype, err)
    assert torch.equal(skinny_linear(x, w, b, config), out)  # the slices are summed in one fixed order
    assert not scratch(x.device).counters.any()  # every counter left at 0 for the next launch


def check_skinny_swiglu(m: int, n: int, k: int, split: int, dtype: torch.dtype, device: str, slack: float = 1.0,
                        tma: bool = False) -> None:
    """silu(gate) * up made in the GEMM's loads: the same bits as the activation kernel's output fed to the plain
    kernel, and within rounding of torch (silu_mul's roundings in torch, then the product in fp64)."""
    from hybridcache.kernels.activation import reference as activation_ref
    from hybridcache.kernels.activation import triton as activation
    from hybridcache.kernels.gemm.triton_skinny import SkinnyConfig, scratch, skinny_linear

    gen = torch.Generator().manual_seed(m + n + k)
    gate_up = (2 * torch.randn(m, 2 * k, generator=gen)).to(device, dtype)
    gate, up = gate_up.split([k, k], dim=-1)  # column views of one fused output, as the MLP passes them
    w = (torch.randn(n, k, generator=gen) * k**-0.5).to(device, dtype)
    config = SkinnyConfig(split_k=split, tma=tma)
    out = skinny_linear(gate, w, None, config, up=up)
    assert torch.equal(out, skinny_linear(activation.silu_mul(gate, up), w, None, config))
    act = activation_ref.silu_mul(gate, up).double()
    ref = act @ w.double().T
    err = (out.double() - ref).abs().max().item() / ref.abs().max().item()
    assert err <= slack * 2 * STEP[dtype], (m, n, k, split, dtype, err)  # silu_mul's own roundings may differ
    assert not scratch(out.device).counters.any()


@needs_interpreter
@pytest.mark.parametrize("split", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_interpreted_skinny_gemm_swiglu(dtype: torch.dtype, split: int) -> None:
    check_skinny_swiglu(17, 70, 384, split, dtype, "cpu", slack=2.0)
    check_skinny_swiglu(3, 64, 520, split, dtype, "cpu", slack=2.0)


@needs_interpreter
@pytest.mark.parametrize("split", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
def test_interpreted_skinny_gemm(m: int, n: int, k: int, dtype: torch.dtype, split: int) -> None:
    check_skinny(m, n, k, split, dtype, "cpu", bias=split == 2, slack=2.0)


@needs_interpreter
@pytest.mark.parametrize("split", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
def test_interpreted_skinny_gemm_tma(m: int, n: int, k: int, dtype: torch.dtype, split: int) -> None:
    """The weight's and x's tiles through TMA descriptors (rows, columns and K past the edges read as 0); a weight
    whose rows are not 16-byte aligned is refused."""
    if k * dtype.itemsize % 16:
        from hybridcache.kernels.gemm.triton_skinny import SkinnyConfig, skinny_linear

        x, w, _ = operands(m, n, k, dtype, "cpu", bias=False)
        with pytest.raises(ValueError, match="TMA"):
            skinny_linear(x, w, None, SkinnyConfig(tma=True))
        return
    check_skinny(m, n, k, split, dtype, "cpu", bias=split == 3, slack=2.0, tma=True)
    check_skinny(m, n, k, split, dtype, "cpu", bias=False, slack=2.0, tma=True, block_n=128, block_k=64)


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_interpreted_skinny_gemm_tma_swiglu_and_unaligned_x(dtype: torch.dtype) -> None:
    """With `up` the weight by TMA and the gate / up tiles by pointer loads; an x whose rows are not 16-byte
    aligned is copied before its descriptor is made (the same result as an aligned x)."""
    from hybridcache.kernels.gemm.triton_skinny import SkinnyConfig, skinny_linear

    check_skinny_swiglu(17, 70, 384, 2, dtype, "cpu", slack=2.0, tma=True)
    x, w, _ = operands(9, 70, 384, dtype, "cpu", bias=False)
    wide = torch.zeros(9, 389, dtype=dtype)
    wide[:, 5:] = x
    config = SkinnyConfig(split_k=2, tma=True)
    assert torch.equal(skinny_linear(wide[:, 5:], w, None, config), skinny_linear(x, w, None, config))


@interpreted_in_child("interpreted")
def test_skinny_gemm_in_a_triton_interpreter_subprocess() -> None:
    """This file's interpreted tests, in a child process (tests/kernels/interpreter.py)."""


def test_dense_linear_is_f_linear_on_the_cpu() -> None:
    from hybridcache.kernels.activation import reference as activation_ref

    for dtype in (torch.float32, torch.bfloat16):
        x, w, b = operands(5, 70, 96, dtype, "cpu", bias=True)
        assert torch.equal(dense.linear(x, w, b), F.linear(x, w, b))
        assert torch.equal(dense.linear(x.view(5, 1, 96), w), F.linear(x.view(5, 1, 96), w))
        gate, up = torch.randn(5, 140).to(dtype).split([70, 70], dim=-1)
        down = torch.randn(96, 70).to(dtype)
        assert torch.equal(dense.swiglu_linear(gate, up, down, None, activation_ref.silu_mul),
                           F.linear(activation_ref.silu_mul(gate, up), down))
    assert not dense.choices()  # nothing measured off the device


def test_skinny_gemm_refuses_bad_input() -> None:
    pytest.importorskip("triton")
    from hybridcache.kernels.gemm.triton_skinny import SkinnyConfig, skinny_linear

    x, w, b = operands(4, 64, 256, torch.float32, "cpu", bias=True)
    with pytest.raises(ValueError, match="x \\[M, K\\] and weight \\[N, K\\]"):
        skinny_linear(x, w[:, :128], None, SkinnyConfig())
    with pytest.raises(ValueError, match="dtype"):
        skinny_linear(x, w.half(), None, SkinnyConfig())
    with pytest.raises(ValueError, match="bias"):
        skinny_linear(x, w, b[:10], SkinnyConfig())
    with pytest.raises(ValueError, match="unit stride"):
        skinny_linear(x, w.t().contiguous().t(), None, SkinnyConfig())
    with pytest.raises(ValueError, match="cannot run"):  # more rows than a launch takes
        skinny_linear(torch.zeros(65, 256), w, None, SkinnyConfig())
    with pytest.raises(ValueError, match="cannot run"):  # 4 slices of 128 over K = 256: two would be empty
        skinny_linear(x, w, None, SkinnyConfig(split_k=4))


def test_candidates_fit_their_shapes() -> None:
    pytest.importorskip("triton")
    from hybridcache.kernels.gemm.triton_skinny import fits

    for n, k in ((12352, 2048), (2048, 4096), (17, 2048), (1024, 2048), (2048, 512), (4096, 2048)):
        for m in (16, 32, 64):
            found = dense.candidates(n, k, m, sms=132)
            assert found and all(fits(n, k, m, c) for c in found)
            assert any(c.split_k == 1 for c in found)
            assert len({c.describe() for c in found}) == len(found)
    assert {c.split_k for c in dense.candidates(2048, 4096, 64, sms=132)} >= {1, 8}  # 32 tiles of 64 fill 132 SMs


@needs_cuda
@pytest.mark.parametrize(("m", "n", "k"), [(5, 144, 384), (17, 64, 2048), (33, 208, 640), (64, 12352, 2048),
                                           (64, 2048, 4096), (3, 17, 2048)])
def test_cuda_skinny_gemm_bf16(m: int, n: int, k: int) -> None:
    """The tiles a bf16 model's choice tries (no bias, K a multiple of 128: the variants the engine compiles)."""
    for block_n in (64, 128):
        for split in (1, 3):
            check_skinny(m, n, k, split, torch.bfloat16, "cuda", False, block_n=block_n)


@needs_cuda
@pytest.mark.parametrize(("m", "n", "k"), [(5, 144, 384), (17, 64, 2048), (33, 1048, 2048), (64, 12352, 2048),
                                           (48, 2048, 4096), (3, 2088, 4096)])
def test_cuda_skinny_gemm_tma_bf16(m: int, n: int, k: int) -> None:
    """The TMA launches a bf16 model's choice tries (`dense.TILES`' shapes at 64 and 128 weight rows)."""
    for block_n, block_k, warps in ((64, 128, 4), (128, 64, 4), (256, 64, 8)):
        for split in (1, 3):
            check_skinny(m, n, k, split, torch.bfloat16, "cuda", False, block_n=block_n, tma=True, block_k=block_k,
                         num_warps=warps)


@needs_cuda
def test_cuda_skinny_gemm_odd_k_bias_and_fp32() -> None:
    check_skinny(17, 64, 520, 2, torch.bfloat16, "cuda", True)
    check_skinny(5, 70, 300, 2, torch.float32, "cuda", True)


@needs_cuda
@pytest.mark.parametrize(("m", "n", "k"), [(64, 2048, 512), (5, 2048, 512), (33, 144, 384)])
def test_cuda_skinny_gemm_swiglu(m: int, n: int, k: int) -> None:
    for split in (1, 2):
        check_skinny_swiglu(m, n, k, split, torch.bfloat16, "cuda")
        check_skinny_swiglu(m, n, k, split, torch.bfloat16, "cuda", tma=True)


@needs_cuda
def test_cuda_dense_swiglu_linear_equals_its_two_launches() -> None:
    from hybridcache.kernels.activation import triton as activation

    gen = torch.Generator().manual_seed(1)
    gate_up = torch.randn(64, 1024, generator=gen).to("cuda", torch.bfloat16)
    gate, up = gate_up.split([512, 512], dim=-1)
    w = (torch.randn(2048, 512, generator=gen) * 512**-0.5).to("cuda", torch.bfloat16)
    for m in (1, 20, 64, 100):  # 100: past the skinny GEMM's rows, cuBLAS after the activation kernel
        got = dense.swiglu_linear(gate[:m], up[:m], w, None, activation.silu_mul)
        assert torch.equal(got, dense.linear(activation.silu_mul(gate[:m], up[:m]), w))


@needs_cuda
def test_cuda_skinny_gemm_graph_replay_equals_eager() -> None:
    from hybridcache.kernels.gemm.triton_skinny import SkinnyConfig, skinny_linear

    x, w, _ = operands(64, 2048, 4096, torch.bfloat16, "cuda", bias=False)
    configs = [SkinnyConfig(split_k=8), SkinnyConfig(block_n=128, split_k=1, num_stages=3),
               SkinnyConfig(split_k=4, tma=True), SkinnyConfig(block_n=128, block_k=64, num_stages=5, tma=True)]
    eager = [skinny_linear(x, w, None, c) for c in configs]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = [skinny_linear(x, w, None, c) for c in configs]
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(replayed, eager, strict=True))


@needs_cuda
def test_cuda_dense_linear_runs_its_measured_choice() -> None:
    from hybridcache.kernels.gemm.triton_skinny import block_rows, skinny_linear

    x, w, b = operands(64, 1024, 2048, torch.bfloat16, "cuda", bias=False)
    for m in (1, 20, 64):
        out = dense.linear(x[:m], w, b)
        choice = dense.choices()[(x.device, torch.bfloat16, 1024, 2048, False, block_rows(m))]
        assert len(choice.times_us) >= 3 and all(t > 0 for _, t in choice.times_us)
        if choice.config is None:
            want = F.linear(x[:m], w, b)
        elif choice.config == dense.CUBLASLT:
            want = F.linear(x[:m], w, torch.zeros(1024, dtype=w.dtype, device=w.device))
        else:
            want = skinny_linear(x[:m], w, b, choice.config)
        assert torch.equal(out, want)
        torch.testing.assert_close(out.float(), F.linear(x[:m].float(), w.float()), rtol=0,
                                   atol=2 * STEP[torch.bfloat16] * F.linear(x[:m], w, b).abs().max().item())
    assert dense.linear(x.repeat(2, 1), w, b).shape == (128, 1024)  # past 64 rows: cuBLAS, nothing measured
