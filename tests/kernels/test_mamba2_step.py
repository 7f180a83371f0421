"""Mamba2's one-launch decode step (`kernels/mamba2/triton_step.ssd_step_update`) against `reference.discretized_dt`
and `reference.ssd_step` on the gathered rows: dt from in_proj's raw output (softplus past its threshold and far below
0; clamped to a limit or not), y, the state rows it rewrites in place (fp32 and bf16 pools), the other rows untouched,
fresh sequences (context_len 1) started from zeros whatever their row holds (NaN here), x / B / C / dt read as the
strided column views of one projection row the layer passes, a head dim that is not a multiple of the kernel's row
block, groups shared by several heads, and `out` a slice of a wider buffer (a mixed step's leading decode rows).

`test_interpreted_*`: under TRITON_INTERPRET=1 in a child process (`tests/kernels/interpreter.py`), fp32 and bf16
pools (bf16 stores: the interpreter truncates where the GPU rounds, so bf16 rows are compared within two bf16 steps).
`test_cuda_*`: on the GPU at the served models' widths. Tolerances: y 1e-5 relative to its terms' magnitude
(sum_n |S C| + |D x|: another summation order for S C, whose terms may cancel), the fp32 state 1e-5 relative (softplus
to a few ulps), bf16 pools one bf16 step of the rewritten rows.
"""

from __future__ import annotations

import pytest
import torch

from hybridcache.kernels.mamba2 import reference as mamba2_ref
from tests.kernels.interpreter import interpreted_in_child, needs_cuda, needs_interpreter

pytest.importorskip("triton")

POOLS = pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16], ids=["fp32-pool", "bf16-pool"])


def check_step(device: str, heads: int, head_dim: int, groups: int, state: int, pool_dtype: torch.dtype,
               dt_limit: tuple[float, float] = (0.0, float("inf")), contexts: tuple[int, ...] = (40, 1, 7, 300, 2),
               seed: int = 0) -> None:
    from hybridcache.kernels.mamba2.triton_step import ssd_step_update

    gen = torch.Generator().manual_seed(seed)
    num = len(contexts)
    slots = torch.randperm(2 * num + 1, generator=gen)[:num]
    width = heads * head_dim + 2 * groups * state + heads  # one projection row: x | B | C | dt
    row = torch.randn(num, width, generator=gen)
    x = row[:, : heads * head_dim].view(num, heads, head_dim)
    B = row[:, heads * head_dim : heads * head_dim + groups * state].view(num, groups, state)  # noqa: N806
    C = row[:, heads * head_dim + groups * state : -heads].view(num, groups, state)  # noqa: N806
    dt = 4 * row[:, -heads:]  # raw: softplus's both branches and its far negative tail (dt_bias shifts some past 20)
    dt_bias = torch.randn(heads, generator=gen)
    dt_bias[0] = 25.0
    A_log = torch.randn(heads, generator=gen)  # noqa: N806
    D = torch.randn(heads, generator=gen)  # noqa: N806
    pool = (0.5 * torch.randn(2 * num + 1, heads, head_dim, state, generator=gen)).to(pool_dtype)
    ctx = torch.tensor(contexts, dtype=torch.int32)
    pool[slots[ctx == 1]] = float("nan")  # a fresh sequence's row holds garbage it must not read
    before = pool.clone()
    start = before[slots].float().masked_fill((ctx == 1)[:, None, None, None], 0.0)
    steps = mamba2_ref.discretized_dt(dt, dt_bias, dt_limit)
    want_y, want_state = mamba2_ref.ssd_step(x, steps, -torch.exp(A_log), B, C, D, start)

    dev = torch.device(device)
    pool_d = pool.to(dev)
    wide = torch.full((num + 2, heads, head_dim), float("nan"), device=dev)
    row_d = row.to(dev)  # x, B, C and dt as the strided views of one row the layer passes
    x_d = row_d[:, : heads * head_dim].view(num, heads, head_dim)
    B_d = row_d[:, heads * head_dim : heads * head_dim + groups * state].view(num, groups, state)  # noqa: N806
    C_d = row_d[:, heads * head_dim + groups * state : -heads].view(num, groups, state)  # noqa: N806
    y = ssd_step_update(x_d, 4 * row_d[:, -heads:], dt_bias.to(dev), A_log.to(dev), B_d, C_d, D.to(dev), pool_d,
                        slots.to(dev), ctx.to(dev), dt_limit=dt_limit, out=wide[1 : num + 1])
    assert y.data_ptr() == wide[1].data_ptr()
    assert wide[0].isnan().all() and wide[-1].isnan().all()  # nothing written past `out`
    # y = S C + D x sums terms that may cancel: 1e-5 of the terms' magnitude (at Nemotron-H's widths an H100 run found
    # 57 of 51,200 outputs past 1e-5 of |y| itself, all at most 2.7e-7 of their terms: another summation order)
    group = torch.arange(heads) // (heads // groups)
    terms = (want_state.abs() * C[:, group].abs()[:, :, None, :]).sum(-1) + (D[None, :, None] * x).abs()
    err = (y.cpu() - want_y).abs()
    assert (err <= 1e-5 * terms + 1e-6).all(), f"y: {int((err > 1e-5 * terms + 1e-6).sum())} outputs off"
    got = pool_d.cpu()
    if pool_dtype == torch.float32:
        torch.testing.assert_close(got[slots], want_state, rtol=1e-5, atol=1e-5)
    else:  # one rounding to bf16 (two steps under the interpreter, which truncates)
        torch.testing.assert_close(got[slots].float(), want_state, rtol=2**-7, atol=1e-6)
    others = torch.ones(pool.shape[0], dtype=torch.bool)
    others[slots] = False
    assert torch.equal(got[others], before[others])


@interpreted_in_child("test_interpreted_ and not subprocess")
def test_mamba2_step_in_a_triton_interpreter_subprocess() -> None:
    """This file's interpreted tests, in a child process (tests/kernels/interpreter.py)."""


@needs_interpreter
@POOLS
@pytest.mark.parametrize(("heads", "head_dim", "groups", "state"), [(8, 24, 2, 32), (4, 16, 1, 20)],
                         ids=["H8-P24-G2-N32", "H4-P16-G1-N20"])
def test_interpreted_step_equals_the_reference(heads, head_dim, groups, state, pool_dtype) -> None:
    check_step("cpu", heads, head_dim, groups, state, pool_dtype)


@needs_interpreter
def test_interpreted_step_clamps_dt_to_its_limit() -> None:
    check_step("cpu", 8, 24, 2, 32, torch.float32, dt_limit=(0.01, 0.5))


@needs_interpreter
def test_interpreted_backend_decode_step_matches_the_reference(monkeypatch) -> None:
    """`CudaBackend.ssd_scan` of an all-decode step from the engine's batch (a fresh one-token prompt among the rows)
    through the step launch, raw dt and A_log in: `ReferenceBackend.ssd_scan`'s outputs and every slot, both without
    and with a dt limit."""
    from hybridcache.kernels.attention.reference_backend import ReferenceAttention
    from hybridcache.kernels.cuda_backend import CudaBackend
    from hybridcache.kernels.mamba2 import fla as mamba2_fla
    from tests.kernels.test_mamba2_cuda import DECODE, compare_scans

    monkeypatch.setattr(mamba2_fla, "runs_on", lambda x: True)
    compare_scans(CudaBackend(ReferenceAttention()), "cpu", torch.float32, DECODE, {"rtol": 1e-5, "atol": 1e-5})


@needs_cuda
@POOLS
@pytest.mark.parametrize(("heads", "head_dim", "groups", "state"), [(128, 80, 8, 128), (48, 64, 1, 128)],
                         ids=["nemotron-h-9b", "granite-4h-tiny"])
def test_cuda_step_equals_the_reference(heads, head_dim, groups, state, pool_dtype) -> None:
    check_step("cuda", heads, head_dim, groups, state, pool_dtype)
    check_step("cuda", heads, head_dim, groups, state, pool_dtype, dt_limit=(0.01, 0.5))


def test_step_compiles_for_hopper() -> None:
    """The launch the engine makes for a bf16 model (fp32 pool; bf16 x / B / C) compiles for sm90, its state tile
    read and written once (one load and one store per element row: no second pass over the pool)."""
    from hybridcache.kernels.mamba2.triton_step import _ssd_step_kernel
    from tests.kernels.hopper import compile_for_hopper

    pointers = {p.name: "*bf16" for p in _ssd_step_kernel.params if p.name.endswith("_ptr")}
    pointers.update(pool_ptr="*fp32", out_ptr="*fp32", slots_ptr="*i64", ctx_ptr="*i32")
    floats = ("dt_low", "dt_high")
    ints = [p.name for p in _ssd_step_kernel.params
            if not p.name.endswith("_ptr") and not p.is_constexpr and p.name not in floats]
    ptx = compile_for_hopper(_ssd_step_kernel, pointers, ints,
                             dict(HEADS_PER_GROUP=16, CLAMP=False, BLOCK_P=16, BLOCK_N=128), floats=floats).asm["ptx"]
    assert "ex2" in ptx  # the decay's exponential
    assert ptx.count("st.global") >= 1


def test_step_refuses_a_pool_of_another_shape() -> None:
    from hybridcache.kernels.mamba2.triton_step import ssd_step_update

    x = torch.zeros(2, 4, 16)
    with pytest.raises(ValueError, match="ssd_step_update"):
        ssd_step_update(x, torch.zeros(2, 4), torch.zeros(4), torch.zeros(4), torch.zeros(2, 1, 8),
                        torch.zeros(2, 1, 8), torch.zeros(4), torch.zeros(5, 4, 16, 16), torch.arange(2),
                        torch.ones(2, dtype=torch.int32), dt_limit=(0.0, float("inf")))
