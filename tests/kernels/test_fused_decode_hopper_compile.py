"""The fused small kernels of a decode step (test_fused_decode_kernels.py checks their numbers) compile for the H200
(sm90) without a GPU (`tests/kernels/hopper.py`), in the variants a bf16 Qwen3-Next model launches: the residual
add + RMSNorm over the hidden size (and the other families' weightings of it), the attention layer's q/k norm +
RoPE (16 query and 2 key heads of 256, rotary dim 64) and its output gate."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from hybridcache.kernels.activation.triton import _sigmoid_mul_kernel  # noqa: E402
from hybridcache.kernels.norm.triton import _add_rms_norm_kernel, _gated_group_norm_kernel  # noqa: E402
from hybridcache.kernels.rotary.triton import _norm_rotary_kernel  # noqa: E402
from tests.kernels.hopper import compile_for_hopper  # noqa: E402


def typed(kernel, pointer: str, floats: tuple[str, ...] = ()) -> tuple[dict[str, str], list[str]]:
    """Every pointer of the kernel as `pointer`, every other non-constexpr, non-float parameter i32."""
    pointers = {p.name: pointer for p in kernel.params if p.name.endswith("_ptr")}
    ints = [p.name for p in kernel.params
            if not p.name.endswith("_ptr") and not p.is_constexpr and p.name not in floats]
    return pointers, ints


@pytest.mark.parametrize(("weighting", "scaled"), [(0, False), (1, False), (2, False), (1, True)],
                         ids=["zero-centred", "rounded", "fp32", "rounded-scaled"])
def test_add_rms_norm_compiles_for_hopper(weighting, scaled):
    """Each `Weighting` (Qwen's zero-centred norm; the other families' weight times the rounded norm, or in fp32), and
    Granite's residual multiplier (SCALED: one more multiply a residual element, rounded to bf16 before the add)."""
    pointers, ints = typed(_add_rms_norm_kernel, "*bf16", floats=("eps", "scale"))
    compiled = compile_for_hopper(_add_rms_norm_kernel, pointers, ints,
                                  dict(ROWS=1, BLOCK=2048, WEIGHTING=weighting, SCALED=scaled), floats=("eps", "scale"))
    ptx = compiled.asm["ptx"]
    assert ptx.count("st.global") >= 2  # the sum and the normed row are both written
    assert "sqrt" in ptx
    param = next(p for p in _add_rms_norm_kernel.params if p.name == "num_rows")
    assert param.do_not_specialize  # the step's row count: one variant for every batch


def test_scaled_add_rounds_the_scaled_residual_before_the_add():
    """SCALED (Granite's residual multiplier) adds a multiply and a rounding to bf16 per residual element (torch's
    `out * residual_multiplier` is a bf16 tensor before the add): more bf16 conversions than the plain add."""
    pointers, ints = typed(_add_rms_norm_kernel, "*bf16", floats=("eps", "scale"))
    ptx = {scaled: compile_for_hopper(_add_rms_norm_kernel, pointers, ints,
                                      dict(ROWS=1, BLOCK=2048, WEIGHTING=1, SCALED=scaled),
                                      floats=("eps", "scale")).asm["ptx"] for scaled in (False, True)}
    assert ptx[True].count("cvt.rn.bf16") > ptx[False].count("cvt.rn.bf16")


@pytest.mark.parametrize("norm_before_gate", [False, True], ids=["gate-first", "norm-first"])
def test_gated_group_norm_compiles_for_hopper(norm_before_gate):
    """Mamba2's gated group norm as a bf16 model launches it (the scan's fp32 output, a bf16 gate and weight), one
    3,072-channel group a program (Granite-4.0-H-Tiny's): the gate's sigmoid and the norm's square root."""
    pointers, ints = typed(_gated_group_norm_kernel, "*bf16", floats=("eps",))
    pointers["x_ptr"] = "*fp32"
    ptx = compile_for_hopper(_gated_group_norm_kernel, pointers, ints,
                             dict(NORM_BEFORE_GATE=norm_before_gate, ROWS=1, BLOCK=4096), num_warps=16,
                             floats=("eps",)).asm["ptx"]
    assert "ex2" in ptx and "sqrt" in ptx


def test_norm_rotary_compiles_for_hopper():
    pointers, ints = typed(_norm_rotary_kernel, "*bf16", floats=("eps",))
    compiled = compile_for_hopper(_norm_rotary_kernel, pointers, ints,
                                  dict(HALF=32, DIM=256, BLOCK_HQ=16, BLOCK_HK=2, BLOCK_D=256), floats=("eps",))
    assert compiled.asm["ptx"].count("sqrt") >= 2  # one norm for the query heads, one for the key heads


def test_sigmoid_mul_compiles_for_hopper():
    pointers, ints = typed(_sigmoid_mul_kernel, "*bf16")
    compiled = compile_for_hopper(_sigmoid_mul_kernel, pointers, ints, dict(BLOCK_H=16, BLOCK_D=256))
    assert "ex2" in compiled.asm["ptx"]  # the sigmoid's exponential
