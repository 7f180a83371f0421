"""The recurrent layers' kernels and the bf16 expert GEMM compile for the H200 (sm90) without a GPU
(`tests/kernels/hopper.py`; the FP8 kernels: test_fp8_hopper_compile.py): the gated delta rule's decode step and
speculative verify kernel, the causal conv's two prefill kernels, state, decode-step and draft-state kernels, the
expert GEMM's gate/up and down tiles, and the MoE routing (softmax, and sigmoid with a correction bias), in the
variants the engine launches for a bf16 model (the SSM state pool fp32 or bf16, the conv pool bf16, Qwen3-Next's
head sizes). Their numbers are checked under the interpreter (test_cuda_kernels.py, test_verify_kernels.py); here,
that the compiler takes them and that their compile-time branches keep or drop the code they should."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("triton")

from hybridcache.kernels.conv.triton import (  # noqa: E402
    _conv_state_kernel,
    _conv_step_kernel,
    _conv_varlen_kernel,
    _conv_varlen_rows_kernel,
)
from hybridcache.kernels.conv.triton_verify import _conv_draft_states_kernel  # noqa: E402
from hybridcache.kernels.gated_delta import triton_step, triton_verify  # noqa: E402
from hybridcache.kernels.gated_delta.triton_step import _gdn_step_kernel  # noqa: E402
from hybridcache.kernels.gated_delta.triton_verify import _gdn_verify_kernel  # noqa: E402
from hybridcache.kernels.moe.triton_experts import _expert_gemm_kernel  # noqa: E402
from hybridcache.kernels.moe.triton_route import _route_kernel  # noqa: E402
from tests.kernels.hopper import compile_for_hopper  # noqa: E402

HEADS = dict(RATIO=2, DK=128, BLOCK_K=128, BLOCK_V=32)  # 16 key heads, 32 value heads, head dims 128 (Qwen3-Next)
GDN_POINTERS = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "g_ptr": "*fp32", "beta_ptr": "*bf16",
                "out_ptr": "*bf16", "slots_ptr": "*i64", "ctx_ptr": "*i32", "alog_ptr": "*bf16", "dt_ptr": "*bf16",
                "x_ptr": "*bf16", "w_ptr": "*bf16", "bias_ptr": "*bf16", "conv_ptr": "*bf16", "a_ptr": "*bf16",
                "b_ptr": "*bf16"}
CONV_POINTERS = {"x_ptr": "*bf16", "w_ptr": "*bf16", "bias_ptr": "*bf16", "out_ptr": "*bf16", "pool_ptr": "*bf16",
                 "in_gate_ptr": "*bf16", "out_gate_ptr": "*bf16",
                 "slots_ptr": "*i64", "cu_ptr": "*i32", "ctx_ptr": "*i32", "chunk_ptr": "*i32",
                 "table_ptr": "*i64", "drafts_ptr": "*i32"}
CONV = dict(BLOCK_C=128)  # kernel size 4: W = 3 state entries, BLOCK_W = 4


def integers(kernel) -> list[str]:
    """The kernel's i32 arguments: its strides and sizes (every parameter not a pointer, constexpr or `scale`)."""
    return [p.name for p in kernel.params if not p.name.endswith("_ptr") and not p.is_constexpr and p.name != "scale"]


def pointers(kernel, table: dict[str, str]) -> dict[str, str]:
    return {p.name: table[p.name] for p in kernel.params if p.name.endswith("_ptr")}


@pytest.mark.parametrize("l2norm", [True, False])
def test_gated_delta_step_compiles_for_hopper(l2norm):
    """Also the variant that makes the gates itself from a, b (GATES: g_ptr / beta_ptr hold a / b)."""
    ptx = {}
    for gates in (False, True):
        table = {**GDN_POINTERS, "pool_ptr": "*fp32"} | ({"g_ptr": "*bf16"} if gates else {})
        ptx[gates] = compile_for_hopper(_gdn_step_kernel, table, integers(_gdn_step_kernel),
                                        dict(HEADS, DV=128, L2NORM=l2norm, GATES=gates, STREAM=False, V_MAJOR=False),
                                        floats=("scale",)).asm["ptx"]
        assert ("sqrt" in ptx[gates]) == l2norm  # q and k are l2-normalised only when asked
    assert ptx[True].count("ex2") > ptx[False].count("ex2")  # the gates' exponentials, only when fused
    assert "evict_first" not in ptx[True] and ".cs." not in ptx[True]


def test_gated_delta_step_with_a_per_channel_decay_compiles_for_hopper():
    """Kimi Delta Attention's launch (GATE_DK: g [N, Hv, Dk] fp32, a decay per state row; one key head a value head,
    Kimi-Linear-48B's head dims 128, the engine's STREAM / V_MAJOR) compiles, with the streaming hints, to other
    code than the per-head launch (its numbers: the interpreter, test_kda_cuda.py)."""
    table = {**GDN_POINTERS, "pool_ptr": "*fp32"}
    ptx = {}
    for gate_dk in (0, 128):
        constants = dict(HEADS, RATIO=1, BLOCK_V=triton_step._BLOCK_V, DV=128, L2NORM=True, GATES=False,
                         STREAM=triton_step._STREAM, V_MAJOR=True, GATE_DK=gate_dk)
        ptx[gate_dk] = compile_for_hopper(_gdn_step_kernel, table, integers(_gdn_step_kernel), constants,
                                          floats=("scale",)).asm["ptx"]
    assert ptx[128] != ptx[0]
    assert "L1::evict_first" in ptx[128] and "st.global.cs" in ptx[128]


def test_gated_delta_step_streams_its_state_for_hopper():
    """STREAM (the engine's launch): the state's loads carry the evict-first hint and its stores stream (.cs); the
    grid's order (V_MAJOR) moves only which program id names the sequence and which the column block."""
    table = {**GDN_POINTERS, "pool_ptr": "*fp32", "g_ptr": "*bf16"}
    ptx = {}
    for v_major in (False, True):
        constants = dict(HEADS, BLOCK_V=triton_step._BLOCK_V, DV=128, L2NORM=True, GATES=True,
                         STREAM=triton_step._STREAM, V_MAJOR=v_major)
        ptx[v_major] = compile_for_hopper(_gdn_step_kernel, table, integers(_gdn_step_kernel), constants,
                                          floats=("scale",)).asm["ptx"]
        assert "L1::evict_first" in ptx[v_major] and "st.global.cs" in ptx[v_major]
    assert "%ctaid.z" in ptx[True] and "%ctaid.z" in ptx[False]
    assert ptx[True].count("ld.global") == ptx[False].count("ld.global")


# An integer compare of a register with an immediate: a lane mask against a head dim (`triton_step.lanes_below`)
_IMMEDIATE_COMPARE = re.compile(r"setp\.\w+\.[su](?:32|64)\s+%p\d+, %\w+, (\d+);")


@pytest.mark.parametrize("kernel", ["step", "verify"])
def test_gated_delta_lane_masks_only_where_a_tile_passes_the_head_dims(kernel):
    """Any head dims: the tiles are rounded up to powers of two (`triton_step.head_tiles`) and the lanes past Dk /
    Dv masked. Olmo-Hybrid-7B's Dk 96 / Dv 192 compiles with its key lanes compared to 96 (its value tiles, 64 or
    32 wide, end at 192: no value mask); a padded Dv 36 with Dv compares; power-of-two dims with no compare
    against a head dim at all: their masks fold to constants and vanish (the PTX of the engine's launches at
    power-of-two dims was the same, debug lines aside, as before the kernels took other dims: session 63)."""
    step = kernel == "step"
    launch = _gdn_step_kernel if step else _gdn_verify_kernel
    table = ({**GDN_POINTERS, "pool_ptr": "*fp32", "g_ptr": "*bf16"} if step else
             {**GDN_POINTERS, "pool_ptr": "*fp32", "cu_ptr": "*i64", "table_ptr": "*i64", "drafts_ptr": "*i32"})
    modes = (dict(GATES=True, STREAM=True, V_MAJOR=True) if step else dict(STATES_ONLY=False, ROUND=False))
    compares = {}
    for dims in ((96, 192), (128, 36), (128, 256), (64, 64)):
        block_k, block_v = triton_step.head_tiles(*dims, triton_step._BLOCK_V if step else triton_verify._BLOCK_V)
        constants = dict(RATIO=1, DK=dims[0], DV=dims[1], BLOCK_K=block_k, BLOCK_V=block_v, L2NORM=True, **modes)
        ptx = compile_for_hopper(launch, pointers(launch, table), integers(launch), constants,
                                 floats=("scale",)).asm["ptx"]
        compares[dims] = {int(n) for n in _IMMEDIATE_COMPARE.findall(ptx)} & {*dims, *(d - 1 for d in dims)}
    assert compares == {(96, 192): {96}, (128, 36): {36}, (128, 256): set(), (64, 64): set()}


@pytest.mark.parametrize("states_only", [False, True], ids=["full", "states_only"])
@pytest.mark.parametrize("pool", ["fp32", "bf16"])
def test_gated_delta_verify_compiles_for_hopper(states_only, pool):
    table = {**GDN_POINTERS, "pool_ptr": f"*{pool}", "cu_ptr": "*i64", "table_ptr": "*i64", "drafts_ptr": "*i32"}
    constants = dict(HEADS, DV=128, L2NORM=True, STATES_ONLY=states_only, ROUND=pool != "fp32")
    compiled = compile_for_hopper(_gdn_verify_kernel, pointers(_gdn_verify_kernel, table),
                                  integers(_gdn_verify_kernel), constants, floats=("scale",))
    if pool == "fp32":  # the only 16-bit stores are then the bf16 outputs, which states-only mode never writes
        assert ("st.global.b16" in compiled.asm["ptx"]) != states_only


@pytest.mark.parametrize(("has_bias", "silu"), [(False, True), (True, False)])
def test_conv_prefill_and_step_compile_for_hopper(has_bias, silu):
    varlen = compile_for_hopper(_conv_varlen_kernel, pointers(_conv_varlen_kernel, CONV_POINTERS),
                                integers(_conv_varlen_kernel), dict(CONV, K=4, HAS_BIAS=has_bias, SILU=silu,
                                                                    BLOCK_T=64))
    rows = compile_for_hopper(_conv_varlen_rows_kernel, pointers(_conv_varlen_rows_kernel, CONV_POINTERS),
                              integers(_conv_varlen_rows_kernel), dict(K=4, HAS_BIAS=has_bias, SILU=silu, BLOCK_T=64,
                                                                       BLOCK_C=1024))
    step = compile_for_hopper(_conv_step_kernel, pointers(_conv_step_kernel, CONV_POINTERS),
                              integers(_conv_step_kernel), dict(CONV, K=4, BLOCK_W=4, HAS_BIAS=has_bias, SILU=silu,
                                                                GATED=False))
    for compiled in (varlen, rows, step):  # the SiLU's sigmoid is the kernels' only exponential
        assert ("ex2" in compiled.asm["ptx"]) == silu


def test_gated_conv_step_compiles_for_hopper():
    """LFM2's decode conv (3 taps, no SiLU) with its gates in the launch: the gated variant reads the two gate rows
    the ungated one does not (more global loads), and neither has an exponential."""
    ptx = {gated: compile_for_hopper(_conv_step_kernel, pointers(_conv_step_kernel, CONV_POINTERS),
                                     integers(_conv_step_kernel), dict(CONV, K=3, BLOCK_W=2, HAS_BIAS=False,
                                                                       SILU=False, GATED=gated)).asm["ptx"]
           for gated in (False, True)}
    assert not any("ex2" in text for text in ptx.values())
    assert ptx[True].count("ld.global") > ptx[False].count("ld.global")


@pytest.mark.parametrize("kernel", [_conv_state_kernel, _conv_draft_states_kernel], ids=["state", "draft_states"])
def test_conv_state_kernels_compile_for_hopper(kernel):
    compiled = compile_for_hopper(kernel, pointers(kernel, CONV_POINTERS), integers(kernel),
                                  dict(CONV, W=3, BLOCK_W=4))
    ptx = compiled.asm["ptx"]
    assert "st.global.b16" in ptx  # the bf16 state entries are written
    assert "mul.f32" not in ptx and "fma" not in ptx  # and are copies of inputs: no arithmetic on them


EXPERT_POINTERS = {"a_ptr": "*bf16", "order_ptr": "*i64", "w_ptr": "*bf16", "out_ptr": "*bf16", "counts_ptr": "*i32"}


@pytest.mark.parametrize("block_m", [16, 32, 64])  # the tiles `moe.grouped.tile_rows` picks
@pytest.mark.parametrize("gate_up, relu2", [(True, False), (False, False), (True, True)],
                         ids=["gate_up", "down", "up_relu2"])
def test_expert_gemm_compiles_for_hopper(block_m, gate_up, relu2):
    constants = dict(GATHER=gate_up, SCATTER=not gate_up, SWIGLU=gate_up and not relu2, BLOCK_M=block_m, BLOCK_N=64,
                     BLOCK_K=128, BLOCK_E=64, PRECISION="tf32", SWAP_AB=False, RELU2=relu2)
    compiled = compile_for_hopper(_expert_gemm_kernel, EXPERT_POINTERS, integers(_expert_gemm_kernel), constants)
    assert "mma" in compiled.asm["ptx"]  # bf16 tiles on the tensor cores (wgmma, or mma.sync for few rows)


@pytest.mark.parametrize("gate_up", [True, False], ids=["gate_up", "down"])
def test_expert_gemm_swap_ab_compiles_to_wgmma_for_hopper(gate_up):
    """swap-AB: the weight tile as the MMA's A side puts its 64 rows there, so Hopper's wgmma runs at 32 token rows
    (the plain tile compiles to mma.sync there)."""
    ptx = {}
    for swap in (False, True):
        constants = dict(GATHER=gate_up, SCATTER=not gate_up, SWIGLU=gate_up, BLOCK_M=32, BLOCK_N=64, BLOCK_K=64,
                         BLOCK_E=16, PRECISION="tf32", SWAP_AB=swap, RELU2=False)
        ptx[swap] = compile_for_hopper(_expert_gemm_kernel, EXPERT_POINTERS, integers(_expert_gemm_kernel),
                                       constants).asm["ptx"]
    assert "wgmma" in ptx[True] and "wgmma" not in ptx[False]


# the two launches of `triton_route.launch_rows`
@pytest.mark.parametrize("block_t, warps", [(1, 1), (16, 4)], ids=["row-a-warp", "16-rows"])
def test_routing_compiles_for_hopper(block_t, warps):
    """The MoE routing in both launches: softmax on bf16 logits (Qwen3-Next-80B's 512 experts top-10), and softmax
    and sigmoid with a correction bias on fp32 logits (Nemotron 3 Nano's 128 top-6): of those two, only the
    sigmoid variant reads the bias."""

    def ptx(sigmoid: bool, experts: int, top_k: int, dtype: str) -> str:
        table = {"logits_ptr": dtype, "weights_ptr": dtype, "ids_ptr": "*i64", "bias_ptr": "*fp32"}
        constants = dict(TOP_K=top_k, RENORMALIZE=True, BLOCK_T=block_t, BLOCK_E=experts, BLOCK_K=16, SIGMOID=sigmoid)
        return compile_for_hopper(_route_kernel, table, ["num_rows", "num_experts", "stride_l"], constants,
                                  num_warps=warps, floats=("eps", "scale")).asm["ptx"]

    assert "st.global" in ptx(False, 512, 10, "*bf16")
    loads = {sigmoid: len(re.findall(r"ld\.global", ptx(sigmoid, 128, 6, "*fp32"))) for sigmoid in (False, True)}
    assert loads[True] > loads[False], loads  # the bias's loads


ATTENTION_POINTERS = {"kv_ptr": "*bf16", "acc_ptr": "*fp32", "ml_ptr": "*fp32", "bt_ptr": "*i32", "ctx_ptr": "*i32",
                      "cu_ptr": "*i32", "chunk_ptr": "*i32"}


@pytest.mark.parametrize("kernel", ["prefill", "prefill_split", "decode_split", "decode_merge"])
def test_attention_lane_masks_only_where_a_tile_passes_the_head_dim(kernel):
    """The paged-attention kernels take any head dim D: tiles D_PAD = D rounded up to a power of two wide, the lanes
    past D masked (`triton_paged._head_lanes`). D 80 compiles with its lanes compared to 80; D 128 with no compare
    against it: the mask folds to a constant and vanishes (the PTX of the engine's launches at D 64, 128 and 256,
    bf16 and fp32, was the same, debug lines aside, as before the kernels took other dims: session 65). Small tiles
    keep the compiles short; the masks do not depend on them."""
    from hybridcache.kernels.attention import triton_paged

    launch = getattr(triton_paged, f"_{kernel}_kernel")
    geometry = (dict(GROUP=4, BLOCK_G=16, PAGE=16, BLOCK_N=16, PRECISION="tf32") if kernel == "decode_split" else
                dict(BLOCK_S=16) if kernel == "decode_merge" else
                dict(GROUP=4, PAGE=16, BLOCK_M=16, BLOCK_N=16, PRECISION="tf32"))
    scales = tuple(p.name for p in launch.params if p.name in ("qk_scale", "v_scale"))
    ints = [name for name in integers(launch) if name not in scales]
    compares = {}
    for dim in (80, 128):
        ptx = compile_for_hopper(launch, pointers(launch, {**GDN_POINTERS, **ATTENTION_POINTERS}), ints,
                                 dict(geometry, D=dim, D_PAD=128), floats=scales).asm["ptx"]
        compares[dim] = {int(n) for n in _IMMEDIATE_COMPARE.findall(ptx)} & {dim, dim - 1}
    assert compares == {80: {80}, 128: set()}
