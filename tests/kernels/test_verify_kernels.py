"""The speculative-decoding verify kernels (`gated_delta/triton_verify.py`, `conv/triton_verify.py`) against the
torch references (`gated_delta_rule_verify`, `conv_states_after`) via `tests/kernels/cuda_checks.check_verify`:
decode and verify rows (0-3 drafts) after 150+ tokens of real recurrent history, a fresh row, and in states-only
mode a prefill chunk beside them.

- `test_cuda_*` run on a CUDA device (skipped without one), model dtypes bf16 and fp32, state fp32 and bf16.
- `test_interpreted_*` run on the CPU under TRITON_INTERPRET=1, in the child process that
  `test_verify_interpreter_in_subprocess` starts (this process never imports triton); fp32 only (the interpreter's
  bf16 arithmetic is wrong).

Tolerances (see tests/kernels/test_cuda_kernels.py): fp32 arithmetic in another order 1e-5; bf16 outputs rounded
once 1e-2 / 2e-2 (norm_rel / max_rel); states kept in bf16 are rounded after each position like the reference's,
so they agree to one bf16 step (2^-8) where the two fp32 orders round apart; conv states are copies: exact; every
other pool row: exact (untouched).
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.interpreter import interpreted_in_child, needs_cuda, needs_interpreter
from tests.kernels.test_cuda_kernels import EXACT, OURS, _interpreter_runs_our_kernels, assert_within

MODES = pytest.mark.parametrize("states_only", [False, True], ids=["full", "states_only"])
BF16_STATE = (8e-3, 8e-3)


def _bounds(dtype: torch.dtype, state_dtype: torch.dtype, states_only: bool) -> dict:
    """A bf16 state is rounded after every position: where the kernel's fp32 sum and the reference's lie either
    side of a rounding boundary they keep states one bf16 step apart, and the outputs read through them differ by
    as much (so fp32 outputs get the bf16 state's bound too)."""
    state = OURS[torch.float32] if state_dtype == torch.float32 else BF16_STATE
    bounds = {"draft_states": state, "conv_draft_states": EXACT, "other_rows": EXACT, "conv_other_rows": EXACT}
    if not states_only:
        bounds["out"] = OURS[dtype] if state_dtype == torch.float32 else max(OURS[dtype], BF16_STATE)
    return bounds


@needs_cuda
@MODES
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["state_fp32", "state_bf16"])
def test_cuda_verify(dtype: torch.dtype, state_dtype: torch.dtype, states_only: bool) -> None:
    from tests.kernels.cuda_checks import check_verify

    stats = check_verify(dtype, torch.device("cuda"), states_only=states_only, state_dtype=state_dtype,
                         heads=(16, 32), dims=(128, 128), channels=8192)
    assert_within(stats, _bounds(dtype, state_dtype, states_only))


@pytest.mark.skipif(not _interpreter_runs_our_kernels(), reason="this Triton's interpreter cannot run our kernels")
@interpreted_in_child("interpreted")
def test_verify_interpreter_in_subprocess() -> None:
    """This file's interpreted tests, in a child process (tests/kernels/interpreter.py)."""


@needs_interpreter
@MODES
def test_interpreted_verify(states_only: bool) -> None:
    from tests.kernels.cuda_checks import check_verify

    stats = check_verify(torch.float32, torch.device("cpu"), states_only=states_only)
    assert_within(stats, _bounds(torch.float32, torch.float32, states_only))


@needs_interpreter
def test_interpreted_verify_bf16_state() -> None:
    """A bf16 state pool, rounded after every position. The interpreter emulates bf16 by truncation (twice the
    hardware's rounding step, and biased), so the states and the outputs read through them get 2.5x the GPU bounds."""
    from tests.kernels.cuda_checks import check_verify

    stats = check_verify(torch.float32, torch.device("cpu"), states_only=False, state_dtype=torch.bfloat16)
    bounds = _bounds(torch.float32, torch.bfloat16, False)
    assert_within(stats, {**bounds, "draft_states": (2e-2, 2e-2), "out": (2e-2, 2e-2)})


@needs_interpreter
def test_interpreted_verify_refuses_bad_shapes() -> None:
    from hybridcache.kernels.gated_delta.triton_verify import gated_delta_rule_verify

    q = torch.zeros(3, 1, 16)
    g = torch.zeros(3, 2)
    one = torch.zeros(1, dtype=torch.int64)
    v = torch.zeros(3, 2, 16)
    with pytest.raises(ValueError, match="ssm_pool"):  # the pool's head dims must be q's and v's
        gated_delta_rule_verify(q, q, v, g, g, torch.zeros(4, 2, 16, 24), one, torch.tensor([0, 3]), one,
                                torch.zeros(1, 1).long(), torch.zeros(1, dtype=torch.int32), states_only=False)
    from hybridcache.kernels.conv.triton_verify import conv_draft_states

    pool = torch.zeros(4, 2, 16, 16)
    int32_table = torch.zeros(1, 1, dtype=torch.int32)  # must be int64 (`varlen.check_verify_rows`)
    with pytest.raises(ValueError, match="int64"):
        gated_delta_rule_verify(q, q, v, g, g, pool, one, torch.tensor([0, 3]), one, int32_table,
                                torch.zeros(1, dtype=torch.int32), states_only=False)
    with pytest.raises(ValueError, match="int64"):
        conv_draft_states(torch.zeros(3, 8), torch.zeros(4, 8, 3), one, torch.tensor([0, 3]), one, int32_table,
                          torch.zeros(1, dtype=torch.int32))


def test_verify_rows_are_checked() -> None:
    """`varlen.check_verify_rows`, which both verify launchers call first: each misfit is named."""
    from hybridcache.kernels.varlen import check_verify_rows

    cu, ctx, drafts = torch.tensor([0, 3, 5]), torch.tensor([3, 9]), torch.tensor([2, 1], dtype=torch.int32)
    table = torch.zeros(2, 2, dtype=torch.int64)
    check_verify_rows(2, cu, ctx, table, drafts)
    with pytest.raises(ValueError, match="cu_seqlens"):
        check_verify_rows(2, cu[:2], ctx, table, drafts)
    with pytest.raises(ValueError, match="num_drafts"):
        check_verify_rows(2, cu, ctx, table, drafts[:1])
    with pytest.raises(ValueError, match="draft_table"):
        check_verify_rows(2, cu, ctx, table[:, :0], drafts)
    with pytest.raises(ValueError, match="int64"):
        check_verify_rows(2, cu, ctx, table.int(), drafts)
    with pytest.raises(ValueError, match="unit stride"):
        check_verify_rows(2, cu, ctx, table.t(), drafts)


def _reference_chunked(q, k, v, g, beta, ssm_pool, state_slots, cu_seqlens, context_lens, query_lens_cpu, **_):
    """Stands in for fla's chunked kernel (not runnable in the interpreter): the reference rule per sequence, from
    each slot's state (zeros when fresh), final states written back."""
    from hybridcache.kernels.gated_delta import reference as delta_ref

    out = torch.empty(v.shape, dtype=q.dtype)
    starts = cu_seqlens.tolist()
    for i, length in enumerate(query_lens_cpu):
        rows, slot = slice(starts[i], starts[i] + length), int(state_slots[i])
        fresh = int(context_lens[i]) == length
        out[rows], state = delta_ref.chunk_gated_delta_rule(q[rows], k[rows], v[rows], g[rows], beta[rows],
                                                            None if fresh else ssm_pool[slot])
        ssm_pool[slot] = state.to(ssm_pool.dtype)
    return out


@needs_interpreter
@pytest.mark.parametrize("with_prefill", [False, True], ids=["verify_only", "with_prefill"])
@pytest.mark.parametrize("uniform", [False, True], ids=["drafts_3_0_1", "drafts_2_2_2"])
def test_interpreted_cuda_backend_verify_step(with_prefill: bool, uniform: bool,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """`CudaBackend`'s conv and gated delta ops on a step with verify rows (its `VerifyRows`: from the host lists,
    or a view of the device draft slots when every row has the same drafts; the mode it picks; the draft states
    written before the slots are rewritten) against `ReferenceBackend` on the same batch: outputs, slots and draft
    rows."""
    from hybridcache.engine.input_builder import SeqChunk, build_forward_batch
    from hybridcache.kernels import cuda_backend
    from hybridcache.kernels.attention.triton_backend import TritonAttention
    from hybridcache.kernels.backend import ReferenceBackend
    from hybridcache.kernels.gated_delta import reference as delta_ref

    monkeypatch.setattr(cuda_backend, "chunk_gated_delta_rule_varlen", _reference_chunked)
    gen = torch.Generator().manual_seed(1)
    k_draft, num_slots, channels, width, heads, dims = 3, 6, 96, 3, (2, 4), (16, 32)
    chunks = [SeqChunk(token_ids=[1] * 4, start=160, block_ids=list(range(12)), slot=4),  # 3 drafts
              SeqChunk(token_ids=[1], start=170, block_ids=list(range(12)), slot=1),  # a decode row
              SeqChunk(token_ids=[1] * 2, start=151, block_ids=list(range(12)), slot=0)]  # 1 draft
    drafts = [tuple(num_slots + 4 * k_draft + j for j in range(3)), (), (num_slots + 0 * k_draft,)]
    if uniform:
        chunks = [SeqChunk(token_ids=[1] * 3, start=start, block_ids=list(range(12)), slot=slot)
                  for start, slot in ((160, 4), (170, 1), (151, 0))]
        drafts = [tuple(num_slots + slot * k_draft + j for j in range(2)) for slot in (4, 1, 0)]
    if with_prefill:  # (not uniform any more: the host table)
        chunks.append(SeqChunk(token_ids=[1] * 40, start=20, block_ids=list(range(12)), slot=2))
        drafts.append(())
    batch = build_forward_batch(chunks, block_size=16, kernel_block_size=16, draft_slots=drafts)
    total = batch.input_ids.shape[0]
    rows = num_slots + num_slots * k_draft
    x = torch.randn(total, channels, generator=gen)
    weight, bias = torch.randn(channels, width + 1, generator=gen), torch.randn(channels, generator=gen)
    q, k = torch.randn(total, heads[0], dims[0], generator=gen), torch.randn(total, heads[0], dims[0], generator=gen)
    v = torch.randn(total, heads[1], dims[1], generator=gen)
    g = -torch.nn.functional.softplus(torch.randn(total, heads[1], generator=gen))
    beta = torch.randn(total, heads[1], generator=gen).sigmoid()
    conv_pool = torch.randn(rows, channels, width, generator=gen)
    ssm_pool = torch.zeros(rows, heads[1], *dims)
    for slot in range(num_slots):  # real states: 150 tokens of history each
        hq, hk = torch.randn(150, heads[0], dims[0], generator=gen), torch.randn(150, heads[0], dims[0], generator=gen)
        hv = torch.randn(150, heads[1], dims[1], generator=gen)
        hg = -torch.nn.functional.softplus(torch.randn(150, heads[1], generator=gen))
        _, ssm_pool[slot] = delta_ref.chunk_gated_delta_rule(hq, hk, hv, hg, torch.full((150, heads[1]), 0.5))
    results = []
    for backend in (ReferenceBackend(), cuda_backend.CudaBackend(TritonAttention())):
        conv, ssm = conv_pool.clone(), ssm_pool.clone()
        prepared = backend.prepare(batch)
        conv_out = backend.causal_conv1d(x, weight, bias, conv, prepared)
        out = backend.gated_delta_rule(q, k, v, g, beta, ssm, prepared)
        results.append((prepared.metadata, conv_out, out, conv, ssm))
    (_, ref_conv_out, ref_out, ref_conv, ref_ssm), (meta, conv_out, out, conv, ssm) = results
    assert meta.verify is not None and meta.verify.short is not with_prefill
    assert meta.verify.num_drafts.tolist() == [len(d) for d in drafts]
    assert meta.verify.draft_table[:, 0].tolist() == [d[0] if d else 0 for d in drafts]
    torch.testing.assert_close(conv_out, ref_conv_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(conv, ref_conv, rtol=0, atol=0)
    torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ssm, ref_ssm, rtol=1e-4, atol=1e-5)
    assert not torch.equal(ssm[list(drafts[0])], ssm_pool[list(drafts[0])])  # the draft rows were written
