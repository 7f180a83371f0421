"""The skinny dense GEMM (test_skinny_gemm.py checks its numbers) compiles for the H200 (sm90) without a GPU, in
the variants the dense choice tries for a bf16 model: 16 to 64 rows, 64 or 128 weight rows per tile, unsplit or
split-K. Compiled as the JIT specialises a launch on a model's tensors (pointers and strides multiples of 16), the
K loop streams both tiles through shared memory with 16-byte asynchronous copies (`cp.async`, pipelined: the
shared memory holds every stage) into wgmma; the split variant keeps its counter atomics and the unsplit one has
none; the run-time sizes are not specialised (one compile per tile and split count for every batch and shape).
The TMA variant (x and weight tiles by descriptors) streams both by bulk tensor copies, with no `cp.async` left,
into the same wgmma, split or not, at 64 to 256 weight rows; with SWIGLU the weight by TMA and the gate / up by
pointer loads."""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")

from triton.compiler import ASTSource  # noqa: E402

from hybridcache.kernels.gemm.triton_skinny import _skinny_gemm_kernel  # noqa: E402
from tests.kernels.hopper import HOPPER  # noqa: E402

POINTERS = {"x_ptr": "*bf16", "up_ptr": "*bf16", "w_ptr": "*bf16", "bias_ptr": "*bf16", "out_ptr": "*bf16",
            "ws_ptr": "*fp32", "count_ptr": "*i32"}


def compile_aligned(constants: dict, num_stages: int):
    """The kernel for sm90 with every pointer and stride known to be a multiple of 16 (the JIT's specialisation
    for contiguous bf16 tensors with K % 8 == 0), other integers i32."""
    kernel = _skinny_gemm_kernel
    signature = {p.name: POINTERS.get(p.name) or ("constexpr" if p.name in constants else "i32")
                 for p in kernel.params}
    attrs = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(kernel.params)
             if p.name.endswith("_ptr") or p.name.startswith("stride")}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constants, attrs=attrs)
    return triton.compile(source, target=HOPPER, options={"num_warps": 4, "num_stages": num_stages})


@pytest.mark.parametrize("split", [False, True], ids=["unsplit", "split"])
@pytest.mark.parametrize(("block_m", "block_n", "stages"), [(16, 64, 4), (64, 64, 4), (32, 128, 3)])
def test_skinny_gemm_compiles_for_hopper(block_m: int, block_n: int, stages: int, split: bool) -> None:
    constants = dict(HAS_BIAS=False, SPLIT=3 if split else 1, EVEN_K=True, SWIGLU=False, BLOCK_M=block_m,
                     BLOCK_N=block_n, BLOCK_K=128, PRECISION="tf32", TMA=False)
    compiled = compile_aligned(constants, stages)
    ptx = compiled.asm["ptx"]
    assert ("atom.global" in ptx) == split  # the split-K counter, only when split
    assert f"wgmma.mma_async.sync.aligned.m64n{block_m}k16" in ptx  # swap-AB: the weight tile on the M side
    assert "cp.async.cg.shared.global" in ptx and "ld.global.b16" not in ptx  # 16-byte copies, no scalar loads
    assert compiled.metadata.shared >= stages * 2 * 128 * (block_m + block_n)  # every stage of both tiles


def test_skinny_gemm_swiglu_compiles_for_hopper() -> None:
    """The down projection's variant: silu(gate) * up in the loads (the sigmoid's exponential), still on wgmma."""
    constants = dict(HAS_BIAS=False, SPLIT=3, EVEN_K=True, SWIGLU=True, BLOCK_M=64, BLOCK_N=64, BLOCK_K=128,
                     PRECISION="tf32", TMA=False)
    ptx = compile_aligned(constants, 4).asm["ptx"]
    assert "ex2" in ptx and "wgmma.mma_async" in ptx and "ld.global.b16" not in ptx


def test_skinny_gemm_does_not_specialise_run_time_sizes() -> None:
    sizes = {p.name for p in _skinny_gemm_kernel.params if p.do_not_specialize}
    assert sizes == {"M", "N", "K", "slice_steps"}


@pytest.mark.parametrize(("block_m", "block_n", "block_k", "warps", "split"),
                         [(64, 64, 128, 4, True), (64, 128, 64, 4, False), (16, 64, 128, 4, False),
                          (64, 256, 64, 8, True)])
def test_skinny_gemm_tma_compiles_for_hopper(block_m: int, block_n: int, block_k: int, warps: int,
                                             split: bool) -> None:
    """The TMA variant (`SkinnyConfig.tma`): x's and the weight's tiles by bulk tensor copies (no `cp.async`) into
    wgmma, the weight tile on the M side."""
    kernel = _skinny_gemm_kernel
    pointers = dict(POINTERS, x_ptr=f"tensordesc<bf16[{block_m}, {block_k}]>",
                    w_ptr=f"tensordesc<bf16[{block_n}, {block_k}]>")
    constants = dict(HAS_BIAS=False, SPLIT=3 if split else 1, EVEN_K=True, SWIGLU=False, BLOCK_M=block_m,
                     BLOCK_N=block_n, BLOCK_K=block_k, PRECISION="tf32", TMA=True)
    signature = {p.name: pointers.get(p.name) or ("constexpr" if p.name in constants else "i32")
                 for p in kernel.params}
    attrs = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(kernel.params)
             if (p.name.endswith("_ptr") and p.name not in ("x_ptr", "w_ptr")) or p.name.startswith("stride")}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constants, attrs=attrs)
    ptx = triton.compile(source, target=HOPPER, options={"num_warps": warps, "num_stages": 4}).asm["ptx"]
    assert "cp.async.bulk.tensor" in ptx and "cp.async.cg" not in ptx
    assert f"wgmma.mma_async.sync.aligned.m64n{block_m}k16" in ptx
    assert ("atom.global" in ptx) == split



def test_skinny_gemm_tma_swiglu_compiles_for_hopper() -> None:
    """The down projection's TMA variant: the weight by bulk tensor copies, silu(gate) * up by pointer loads."""
    kernel = _skinny_gemm_kernel
    pointers = dict(POINTERS, w_ptr="tensordesc<bf16[64, 128]>")
    constants = dict(HAS_BIAS=False, SPLIT=2, EVEN_K=True, SWIGLU=True, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128,
                     PRECISION="tf32", TMA=True)
    signature = {p.name: pointers.get(p.name) or ("constexpr" if p.name in constants else "i32")
                 for p in kernel.params}
    attrs = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(kernel.params)
             if (p.name.endswith("_ptr") and p.name != "w_ptr") or p.name.startswith("stride")}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constants, attrs=attrs)
    ptx = triton.compile(source, target=HOPPER, options={"num_warps": 4, "num_stages": 4}).asm["ptx"]
    assert "cp.async.bulk.tensor" in ptx and "ex2" in ptx and "wgmma.mma_async" in ptx
