"""MLA prefill expanded (`kernels/attention/mla_prefill.py`): a step's contexts up-projected from their latent rows
into a scratch pool of every head's keys and values, attended by the paged GQA prefill kernel, equals the absorbed
attention of `latent.py` (which equals the expanded attention: tests/kernels/test_latent_attention.py).

- fp64 on the CPU through the torch reference of paged attention, to 1e-10: fresh prompts, chunks over cached rows
  starting mid-page, decode rows, a mixed step; E even and odd, a shared key part of 0.
- `test_interpreted_*`: through the Triton prefill kernel under TRITON_INTERPRET=1 in the child process (fp32), as
  the CUDA backend runs it; `test_cuda_*` the same on a GPU at Kimi's widths in bf16 and fp32 (`OURS`).
- Which steps expand (`expands`): not decode steps, not past `EXPAND_MAX_TOKENS` of context.
"""

from __future__ import annotations

import pytest
import torch

from hybridcache.kernels.attention import latent, mla_prefill
from hybridcache.kernels.attention import reference as attention_ref
from tests.kernels.cuda_checks import error_stats
from tests.kernels.interpreter import interpreted_in_child, needs_cuda, needs_interpreter
from tests.kernels.test_cuda_kernels import OURS, _interpreter_runs_our_kernels, assert_within
from tests.kernels.test_latent_attention import CASES, WIDTHS, _inputs

NOPE, VALUE_DIM = 6, 5


def _projections(heads: int, rank: int, dtype: torch.dtype, device: torch.device, nope: int = NOPE,
                 value_dim: int = VALUE_DIM):
    gen = torch.Generator().manual_seed(1)
    w_uk = torch.randn(heads, nope, rank, generator=gen, dtype=torch.float64) * rank**-0.5
    w_uv = torch.randn(heads, value_dim, rank, generator=gen, dtype=torch.float64) * rank**-0.5
    return w_uk.to(device, dtype), w_uv.to(device, dtype)


def _absorbed(batch, kv, q_nope, q_shared, w_uk, w_uv) -> torch.Tensor:
    def attend(absorbed: torch.Tensor) -> torch.Tensor:
        return latent.latent_attention(absorbed, kv.kv_pool, kv.block_tables, batch.cu_seqlens,
                                       batch.query_lens_cpu, batch.context_lens_cpu, scale=0.3,
                                       value_dim=w_uk.shape[-1])

    return latent.absorbed_attention(q_nope, q_shared, w_uk, w_uv, attend)


def _queries(tokens: int, heads: int, shared: int, dtype: torch.dtype, device: torch.device, nope: int = NOPE):
    gen = torch.Generator().manual_seed(2)
    return (torch.randn(tokens, heads, nope, generator=gen).to(device, dtype),
            torch.randn(tokens, heads, shared, generator=gen).to(device, dtype))


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("widths", sorted(WIDTHS))
def test_expanded_equals_absorbed(case: str, widths: str):
    heads, rank, shared = WIDTHS[widths]
    cpu = torch.device("cpu")
    batch, kv, _, _ = _inputs(case, WIDTHS[widths], torch.float64, cpu)
    w_uk, w_uv = _projections(heads, rank, torch.float64, cpu)
    q_nope, q_shared = _queries(sum(batch.query_lens_cpu), heads, shared, torch.float64, cpu)
    pool, table = mla_prefill.expand_context(kv.kv_pool, w_uk, w_uv, kv.block_tables, batch.context_lens_cpu, shared)
    assert pool.shape[1:] == (table.max().item() + 1, 16, heads, max(NOPE + shared, VALUE_DIM))
    query = mla_prefill.padded_query(q_nope, q_shared, pool.shape[-1])
    expanded = attention_ref.paged_attention(query, pool, table, batch.cu_seqlens, batch.query_lens_cpu,
                                             batch.context_lens_cpu, scale=0.3)[..., :VALUE_DIM]
    absorbed = _absorbed(batch, kv, q_nope, q_shared, w_uk, w_uv)
    assert torch.isfinite(expanded).all()
    assert (expanded - absorbed).abs().max() <= 1e-10 * absorbed.abs().max()


def test_which_steps_expand():
    cap = mla_prefill.EXPAND_MAX_TOKENS
    assert mla_prefill.expands((5, 1), (100, 40))
    assert mla_prefill.expands((1, 1, 7), (cap - 8, 1, 7))  # (decode rows beside a prefill: expanded with it)
    assert not mla_prefill.expands((1, 1), (100, 40))  # a decode step: absorbed reads 21x fewer bytes
    assert not mla_prefill.expands((7, 1), (cap, 40))  # past the scratch cap


def _triton_against_absorbed(case: str, widths: tuple[int, int, int], dtype: torch.dtype, device: torch.device,
                             nope: int = NOPE, value_dim: int = VALUE_DIM):
    from hybridcache.kernels.attention import triton_paged

    heads, rank, shared = widths
    batch, kv, _, _ = _inputs(case, widths, dtype, device)
    w_uk, w_uv = _projections(heads, rank, dtype, device, nope, value_dim)
    q_nope, q_shared = _queries(sum(batch.query_lens_cpu), heads, shared, dtype, device, nope)
    pool, table = mla_prefill.expand_context(kv.kv_pool, w_uk, w_uv, kv.block_tables, batch.context_lens_cpu, shared)
    query = mla_prefill.padded_query(q_nope, q_shared, pool.shape[-1])
    out = triton_paged.paged_prefill_attention(query, pool, table, batch.cu_seqlens, batch.context_lens,
                                               batch.query_lens_cpu, scale=0.3)[..., :value_dim]
    f32 = [t.float() for t in (q_nope, q_shared, w_uk, w_uv)]
    kv32 = type(kv)(kv.kv_pool.float(), kv.block_tables, kv.kv_rows)
    ref = _absorbed(batch, kv32, *f32)
    assert_within({"out": error_stats(out, ref)}, {"out": OURS[dtype]})


@pytest.mark.skipif(not _interpreter_runs_our_kernels(), reason="this Triton's interpreter cannot run our kernels")
@interpreted_in_child("interpreted")
def test_mla_prefill_in_a_triton_interpreter_subprocess() -> None:
    """This file's interpreted tests, in a child process (tests/kernels/interpreter.py)."""


@needs_interpreter
@pytest.mark.parametrize("case", ["prefill", "mixed"])
@pytest.mark.parametrize("widths", sorted(WIDTHS))
def test_interpreted_expanded_prefill(case: str, widths: str) -> None:
    _triton_against_absorbed(case, WIDTHS[widths], torch.float32, torch.device("cpu"))


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("case", ["prefill", "mixed"])
def test_cuda_expanded_prefill_at_kimi_widths(dtype: torch.dtype, case: str) -> None:
    _triton_against_absorbed(case, (32, 512, 64), dtype, torch.device("cuda"), nope=128, value_dim=128)
