"""The FP8 kernels compile for the H200 (sm90) without a GPU (`tests/kernels/hopper.py`), so a kernel that the
interpreter runs but the compiler rejects (one return type over two constexpr branches was such a case) fails
here, not on the device. Every variant the engine can launch is compiled: the dense kernel's decode tiles
(swap-AB, W8A16 and W8A8) and its prefill tile, the grouped expert kernel's decode and prefill tiles (gate/up and
down; block and per-channel scales; the SwiGLU and relu^2 epilogues; an fp32 engine's W8A16 tiles), the
quantisation kernels (per group; SwiGLU or relu^2 + per row), the shared expert's routes (`with_shared`). The
swap-AB tiles must reach Hopper's wgmma (the reason for them: with 16 to 32 rows on the MMA's M side Triton falls
back to mma.sync)."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from hybridcache.kernels.gemm.triton_block_fp8 import _fp8_gemm_kernel  # noqa: E402
from hybridcache.kernels.gemm.triton_fp8_moe import _fp8_expert_gemm_kernel  # noqa: E402
from hybridcache.kernels.gemm.triton_quant import (  # noqa: E402
    _activation_quantize_rows_kernel,
    _quantize_groups_kernel,
)
from tests.kernels.hopper import compile_for_hopper  # noqa: E402


@pytest.mark.parametrize(("a_fp8", "block_m", "block_n", "swap_ab"), [
    (False, 16, 64, True), (True, 32, 64, True), (False, 64, 64, True), (True, 64, 128, False)])
def test_dense_fp8_gemm_compiles_for_hopper(a_fp8, block_m, block_n, swap_ab):
    pointers = {"a_ptr": "*fp8e4nv" if a_fp8 else "*bf16", "a_scale_ptr": "*fp32", "w_ptr": "*fp8e4nv",
                "w_scale_ptr": "*fp32", "out_ptr": "*bf16"}
    ints = ["M", "N", "K", "stride_am", "stride_wn", "stride_om", "stride_asm", "stride_asg", "stride_wsn",
            "stride_wsk"]
    constants = dict(GROUP_N=128, GROUP_K=128, A_FP8=a_fp8, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=128,
                     GROUP_M=8, SWAP_AB=swap_ab, PRECISION="tf32")
    compiled = compile_for_hopper(_fp8_gemm_kernel, pointers, ints, constants)
    assert "wgmma" in compiled.asm["ptx"]


@pytest.mark.parametrize(("a_fp8", "block_m", "block_n", "swap_ab", "swiglu", "num_warps", "group_m"), [
    (False, 16, 64, True, True, 4, 0), (False, 32, 64, True, False, 4, 0), (True, 32, 64, True, True, 4, 0),
    (True, 64, 128, False, True, 8, 0), (True, 64, 128, False, False, 4, 0), (True, 64, 128, False, True, 8, 8),
    (True, 128, 64, False, True, 8, 8), (True, 128, 128, False, False, 8, 8), (True, 64, 256, False, False, 8, 8)])
@pytest.mark.parametrize("group_n", [128, 1, "scale-once"], ids=["block", "per-channel", "per-channel-scale-once"])
def test_fp8_expert_gemm_compiles_for_hopper(a_fp8, block_m, block_n, swap_ab, swiglu, num_warps, group_m, group_n):
    scale_once = group_n == "scale-once" and a_fp8  # (per-token x, per-row weights: `DECODE_TOKEN_SCALES`)
    group_n = 1 if group_n == "scale-once" else group_n
    pointers = {"a_ptr": "*fp8e4nv" if a_fp8 else "*bf16", "a_scale_ptr": "*fp32", "order_ptr": "*i64",
                "w_ptr": "*fp8e4nv", "w_scale_ptr": "*fp32", "out_ptr": "*bf16", "counts_ptr": "*i32"}
    ints = ["num_experts", "top_k", "N", "K", "UP_GROUP", "stride_a", "stride_as", "stride_we", "stride_wn",
            "stride_wse", "stride_wsn", "stride_wsk", "stride_out"]
    constants = dict(GATHER=swiglu, SCATTER=not swiglu, SWIGLU=swiglu, A_FP8=a_fp8, GROUP_N=group_n, GROUP_K=128,
                     BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=128, BLOCK_E=32, SWAP_AB=swap_ab, PRECISION="tf32",
                     GROUP_M=group_m, SCALE_ONCE=scale_once, RELU2=False)
    compiled = compile_for_hopper(_fp8_expert_gemm_kernel, pointers, ints, constants, num_warps)
    assert "wgmma" in compiled.asm["ptx"]


# "relu2" experts' first GEMM (gathered, relu^2 epilogue, one accumulator): the decode tiles (W8A16 and W8A8
# swap-AB, a plain 64-row tile) and a prefill tile, with per-channel scales (what ModelOpt's experts run as), once
# per K step or once after it
@pytest.mark.parametrize(("a_fp8", "block_m", "block_n", "swap_ab", "num_warps", "group_m"), [
    (False, 16, 64, True, 4, 0), (True, 32, 64, True, 4, 0), (True, 64, 64, False, 4, 0), (True, 64, 128, False, 8, 8)])
@pytest.mark.parametrize("scale_once", [False, True], ids=["per-k-step", "scale-once"])
def test_fp8_relu2_expert_gemm_compiles_for_hopper(a_fp8, block_m, block_n, swap_ab, num_warps, group_m, scale_once):
    pointers = {"a_ptr": "*fp8e4nv" if a_fp8 else "*bf16", "a_scale_ptr": "*fp32", "order_ptr": "*i64",
                "w_ptr": "*fp8e4nv", "w_scale_ptr": "*fp32", "out_ptr": "*bf16", "counts_ptr": "*i32"}
    ints = ["num_experts", "top_k", "N", "K", "UP_GROUP", "stride_a", "stride_as", "stride_we", "stride_wn",
            "stride_wse", "stride_wsn", "stride_wsk", "stride_out"]
    constants = dict(GATHER=True, SCATTER=False, SWIGLU=False, A_FP8=a_fp8, GROUP_N=1, GROUP_K=128,
                     BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=128, BLOCK_E=32, SWAP_AB=swap_ab, PRECISION="tf32",
                     GROUP_M=group_m, SCALE_ONCE=scale_once and a_fp8, RELU2=True)
    ptx = compile_for_hopper(_fp8_expert_gemm_kernel, pointers, ints, constants, num_warps).asm["ptx"]
    assert "wgmma" in ptx
    assert "max.f32" in ptx and "ex2" not in ptx  # relu's max, and no sigmoid


# an fp32 engine's experts (`triton_fp8_moe.fp8_exact`): W8A16 on fp32 x and h, IEEE fp32 products, K steps of 32
# (`fp8_expert_gemm`'s fp32 cap): the decode tiles (swap-AB, 16 and 64 rows) and the prefill tiles (gate/up 64 x 64,
# down 64 x 128), each epilogue (SwiGLU, relu^2, none: the down GEMM), block and per-channel scales
@pytest.mark.parametrize(("block_m", "block_n", "swap_ab", "group_m"), [
    (16, 64, True, 0), (64, 64, True, 0), (64, 64, False, 8), (64, 128, False, 8)])
@pytest.mark.parametrize("epilogue", ["swiglu", "relu2", "down"])
@pytest.mark.parametrize("group_n", [128, 1], ids=["block", "per-channel"])
def test_fp32_w8a16_expert_gemm_compiles_for_hopper(block_m, block_n, swap_ab, group_m, epilogue, group_n):
    pointers = {"a_ptr": "*fp32", "a_scale_ptr": "*fp32", "order_ptr": "*i64", "w_ptr": "*fp8e4nv",
                "w_scale_ptr": "*fp32", "out_ptr": "*fp32", "counts_ptr": "*i32"}
    ints = ["num_experts", "top_k", "N", "K", "UP_GROUP", "stride_a", "stride_as", "stride_we", "stride_wn",
            "stride_wse", "stride_wsn", "stride_wsk", "stride_out"]
    constants = dict(GATHER=epilogue != "down", SCATTER=epilogue == "down", SWIGLU=epilogue == "swiglu", A_FP8=False,
                     GROUP_N=group_n, GROUP_K=128, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=32, BLOCK_E=32,
                     SWAP_AB=swap_ab, PRECISION="ieee", GROUP_M=group_m, SCALE_ONCE=False, RELU2=epilogue == "relu2")
    ptx = compile_for_hopper(_fp8_expert_gemm_kernel, pointers, ints, constants).asm["ptx"]
    assert "fma.rn.f32" in ptx and "tf32" not in ptx  # IEEE fp32 products, not tensor cores' tf32


def test_quantize_groups_compiles_for_hopper():
    pointers = {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32"}
    ints = ["M", "K", "num_groups", "stride_x", "stride_q", "stride_sm", "stride_sg"]
    compiled = compile_for_hopper(_quantize_groups_kernel, pointers, ints, dict(GROUP=128, CHUNK=16, QMAX=448.0))
    assert "e4m3" in compiled.asm["ptx"]  # the conversion to FP8


@pytest.mark.parametrize("relu2", [False, True], ids=["swiglu", "relu2"])
@pytest.mark.parametrize("block", [1024, 512])
def test_activation_quantize_rows_compiles_for_hopper(block, relu2):
    pointers = {"h_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32"}
    compiled = compile_for_hopper(_activation_quantize_rows_kernel, pointers, ["M", "N", "stride_h", "stride_q"],
                                  dict(BLOCK=block, QMAX=448.0, RELU2=relu2))
    assert "e4m3" in compiled.asm["ptx"]
    assert ("ex2" in compiled.asm["ptx"]) != relu2  # the sigmoid's exponential: SwiGLU's only


def test_with_shared_compiles_for_hopper():
    from hybridcache.kernels.gemm.triton_fp8_moe import _with_shared_kernel

    pointers = {"w_ptr": "*bf16", "ids_ptr": "*i64", "gate_ptr": "*bf16", "w_out_ptr": "*bf16", "ids_out_ptr": "*i64"}
    ints = ["T", "top_k", "shared_id", "stride_w", "stride_ids", "stride_gate"]
    compiled = compile_for_hopper(_with_shared_kernel, pointers, ints, dict(BLOCK_T=64, BLOCK_K=16))
    assert "ex2" in compiled.asm["ptx"]  # the sigmoid's exponential
