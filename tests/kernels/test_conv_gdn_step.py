"""The gated DeltaNet decode core in one launch (`gated_delta/triton_conv_step.py`: the conv's step, the gates and
the gated delta rule) against the torch references (`conv/reference.causal_conv1d_step`, `gated_delta/reference`'s
`delta_gates` and `gated_delta_rule_step`) and against the two launches it replaces (`conv.triton
.causal_conv1d_decode`, then `triton_step.gated_delta_rule_decode` with its gates).

Layouts as the layer passes them: mixed_qkv a strided column slice of one wider projection (q | k | v | z | b | a),
a and b strided slices of it, Hv = 2 or 4 Hk; some sequences fresh (context_len 1: both states read as zeros),
slots scattered over a larger pool whose other rows must stay untouched; conv with and without bias; the SSM pool
fp32 (the default) or bf16. `test_cuda_*` on a CUDA device; `test_interpreted_*` the same checks on the CPU under
TRITON_INTERPRET=1 in a child process. Tolerances: against the two launches fp32 1e-5 relative (the key head's
l2 norm may sum in another order), the conv states exactly (copies); against the references as
max |diff| / max |ref| within 1e-5 in fp32, 2^-6 in bf16 (the conv output, rounded once to the model dtype,
may sit one bf16 step from the reference's, and q, k, v move with it; the interpreter truncates where CUDA rounds).
"""

from __future__ import annotations

import pytest
import torch

from hybridcache.kernels.conv import reference as conv_ref
from hybridcache.kernels.gated_delta import reference as delta_ref
from tests.kernels.cuda_checks import error_stats
from tests.kernels.interpreter import INTERPRETED, needs_cuda, needs_interpreter, run_interpreted

# (key heads, value heads, Dk, Dv, kernel size, conv bias, model dtype, SSM pool dtype)
CASES = pytest.mark.parametrize(
    ("hk", "hv", "dk", "dv", "taps", "bias", "dtype", "pool_dtype"),
    [(2, 4, 32, 64, 4, False, torch.bfloat16, torch.float32), (1, 4, 16, 32, 4, True, torch.float32, torch.float32),
     (2, 4, 32, 32, 3, True, torch.bfloat16, torch.bfloat16)],
    ids=["bf16_ratio2", "fp32_ratio4_bias", "bf16_pool_bf16_k3"])
CONTEXT_LENS = [1, 5, 1, 9, 30, 2, 7]


def inputs(hk: int, hv: int, dk: int, dv: int, taps: int, bias: bool, dtype: torch.dtype,
           pool_dtype: torch.dtype, device: str) -> dict:
    """Random inputs of one step of 7 sequences (2 fresh): mixed_qkv, a, b as strided views of one projection."""
    gen = torch.Generator().manual_seed(5)
    num, channels = len(CONTEXT_LENS), 2 * hk * dk + hv * dv
    projected = torch.randn(num, channels + hv * dv + 2 * hv, generator=gen)
    projected[:, -2 * hv:] = torch.linspace(-30, 30, num * 2 * hv)[torch.randperm(num * 2 * hv, generator=gen)].view(
        num, 2 * hv)  # a + dt_bias spans softplus's three regimes
    projected = projected.to(device, dtype)
    b, a = projected[:, channels + hv * dv:].split([hv, hv], dim=-1)
    slots = torch.randperm(2 * num + 1, generator=gen)[:num].to(device)
    weight = (0.5 * torch.randn(channels, taps, generator=gen)).to(device, dtype)
    gates = tuple(torch.randn(hv, generator=gen).to(device, dtype) for _ in range(2))
    return dict(
        mixed_qkv=projected[:, :channels], conv_weight=weight,
        conv_bias=(0.1 * torch.randn(channels, generator=gen)).to(device, dtype) if bias else None,
        conv_pool=torch.randn(2 * num + 1, channels, taps - 1, generator=gen).to(device, dtype),
        a=a, b=b, gates=gates,
        ssm_pool=(0.1 * torch.randn(2 * num + 1, hv, dk, dv, generator=gen)).to(device, pool_dtype),
        state_slots=slots, context_lens=torch.tensor(CONTEXT_LENS, dtype=torch.int32, device=device), num_k_heads=hk)


def two_launches(args: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The path before the fusion: the conv step kernel, then the step kernel making the gates. Returns (out, conv
    pool, SSM pool) after it, on copies of the pools."""
    from hybridcache.kernels.conv.triton import causal_conv1d_decode
    from hybridcache.kernels.gated_delta.triton_step import gated_delta_rule_decode

    conv_pool, ssm_pool = args["conv_pool"].clone(), args["ssm_pool"].clone()
    conv_out = causal_conv1d_decode(args["mixed_qkv"], args["conv_weight"], args["conv_bias"], conv_pool,
                                    args["state_slots"], args["context_lens"])
    q, k, v = delta_ref.split_qkv(conv_out, args["num_k_heads"], ssm_pool.shape[2], ssm_pool.shape[3])
    out = gated_delta_rule_decode(q, k, v, args["a"], args["b"], ssm_pool, args["state_slots"], args["context_lens"],
                                  gates=args["gates"])
    return out, conv_pool, ssm_pool


def references(args: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The torch references in fp32 (the conv output rounded to the model dtype, as the kernels round it): (out,
    new conv states, new SSM states) of the step's sequences."""
    slots, fresh = args["state_slots"], args["context_lens"] == 1
    x, dtype = args["mixed_qkv"], args["mixed_qkv"].dtype
    conv_init = args["conv_pool"][slots].masked_fill(fresh[:, None, None], 0)
    bias = args["conv_bias"].float() if args["conv_bias"] is not None else None
    conv_out, conv_state = conv_ref.causal_conv1d_step(x.float(), args["conv_weight"].float(), bias, conv_init.float())
    ssm_pool = args["ssm_pool"]
    q, k, v = delta_ref.split_qkv(conv_out.to(dtype).float(), args["num_k_heads"], ssm_pool.shape[2],
                                  ssm_pool.shape[3])
    g, beta = delta_ref.delta_gates(args["a"].float(), args["b"], *args["gates"])
    ssm_init = ssm_pool[slots].float().masked_fill(fresh[:, None, None, None], 0)
    out, state = delta_ref.gated_delta_rule_step(q, k, v, g, beta.float(), ssm_init)
    return out, conv_state, state


def check_fused_step(hk: int, hv: int, dk: int, dv: int, taps: int, bias: bool, dtype: torch.dtype,
                     pool_dtype: torch.dtype, device: str) -> None:
    from hybridcache.kernels.gated_delta.triton_conv_step import conv_gated_delta_decode

    args = inputs(hk, hv, dk, dv, taps, bias, dtype, pool_dtype, device)
    want_out, want_conv, want_ssm = two_launches(args)
    conv_before, ssm_before = args["conv_pool"], args["ssm_pool"]
    conv_pool, ssm_pool = conv_before.clone(), ssm_before.clone()
    out = conv_gated_delta_decode(**dict(args, conv_pool=conv_pool, ssm_pool=ssm_pool))
    assert out.shape == (len(CONTEXT_LENS), hv, dv) and out.dtype == dtype
    assert torch.equal(conv_pool, want_conv)  # the conv states are copies of inputs: exact, other slots untouched
    rtol = 1e-5 if pool_dtype == torch.float32 else 2.0**-7  # a bf16 state may round the other way
    torch.testing.assert_close(ssm_pool.float(), want_ssm.float(), rtol=rtol, atol=1e-6)
    torch.testing.assert_close(out.float(), want_out.float(), rtol=2.0**-7 if dtype == torch.bfloat16 else 1e-5,
                               atol=1e-5)
    keep = torch.ones(ssm_pool.shape[0], dtype=torch.bool, device=device)
    keep[args["state_slots"]] = False
    assert torch.equal(ssm_pool[keep], ssm_before[keep]) and torch.equal(conv_pool[keep], conv_before[keep])

    ref_out, ref_conv, ref_ssm = references(args)
    slots = args["state_slots"]
    assert torch.equal(conv_pool[slots].float(), ref_conv)
    tol = 1e-5 if dtype == torch.float32 else 2.0**-6  # bf16: a conv output one step away moves q, k, v
    assert error_stats(ssm_pool[slots], ref_ssm).max_rel <= max(tol, 2.0**-7 if pool_dtype != torch.float32 else 0)
    assert error_stats(out, ref_out).max_rel <= max(tol, 2.0**-7 if dtype != torch.float32 else 0)


def check_step_alone(device: str) -> None:
    """fuse_conv=False (the launch sweep's step-only variant): mixed_qkv is the conv output; the conv pool untouched,
    outputs and SSM states those of the step kernel."""
    from hybridcache.kernels.conv.triton import causal_conv1d_decode
    from hybridcache.kernels.gated_delta.triton_conv_step import conv_gated_delta_decode

    args = inputs(2, 4, 32, 64, 4, False, torch.bfloat16, torch.float32, device)
    want_out, _, want_ssm = two_launches(args)
    conv_out = causal_conv1d_decode(args["mixed_qkv"], args["conv_weight"], None, args["conv_pool"].clone(),
                                    args["state_slots"], args["context_lens"])
    conv_pool, ssm_pool = args["conv_pool"].clone(), args["ssm_pool"].clone()
    out = conv_gated_delta_decode(**dict(args, mixed_qkv=conv_out, conv_pool=conv_pool, ssm_pool=ssm_pool),
                                  fuse_conv=False)
    assert torch.equal(conv_pool, args["conv_pool"])
    torch.testing.assert_close(ssm_pool, want_ssm, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.float(), want_out.float(), rtol=2.0**-7, atol=1e-5)


# (BLOCK_V, PREFETCH, UNROLL, HOIST, HEADS_FIRST): the kernel's code paths (the engine's launch is one of them; the
# launch sweep times the others)
LAUNCH_VARIANTS = ((16, True, False, False, False), (32, False, True, False, True), (16, False, False, True, False),
                   (32, True, True, True, True))


def check_launch_variants(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every code path of the kernel (tiles prefetched in registers or not, a loop or unrolled, v and the gates
    loaded per tile or all in the prologue, either grid order) gives the two launches' results."""
    from hybridcache.kernels.gated_delta import triton_conv_step

    args = inputs(2, 4, 32, 64, 4, True, torch.bfloat16, torch.float32, device)
    want_out, want_conv, want_ssm = two_launches(args)
    for block_v, prefetch, unroll, hoist, heads_first in LAUNCH_VARIANTS:
        for name, value in (("_BLOCK_V", block_v), ("_PREFETCH", prefetch), ("_UNROLL", unroll), ("_HOIST", hoist),
                            ("_HEADS_FIRST", heads_first)):
            monkeypatch.setattr(triton_conv_step, name, value)
        conv_pool, ssm_pool = args["conv_pool"].clone(), args["ssm_pool"].clone()
        out = triton_conv_step.conv_gated_delta_decode(**dict(args, conv_pool=conv_pool, ssm_pool=ssm_pool))
        assert torch.equal(conv_pool, want_conv)
        torch.testing.assert_close(ssm_pool, want_ssm, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(out.float(), want_out.float(), rtol=2.0**-7, atol=1e-5)


def test_wrong_shapes_are_refused() -> None:
    from hybridcache.kernels.gated_delta.triton_conv_step import conv_gated_delta_decode

    args = inputs(2, 4, 32, 64, 4, False, torch.float32, torch.float32, "cpu")
    with pytest.raises(ValueError, match="channels"):
        conv_gated_delta_decode(**dict(args, num_k_heads=3))
    with pytest.raises(ValueError, match="powers of two"):
        conv_gated_delta_decode(**dict(args, ssm_pool=torch.zeros(15, 4, 24, 64)))
    with pytest.raises(ValueError, match="conv_pool width"):
        conv_gated_delta_decode(**dict(args, conv_pool=args["conv_pool"][..., :2]))


@needs_cuda
@CASES
def test_cuda_fused_decode_core(hk, hv, dk, dv, taps, bias, dtype, pool_dtype) -> None:
    check_fused_step(hk, hv, dk, dv, taps, bias, dtype, pool_dtype, "cuda")


@needs_cuda
def test_cuda_decode_core_step_alone() -> None:
    check_step_alone("cuda")


@needs_cuda
def test_cuda_decode_core_launch_variants(monkeypatch: pytest.MonkeyPatch) -> None:
    check_launch_variants("cuda", monkeypatch)


@pytest.mark.skipif(INTERPRETED, reason="the parent of the interpreted tests (never spawns itself)")
def test_conv_gdn_step_in_a_triton_interpreter_subprocess() -> None:
    pytest.importorskip("triton")
    run_interpreted(__file__, "test_interpreted_ and not subprocess")


@needs_interpreter
@CASES
def test_interpreted_fused_decode_core(hk, hv, dk, dv, taps, bias, dtype, pool_dtype) -> None:
    check_fused_step(hk, hv, dk, dv, taps, bias, dtype, pool_dtype, "cpu")


@needs_interpreter
def test_interpreted_decode_core_step_alone() -> None:
    check_step_alone("cpu")


@needs_interpreter
def test_interpreted_decode_core_launch_variants(monkeypatch: pytest.MonkeyPatch) -> None:
    check_launch_variants("cpu", monkeypatch)
