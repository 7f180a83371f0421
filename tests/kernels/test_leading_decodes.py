"""`gated_delta/fla.leading_decodes`: fla's view of a mixed step whose first sequences are decode rows (the rows run
in the step kernel; fla takes them as one throwaway sequence from a zero state). Host arithmetic and small device
ops, checked on the CPU; the kernels' results on such steps are checked on CUDA (`check_gated_delta`'s mixed
lengths, `test_cuda_backend.py`'s leading-decodes case).

`mixed_gated_delta_rule`'s orchestration (which state rows fla reads and writes, the throwaway dropped, the step
kernel's rows written over fla's output) runs on the CPU too: the step kernel and `qkv_prep` under the Triton
interpreter, fla's forward replaced by the reference rule per sequence (fla does not run on the CPU), against the
reference per sequence of the step (in a child process, `test_mixed_rule_in_a_triton_interpreter_subprocess`)."""

from __future__ import annotations

import sys

import pytest
import torch

from hybridcache.kernels.gated_delta import reference as delta_ref
from hybridcache.kernels.gated_delta.fla import CHUNK_SIZE, leading_decodes
from hybridcache.kernels.varlen import chunk_indices
from tests.kernels.fake_fla import install_fake_fla
from tests.kernels.interpreter import interpreted_in_child, needs_interpreter


def _lead(query_lens: list[int], context_lens: list[int], slots: list[int]):
    cu = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    return leading_decodes(cu, torch.tensor(context_lens, dtype=torch.int32), torch.tensor(slots), query_lens)


def test_the_docstring_example():
    lead = _lead([1, 1, 1, 40, 7], [10, 1, 30, 40, 50], [5, 2, 9, 4, 8])
    assert lead.count == 3
    assert lead.query_lens_cpu == (3, 40, 7)
    assert lead.cu_seqlens.tolist() == [0, 3, 43, 50] and lead.cu_seqlens.dtype == torch.int64
    assert lead.slots.tolist() == [4, 4, 8]  # the throwaway reads a real row (then zeroed), never writes one
    assert lead.fresh.tolist() == [True, True, False]  # the throwaway, a fresh 40-token prompt, a continuing chunk
    assert torch.equal(lead.chunks, chunk_indices(lead.cu_seqlens, (3, 40, 7), CHUNK_SIZE))


def test_a_fresh_one_token_prompt_counts_as_a_decode_row():
    lead = _lead([1, 1, 100], [1, 9, 100], [0, 1, 2])  # the first: a 1-token prompt (the step kernel zeroes it)
    assert lead.count == 2 and lead.query_lens_cpu == (2, 100) and lead.fresh.tolist() == [True, True]


def test_no_lead_without_a_leading_run_of_decodes_before_a_chunk():
    assert _lead([1, 1, 1], [5, 6, 7], [0, 1, 2]) is None  # all decode: the step kernel alone
    assert _lead([40, 1, 1], [40, 6, 7], [0, 1, 2]) is None  # a chunk first: fla for every sequence
    assert _lead([64], [64], [3]) is None


def _reference_fla_forward(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, chunk_indices):
    """fla's `chunk_gated_delta_rule_fwd` contract ([1, T, ...] inputs, l2-normalised q and k; returns (_, out, _,
    final, _, _)) by `gated_delta/reference.chunk_gated_delta_rule` per sequence."""
    del scale, output_final_state, chunk_indices  # the reference scales q by Dk^-1/2 as fla is asked to
    out, finals = torch.empty_like(v[0]), []
    bounds = cu_seqlens.tolist()
    for i in range(len(bounds) - 1):
        rows = slice(bounds[i], bounds[i + 1])
        out[rows], state = delta_ref.chunk_gated_delta_rule(q[0, rows], k[0, rows], v[0, rows], g[0, rows],
                                                            beta[0, rows], initial_state[i], use_qk_l2norm=False)
        finals.append(state)
    return None, out[None], None, torch.stack(finals), None, None


@needs_interpreter
def test_interpreted_mixed_rule_equals_the_reference_per_sequence(monkeypatch) -> None:
    from hybridcache.kernels.gated_delta.fla import mixed_gated_delta_rule

    install_fake_fla(monkeypatch, _reference_fla_forward)

    lens, history = [1, 1, 1, 40, 7, 1], [12, 0, 30, 0, 9, 20]  # a fresh 1-token prompt; a decode row last
    ctx = [h + q for h, q in zip(history, lens, strict=True)]
    slots = torch.tensor([5, 2, 9, 4, 8, 0])
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    gen = torch.Generator().manual_seed(0)
    tokens, (hk, hv, dk, dv) = sum(lens), (1, 2, 16, 16)
    q, k = torch.randn(tokens, hk, dk, generator=gen), torch.randn(tokens, hk, dk, generator=gen)
    v = torch.randn(tokens, hv, dv, generator=gen)
    g = -torch.nn.functional.softplus(torch.randn(tokens, hv, generator=gen) - 1.0)
    beta = torch.randn(tokens, hv, generator=gen).sigmoid()
    pool = 0.1 * torch.randn(10, hv, dk, dv, generator=gen)
    before = pool.clone()
    context_lens = torch.tensor(ctx, dtype=torch.int32)
    lead = leading_decodes(cu, context_lens, slots, lens)
    out = mixed_gated_delta_rule(q, k, v, g, beta, pool, slots, context_lens, lead)
    assert sys.modules["fla.ops.gated_delta_rule.chunk_fwd"].SOLVE_TRIL_DOT_PRECISION.value == "ieee"

    bounds = cu.tolist()
    for i, hist in enumerate(history):
        rows = slice(bounds[i], bounds[i + 1])
        want, state = delta_ref.chunk_gated_delta_rule(q[rows], k[rows], v[rows], g[rows], beta[rows],
                                                      None if hist == 0 else before[slots[i]])
        torch.testing.assert_close(out[rows], want, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(pool[slots[i]], state, rtol=1e-4, atol=1e-4)
    untouched = torch.ones(10, dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(pool[untouched], before[untouched])  # the throwaway's state is written nowhere


@pytest.mark.skipif(sys.platform == "win32", reason="posix only")
@interpreted_in_child("interpreted")
def test_mixed_rule_in_a_triton_interpreter_subprocess() -> None:
    """This file's interpreted tests, in a child process (tests/kernels/interpreter.py)."""
