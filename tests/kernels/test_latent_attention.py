"""Latent attention (`kernels/attention/latent.py`, Kimi Linear's MLA with its latent rows cached) against the
expanded attention it stands for, and its Triton kernel (`triton_latent.py`) against the reference.

- The reference, absorbed, equals plain causal attention over every head's expanded keys [W_UK c | k_shared] and
  values W_UV c (`reference.paged_attention` over a pool of those), the output mapped up by W_UV: fp32, 1e-5.
- `test_interpreted_*` run the Triton kernel on the CPU under TRITON_INTERPRET=1 in the child process that
  `test_latent_attention_in_a_triton_interpreter_subprocess` starts, fp32 (the interpreter's bf16 products are
  wrong): a fresh prompt and chunks over cached rows starting mid-page, decode rows (the table-less grid), a mixed
  step, odd row widths (the values half padded) and head counts that do not fill a block of rows; every slot of
  the pool no context covers holds NaN (`cuda_checks.paged_kv`), so a key read past a context shows.
- `test_cuda_*`: the same at Kimi-Linear-48B's widths (32 heads, E = 512 + 64) in bf16 and fp32 (skipped without
  a GPU). Tolerances as tests/kernels/test_cuda_kernels.py's (`OURS`).
"""

from __future__ import annotations

import pytest
import torch

from hybridcache.kernels.attention import latent
from hybridcache.kernels.attention import reference as attention_ref
from tests.kernels.cuda_checks import error_stats, paged_kv, varlen_batch
from tests.kernels.interpreter import interpreted_in_child, needs_cuda, needs_interpreter
from tests.kernels.test_cuda_kernels import OURS, _interpreter_runs_our_kernels, assert_within

# (query lengths, cached rows before them)
CASES = {
    "prefill": ((17, 5, 40), (0, 150, 21)),
    "decode": ((1, 1, 1, 1), (0, 16, 40, 100)),
    "mixed": ((1, 1, 20, 9), (130, 0, 0, 40)),
}
# (heads, kv_lora_rank R, shared key part Dr): E = R + Dr even and odd
WIDTHS = {"H4-E32": (4, 24, 8), "H3-E29": (3, 21, 8), "H2-E20": (2, 20, 0)}


def _inputs(case: str, widths: tuple[int, int, int], dtype: torch.dtype, device: torch.device, seed: int = 0):
    """A varlen batch, a latent pool with random history rows (NaN elsewhere), the step's new rows written by
    `write_kv(split_rows(...))` as `KimiMLA` does, and absorbed queries."""
    lengths, history = CASES[case]
    heads, rank, shared = widths
    gen = torch.Generator().manual_seed(seed)
    batch = varlen_batch(lengths, history, device, seed)
    kv = paged_kv(batch, 16, 1, latent.plane_width(rank + shared), dtype, device, gen)
    tokens = sum(lengths)
    rows = torch.randn(tokens, rank + shared, generator=gen).to(device, dtype)
    attention_ref.write_kv(kv.kv_pool, *latent.split_rows(rows), kv.kv_rows)
    q = torch.randn(tokens, heads, rank + shared, generator=gen).to(device, dtype)
    return batch, kv, q, rank


def _reference(batch, kv, q, rank):
    return latent.latent_attention(q, kv.kv_pool, kv.block_tables, batch.cu_seqlens, batch.query_lens_cpu,
                                   batch.context_lens_cpu, scale=0.3, value_dim=rank)


def test_split_rows_draw_the_layout():
    """Row [c0 c1 c2 s0 s1] -> keys half [c0 c1 c2], values half [s0 s1 0] (the module docstring's example)."""
    keys, values = latent.split_rows(torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0]]))
    assert keys.tolist() == [[[1.0, 2.0, 3.0]]] and values.tolist() == [[[4.0, 5.0, 0.0]]]
    assert latent.plane_width(576) == 288 and latent.plane_width(29) == 15


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("widths", sorted(WIDTHS))
def test_absorbed_attention_equals_expanded_attention(case: str, widths: str):
    """out_h = W_UV_h sum_j p_j c_j with p from qa_h = [W_UK_h^T q_nope_h | q_shared_h] against the rows equals
    causal attention of [q_nope_h | q_shared_h] over the expanded keys [W_UK_h c_j | k_shared_j] and values
    W_UV_h c_j, each head on its own (GQA with as many kv heads as heads), in fp64 rounded to 1e-10."""
    heads, rank, shared = WIDTHS[widths]
    nope, value_dim = 6, 5
    batch, kv, _, _ = _inputs(case, WIDTHS[widths], torch.float64, torch.device("cpu"))
    gen = torch.Generator().manual_seed(1)
    w_uk = torch.randn(heads, nope, rank, generator=gen, dtype=torch.float64)
    w_uv = torch.randn(heads, value_dim, rank, generator=gen, dtype=torch.float64)
    tokens = sum(batch.query_lens_cpu)
    q_nope = torch.randn(tokens, heads, nope, generator=gen, dtype=torch.float64)
    q_shared = torch.randn(tokens, heads, shared, generator=gen, dtype=torch.float64)
    absorbed = torch.cat([torch.einsum("thd,hdr->thr", q_nope, w_uk), q_shared], dim=-1)
    ours = torch.einsum("thr,hvr->thv", _reference(batch, kv, absorbed, rank), w_uv)

    # the expanded pool: every covered slot's row expanded per head; NaN slots stay NaN (never read)
    flat = torch.cat([kv.kv_pool[0], kv.kv_pool[1]], dim=-1)[..., : rank + shared]  # [pages, page, 1, E]
    c, k_shared = flat[..., :rank], flat[..., rank:]
    keys = torch.cat([torch.einsum("pbxr,hdr->pbhd", c, w_uk), k_shared.expand(*c.shape[:2], heads, shared)], -1)
    values = torch.einsum("pbxr,hvr->pbhv", c, w_uv)
    width = max(keys.shape[-1], value_dim)
    pad = torch.nn.functional.pad
    pool = torch.stack([pad(keys, (0, width - keys.shape[-1])), pad(values, (0, width - value_dim))])
    query = pad(torch.cat([q_nope, q_shared], dim=-1), (0, width - nope - shared))
    expanded = attention_ref.paged_attention(query, pool, kv.block_tables, batch.cu_seqlens, batch.query_lens_cpu,
                                             batch.context_lens_cpu, scale=0.3)[..., :value_dim]
    assert torch.isfinite(ours).all()
    assert (ours - expanded).abs().max() <= 1e-10 * expanded.abs().max()


def test_bad_shapes_are_refused():
    batch, kv, q, rank = _inputs("decode", WIDTHS["H4-E32"], torch.float32, torch.device("cpu"))
    args = (kv.block_tables, batch.cu_seqlens, batch.query_lens_cpu, batch.context_lens_cpu)
    with pytest.raises(ValueError, match="head dim 16, got 15"):
        latent.latent_attention(q, kv.kv_pool[..., :15].contiguous(), *args, scale=1.0, value_dim=rank)
    with pytest.raises(ValueError, match="value_dim 33"):
        latent.latent_attention(q, kv.kv_pool, *args, scale=1.0, value_dim=33)
    with pytest.raises(ValueError, match=r"\[2, pages, page, 1, W\]"):
        latent.latent_attention(q, kv.kv_pool.expand(2, -1, -1, 2, -1), *args, scale=1.0, value_dim=rank)
    with pytest.raises(ValueError, match="dtype"):
        latent.latent_attention(q.double(), kv.kv_pool, *args, scale=1.0, value_dim=rank)


def _kernel_against_reference(case: str, widths: tuple[int, int, int], dtype: torch.dtype, device: torch.device,
                              num_splits: int | None = None):
    from hybridcache.kernels.attention.triton_latent import latent_attention

    batch, kv, q, rank = _inputs(case, widths, dtype, device)
    out = latent_attention(q, kv.kv_pool, kv.block_tables, batch.cu_seqlens, batch.context_lens,
                           batch.query_lens_cpu, max(batch.context_lens_cpu), scale=0.3, value_dim=rank,
                           num_splits=num_splits)
    # the reference rounds its probabilities to q's dtype before the sum: an fp32 oracle on the same inputs
    ref = latent.latent_attention(q.float(), kv.kv_pool.float(), kv.block_tables, batch.cu_seqlens,
                                  batch.query_lens_cpu, batch.context_lens_cpu, scale=0.3, value_dim=rank)
    assert out.shape == (sum(batch.query_lens_cpu), widths[0], rank) and out.dtype == dtype
    assert_within({"out": error_stats(out, ref)}, {"out": OURS[dtype]})


@pytest.mark.skipif(not _interpreter_runs_our_kernels(), reason="this Triton's interpreter cannot run our kernels")
@interpreted_in_child("interpreted")
def test_latent_attention_in_a_triton_interpreter_subprocess() -> None:
    """This file's interpreted tests, in a child process (tests/kernels/interpreter.py)."""


@needs_interpreter
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("widths", sorted(WIDTHS))
@pytest.mark.parametrize("num_splits", [1, 3, None], ids=["whole", "splits3", "chosen"])
def test_interpreted_latent_kernel(case: str, widths: str, num_splits: int | None) -> None:
    """Every key in one program, in 3 splits (a split past a row's position: m = -inf, l = 0 merged away), and as
    `latent_splits` chooses (the interpreter's 64 "multiprocessors": mostly split)."""
    _kernel_against_reference(case, WIDTHS[widths], torch.float32, torch.device("cpu"), num_splits)


@needs_interpreter
@pytest.mark.parametrize("num_splits", [1, 3])
def test_interpreted_latent_kernel_in_a_bigger_grid(num_splits: int) -> None:
    """A graph captured for one sequence of 40 rows (`SequenceGraphs`) replays a step of 7 tokens after 30 cached:
    the grid is sized for 40 tokens, the device lengths say 7, and the programs past the sequence's blocks find none
    (`_find_block`) and write nothing, while its 7 rows equal the reference's."""
    from hybridcache.kernels.attention.triton_latent import latent_attention

    batch, kv, q, rank = _inputs("prefill", WIDTHS["H3-E29"], torch.float32, torch.device("cpu"))
    real = varlen_batch((7,), (30,), torch.device("cpu"))
    kv_rows_table = kv.block_tables[1:2]  # the second sequence's pages hold 150 + 5 rows: read its first 37
    padded = torch.cat([q[:7], torch.full((33, *q.shape[1:]), float("nan"))])
    out = latent_attention(padded, kv.kv_pool, kv_rows_table, real.cu_seqlens, real.context_lens, (40,), 4000,
                           scale=0.3, value_dim=rank, num_splits=num_splits)
    ref = latent.latent_attention(q[:7], kv.kv_pool, kv_rows_table, real.cu_seqlens, (7,), (37,), scale=0.3,
                                  value_dim=rank)
    assert_within({"out": error_stats(out[:7], ref)}, {"out": OURS[torch.float32]})


def test_splits_fill_the_multiprocessors():
    """`latent_splits`: its docstring's examples, and a split never under MIN_SPLIT_KEYS keys."""
    pytest.importorskip("triton")
    from hybridcache.kernels.attention.triton_latent import MIN_SPLIT_KEYS, latent_splits

    assert latent_splits(4, 100_000, 132) == 66
    assert latent_splits(256, 100_000, 132) == 1
    assert latent_splits(4, 2, 132) == 1 and latent_splits(4, 3 * MIN_SPLIT_KEYS, 132) == 3
    assert latent_splits(1, 10**7, 132) == 128  # (MAX_SPLITS)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("num_splits", [1, 5, None], ids=["whole", "splits5", "chosen"])
def test_cuda_latent_kernel_at_kimi_widths(dtype: torch.dtype, case: str, num_splits: int | None) -> None:
    _kernel_against_reference(case, (32, 512, 64), dtype, torch.device("cuda"), num_splits)


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("decode", [True, False], ids=["decode", "varlen"])
def test_latent_kernel_compiles_for_hopper(dtype: str, decode: bool) -> None:
    """The launches the engine makes for Kimi-Linear-48B (32 heads, E = 512 + 64 in a pool of head dim 288, pages
    of 16) compile for sm90 (`tests/kernels/hopper.py`), bf16 products on the tensor cores (fp32 ones are IEEE,
    FMAs), within a multiprocessor's 227 KiB of shared memory as this Triton compiles them (a necessary check, not a
    sufficient one: the device's Triton 3.6 needed 254,464 B for a tile that compiled to 90,112 B here; docs/bench.md,
    session 66)."""
    pytest.importorskip("triton")
    from hybridcache.kernels.attention import triton_latent
    from tests.kernels.hopper import compile_for_hopper

    kernel = triton_latent._latent_kernel
    cfg = triton_latent.latent_config(torch.bfloat16 if dtype == "bf16" else torch.float32, 32 if decode else None)
    table = {"q_ptr": f"*{dtype}", "kv_ptr": f"*{dtype}", "out_ptr": f"*{dtype}", "acc_ptr": "*fp32", "ml_ptr": "*fp32",
             "bt_ptr": "*i32", "cu_ptr": "*i32", "ctx_ptr": "*i32"}
    ints = [p.name for p in kernel.params if p.name.startswith("stride_") or p.name in ("num_splits", "num_seqs")]
    constants = dict(H=32, W=288, E=576, R=512, PAGE=16, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                     BLOCK_E=cfg.block_e, BLOCK_V=cfg.block_v, DECODE=decode, PARTIAL=decode,
                     PRECISION="tf32" if dtype == "bf16" else "ieee")
    compiled = compile_for_hopper(kernel, table, ints, constants, num_warps=cfg.num_warps, floats=("qk_scale",))
    assert ("mma" in compiled.asm["ptx"]) == (dtype == "bf16")
    assert compiled.metadata.shared <= 227 * 1024
