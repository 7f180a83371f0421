"""Programmatic dependent launch (`kernels/pdl.py`): every small kernel of a decode step compiles for the H200 (sm90)
with PDL=True, its wait ahead of every global memory access (`tests/kernels/hopper.py` checks the PTX; the kernels
compiled by the other Hopper tests are checked there), and off a Hopper GPU nothing launches with PDL."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from hybridcache.kernels import pdl  # noqa: E402
from hybridcache.kernels.activation import triton as activation  # noqa: E402
from hybridcache.kernels.attention import triton_paged  # noqa: E402
from hybridcache.kernels.gated_delta import triton_gates  # noqa: E402
from hybridcache.kernels.moe import triton_route, triton_sort  # noqa: E402
from hybridcache.kernels.norm import triton as norm  # noqa: E402
from hybridcache.kernels.rotary import triton as rotary  # noqa: E402
from hybridcache.kernels.sampling import triton_argmax  # noqa: E402
from tests.kernels.hopper import check_pdl_first, compile_for_hopper  # noqa: E402

# kernel, its pointers' types (default *bf16), its fp32 scalars, its constexprs (as a bf16 Qwen3-Next launches them)
KERNELS = {
    "rms_norm": (norm._rms_norm_kernel, {}, ("eps",), dict(ROWS=1, BLOCK=2048, WEIGHTING=0)),
    "gated_rms_norm": (norm._gated_rms_norm_kernel, {}, ("eps",), dict(ROWS=16, BLOCK=128)),
    "l2norm": (norm._l2norm_kernel, {}, ("eps",), dict(ROWS=16, BLOCK=128)),
    "silu_mul": (activation._silu_mul_kernel, {}, (), dict(BLOCK=512)),
    "sigmoid_gate_add": (activation._sigmoid_gate_add_kernel, {}, (), dict(BLOCK=1024)),
    "relu_square": (activation._relu_square_kernel, {}, (), dict(BLOCK=1024)),
    "rotary": (rotary._rotary_kernel, {"cos_ptr": "*fp32", "sin_ptr": "*fp32"}, (),
               dict(HALF=32, DIM=256, BLOCK_H=16, BLOCK_D=256)),
    "route": (triton_route._route_kernel, {"ids_ptr": "*i64"}, (),
              dict(TOP_K=8, RENORMALIZE=True, BLOCK_T=16, BLOCK_E=32, BLOCK_K=8)),
    "sort_pairs": (triton_sort._sort_pairs_kernel, {"ids_ptr": "*i64", "order_ptr": "*i64", "counts_ptr": "*i64"}, (),
                   dict(BLOCK_N=512, BLOCK_E=32, SHARED=False)),
    "write_kv": (triton_paged._write_kv_kernel, {"rows_ptr": "*i64"}, (), dict(D=256, HD=512, BLOCK=512)),
    "decode_split": (triton_paged._decode_split_kernel,
                     {"acc_ptr": "*fp32", "ml_ptr": "*fp32", "bt_ptr": "*i32", "ctx_ptr": "*i32"},
                     ("qk_scale", "v_scale"),
                     dict(GROUP=8, BLOCK_G=16, PAGE=64, D=256, D_PAD=256, BLOCK_N=64, PRECISION="ieee")),
    "decode_merge": (triton_paged._decode_merge_kernel, {"acc_ptr": "*fp32", "ml_ptr": "*fp32"}, (),
                     dict(D=256, D_PAD=256, BLOCK_S=16)),
    "argmax_partial": (triton_argmax._argmax_partial_kernel, {"value_ptr": "*fp32", "column_ptr": "*i32"}, (),
                       dict(SPLITS=8, BLOCK=4096)),
    "argmax_final": (triton_argmax._argmax_final_kernel,
                     {"value_ptr": "*fp32", "column_ptr": "*i32", "out_ptr": "*i64"}, (), dict(SPLITS=8)),
    "delta_gates": (triton_gates._delta_gates_kernel,
                    {"alog_ptr": "*fp32", "dt_ptr": "*fp32", "g_ptr": "*fp32", "beta_ptr": "*fp32"}, (),
                    dict(BLOCK_T=32, BLOCK_H=32)),
}


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_decode_kernels_compile_for_hopper_with_pdl(name):
    kernel, pointers, floats, constants = KERNELS[name]
    pointers = {p.name: pointers.get(p.name, "*bf16") for p in kernel.params if p.name.endswith("_ptr")}
    ints = [p.name for p in kernel.params
            if not p.name.endswith("_ptr") and not p.is_constexpr and p.name not in floats]
    compiled = compile_for_hopper(kernel, pointers, ints, constants, floats=floats)  # PDL=True, checked there
    assert "griddepcontrol.launch_dependents" in compiled.asm["ptx"]


def test_without_pdl_no_grid_dependency_is_compiled():
    kernel, pointers, floats, constants = KERNELS["silu_mul"]
    pointers = {p.name: "*bf16" for p in kernel.params if p.name.endswith("_ptr")}
    ints = [p.name for p in kernel.params if not p.name.endswith("_ptr") and not p.is_constexpr]
    ptx = compile_for_hopper(kernel, pointers, ints, {**constants, "PDL": False}).asm["ptx"]
    assert "griddepcontrol" not in ptx


def test_the_contract_check_catches_a_load_before_the_wait():
    with pytest.raises(AssertionError, match="before the PDL wait"):
        check_pdl_first("ld.global.b32 %r1, [%rd1];\ngriddepcontrol.wait;\n")
    with pytest.raises(AssertionError, match="without griddepcontrol.wait"):
        check_pdl_first("ld.param.u64 %rd1, [p];\nst.global.b32 [%rd1], %r1;\n")
    check_pdl_first("ld.param.u64 %rd1, [p];\ngriddepcontrol.wait;\nld.global.b32 %r1, [%rd1];\n")


def test_cpu_tensors_launch_without_pdl():
    assert pdl.options(torch.zeros(1)) == {"PDL": False}
    assert not pdl.enabled(torch.device("cpu"))
