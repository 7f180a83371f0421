"""MLA prefill expanded (`kernels/attention/mla_prefill.py`): a step's contexts up-projected from their latent rows
into a scratch pool of every head's keys and values, attended by the paged GQA prefill kernel, equals the absorbed
attention of `latent.py` (which equals the expanded attention: tests/kernels/test_latent_attention.py).

- fp64 on the CPU through the torch reference of paged attention, to 1e-10: fresh prompts, chunks over cached rows
  starting mid-page, decode rows, a mixed step; E even and odd, a shared key part of 0.
- `test_interpreted_*`: through the Triton prefill kernel under TRITON_INTERPRET=1 in the child process (fp32), as
  the CUDA backend runs it; `test_cuda_*` the same on a GPU at Kimi's widths in bf16 and fp32 (`OURS`).
- Windows of key positions (`windowed_attention`, contexts past `EXPAND_MAX_TOKENS`): in fp64 through a torch
  reference of the kernel's partial sums, windows of 16 to 128 keys equal one window to 1e-12 (and the absorbed
  attention, whose probabilities are rounded to fp32, to 1e-6); interpreted and on a GPU through
  `triton_paged.paged_prefill_partials`. `merge_partials` against one softmax over the concatenated keys.
- How a step runs (`plan`): its leading decode rows absorbed, the rest expanded in one pass or in windows sized to
  the cap (the module docstring's examples), decode steps absorbed whole.
"""

from __future__ import annotations

import math

import pytest
import torch

from hybridcache.kernels.attention import latent, mla_prefill
from hybridcache.kernels.attention import reference as attention_ref
from hybridcache.kernels.attention.triton_paged import default_prefill_config
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


def test_how_a_step_runs():
    plan, cap, Plan = mla_prefill.plan, mla_prefill.EXPAND_MAX_TOKENS, mla_prefill.ExpandPlan  # noqa: N806
    assert (cap, mla_prefill.WINDOW_GRANULE, mla_prefill.EXPAND_MIN_QUERIES) == (32_768, 1024, 96)
    assert plan((500, 1), (600, 40), 16) == Plan(0, None)  # (a decode row after a prefill: expanded with it)
    assert plan((1, 1, 700), (cap, cap, 700), 16) == Plan(2, None)  # leading decode rows: absorbed, any context
    assert plan((1, 1), (100, 40), 16) is None  # a decode step: absorbed reads 21x fewer bytes
    assert plan((1, 1, 2048), (900, 5000, 70_000), 16) == Plan(2, 32_768)  # the module docstring's examples
    assert plan((2048, 2048), (20_000, 20_000), 16) == Plan(0, 16_384)
    assert plan((20,), (50_000,), 16) is None
    assert plan((2048, 2048), (20_000, 20_000), 3 * 1024) == Plan(0, 15_360)  # windows: whole pages too
    assert plan((2048, 1), (cap, 40), 16) == Plan(0, 32_768 - 1024)  # sum min(c, L) <= cap: the decode row's 40 too
    assert plan((2000,) * 32, (2000,) * 32, 16) == Plan(0, 1024)
    assert plan((2000,) * 33, (2000,) * 33, 16) is None  # 33 sequences over a window of 1,024 keys: absorbed
    # queries per context key: (96 x 100 + 1 x 3,100) / 3,200 < 96 (a decode row among the chunks), 96 x 3,100 ok
    assert plan((96, 1), (100, 3100), 16) is None and plan((96, 96), (100, 3100), 16) == Plan(0, None)
    assert plan((64,), (30_064,), 16) is None and plan((128,), (30_128,), 16) == Plan(0, None)  # the bench's chunks


def _reference_partials(query, pool, table, window, batch, scale=0.3):
    """The prefill kernel's unmerged sums (one split) over the keys at positions in `window`, in torch: acc [T, H,
    1, D], ml [T, H, 1, 2] in log2 units, m = -inf and l = 0 for a row that sees no key there."""
    lo, hi = window
    num_tokens, heads, width = query.shape
    acc = query.new_zeros(num_tokens, heads, 1, width)
    ml = query.new_zeros(num_tokens, heads, 1, 2)
    ml[..., 0] = float("-inf")
    starts, page = batch.cu_seqlens.tolist(), pool.shape[2]
    for i, (length, context) in enumerate(zip(batch.query_lens_cpu, batch.context_lens_cpu, strict=True)):
        end = min(hi, context)
        if end <= lo:
            continue
        keys, values = attention_ref.gather_kv(pool, table[i][lo // page:], end - lo)
        rows = slice(starts[i], starts[i] + length)
        scores = torch.einsum("qhd,khd->qhk", query[rows], keys) * scale * math.log2(math.e)
        visible = torch.arange(lo, end)[None, :] <= torch.arange(context - length, context)[:, None]
        scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
        top = scores.amax(-1)
        weights = torch.exp2(scores - torch.where(top.isinf(), 0.0, top)[..., None])
        acc[rows, :, 0] = torch.einsum("qhk,khd->qhd", weights, values)
        ml[rows, :, 0, 0], ml[rows, :, 0, 1] = top, weights.sum(-1)
    return acc, ml


@pytest.mark.parametrize("window", [16, 32, 128])
@pytest.mark.parametrize("case", ["prefill", "mixed", "decode"])
def test_windows_equal_absorbed(case: str, window: int):
    """Every sequence's keys in windows (a window past a short sequence's end, one past a query's position, one
    that starts mid-chunk), expanded window by window and merged, equal the absorbed attention."""
    heads, rank, shared = WIDTHS["H4-E32"]
    cpu = torch.device("cpu")
    batch, kv, _, _ = _inputs(case, WIDTHS["H4-E32"], torch.float64, cpu)
    w_uk, w_uv = _projections(heads, rank, torch.float64, cpu)
    q_nope, q_shared = _queries(sum(batch.query_lens_cpu), heads, shared, torch.float64, cpu)

    def partials(query, pool, table, key_window):
        return _reference_partials(query, pool, table, key_window, batch)

    def windowed(size: int) -> torch.Tensor:
        return mla_prefill.windowed_attention(q_nope, q_shared, kv.kv_pool, w_uk, w_uv, kv.block_tables,
                                              batch.context_lens_cpu, size, partials)

    out, whole = windowed(window), windowed(1024)  # (1,024: every context in one window)
    absorbed = _absorbed(batch, kv, q_nope, q_shared, w_uk, w_uv)
    assert out.shape == absorbed.shape and torch.isfinite(out).all()
    assert (out - whole).abs().max() <= 1e-12 * whole.abs().max()
    # (the absorbed reference rounds its probabilities to fp32, as `reference.paged_attention` does)
    assert (out - absorbed).abs().max() <= 1e-6 * absorbed.abs().max()


def test_a_window_expands_only_its_keys():
    """`expand_context` over a window: each sequence's keys at positions [lo, hi), in the table's columns from
    lo / page on, equal the whole expansion's at those positions."""
    heads, rank, shared = WIDTHS["H3-E29"]
    cpu = torch.device("cpu")
    batch, kv, _, _ = _inputs("prefill", WIDTHS["H3-E29"], torch.float64, cpu)  # contexts 17, 155, 61
    w_uk, w_uv = _projections(heads, rank, torch.float64, cpu)
    whole, whole_table = mla_prefill.expand_context(kv.kv_pool, w_uk, w_uv, kv.block_tables, batch.context_lens_cpu,
                                                    shared)
    pool, table = mla_prefill.expand_context(kv.kv_pool, w_uk, w_uv, kv.block_tables, batch.context_lens_cpu, shared,
                                             (32, 96))
    # keys 0, 64 (to 96) and 29 (to 61): 6 columns of pages, the table 16 wide (`table_width`)
    assert pool.shape[1] == 0 + 4 + 2 and table.shape == (3, 16) and whole_table.shape == (3, 16)
    assert table[1].tolist()[:6] == [0, 0, 0, 1, 2, 3] and table[2].tolist()[2:4] == [4, 5]
    for i, end in enumerate((17, 96, 61)):
        if end <= 32:
            continue
        got = attention_ref.gather_kv(pool, table[i][2:], end - 32)
        want = attention_ref.gather_kv(whole, whole_table[i], end)
        assert all(torch.equal(a, b[32:]) for a, b in zip(got, want, strict=True))
    with pytest.raises(ValueError, match="not a multiple of the page 16"):
        mla_prefill.expand_context(kv.kv_pool, w_uk, w_uv, kv.block_tables, batch.context_lens_cpu, shared, (8, 96))


def test_merged_partials_are_one_softmax():
    """Partials of three launches (two splits each, some empty: m = -inf, l = 0) folded one by one give the
    softmax-weighted sum over all their scores at once."""
    gen = torch.Generator().manual_seed(3)
    scores = torch.randn(5, 2, 6, 10, generator=gen, dtype=torch.float64) * 4  # [T, H, launch x split, keys]
    scores[0, 0, :3] = float("-inf")  # row 0, head 0: nothing in the first launch
    scores[1, :, 4] = float("-inf")  # an empty split in the third launch
    values = torch.randn(5, 2, 6, 10, 3, generator=gen, dtype=torch.float64)
    top = scores.amax(-1)
    weights = torch.exp2(scores - torch.where(top.isinf(), 0.0, top)[..., None])
    acc = torch.einsum("thsk,thskd->thsd", weights, values)
    ml = torch.stack([top, weights.sum(-1)], dim=-1)
    running = None
    for launch in range(3):
        running = mla_prefill.merge_partials(running, acc[:, :, 2 * launch: 2 * launch + 2],
                                             ml[:, :, 2 * launch: 2 * launch + 2])
    out = running[0] / running[2][..., None]
    flat = scores.flatten(2, 3)
    want = torch.einsum("thk,thkd->thd", torch.softmax(flat * math.log(2), dim=-1), values.flatten(2, 3))
    assert (out - want).abs().max() <= 1e-12


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


def _windows_against_absorbed(case: str, widths: tuple[int, int, int], dtype: torch.dtype, device: torch.device,
                              window: int, nope: int = NOPE, value_dim: int = VALUE_DIM, num_splits: int = 1):
    from hybridcache.kernels.attention import triton_paged

    heads, rank, shared = widths
    batch, kv, _, _ = _inputs(case, widths, dtype, device)
    w_uk, w_uv = _projections(heads, rank, dtype, device, nope, value_dim)
    q_nope, q_shared = _queries(sum(batch.query_lens_cpu), heads, shared, dtype, device, nope)

    def partials(query, pool, table, key_window):
        return triton_paged.paged_prefill_partials(query, pool, table, batch.cu_seqlens, batch.context_lens,
                                                   batch.query_lens_cpu, scale=0.3, key_window=key_window,
                                                   num_splits=num_splits)

    out = mla_prefill.windowed_attention(q_nope, q_shared, kv.kv_pool, w_uk, w_uv, kv.block_tables,
                                         batch.context_lens_cpu, window, partials)
    f32 = [t.float() for t in (q_nope, q_shared, w_uk, w_uv)]
    kv32 = type(kv)(kv.kv_pool.float(), kv.block_tables, kv.kv_rows)
    ref = _absorbed(batch, kv32, *f32)
    assert_within({"out": error_stats(out, ref)}, {"out": OURS[dtype]})


@needs_interpreter
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("case", ["prefill", "mixed"])
def test_interpreted_windowed_prefill(case: str, num_splits: int) -> None:
    _windows_against_absorbed(case, WIDTHS["H4-E32"], torch.float32, torch.device("cpu"), 64, num_splits=num_splits)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("case", ["prefill", "mixed"])
def test_cuda_windowed_prefill_at_kimi_widths(dtype: torch.dtype, case: str) -> None:
    _windows_against_absorbed(case, (32, 512, 64), dtype, torch.device("cuda"), 64, nope=128, value_dim=128,
                              num_splits=2)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("case", ["prefill", "mixed"])
def test_cuda_expanded_prefill_at_kimi_widths(dtype: torch.dtype, case: str) -> None:
    _triton_against_absorbed(case, (32, 512, 64), dtype, torch.device("cuda"), nope=128, value_dim=128)


# (case, cap, granule, queries a key) -> the plan `CudaBackend.mla_attention` follows (cap, granule and the queries
# a key it needs shrunk to force windows), and the calls it makes: (tokens of the absorbed kernel's launch,
# expansions of key windows)
BACKEND_PLANS = {
    ("mixed", None, None, 1): (mla_prefill.ExpandPlan(2, None), (2, 1)),  # decode rows absorbed, the rest in one pass
    ("mixed", 64, 32, 1): (mla_prefill.ExpandPlan(2, 32), (2, 2)),  # contexts 20, 49 past the cap: windows of 32
    ("mixed", None, None, 13): (None, (31, 0)),  # (20 x 20 + 9 x 49) / 69 = 12.2 queries a key: absorbed
    ("prefill", 96, 32, 1): (mla_prefill.ExpandPlan(0, 32), (0, 5)),  # 17, 155, 61: sum min(c, 32) = 81 <= 96
    ("prefill", 64, 32, 1): (None, (62, 0)),  # 81 > 64: absorbed
    ("prefill", 160, 64, 1): (mla_prefill.ExpandPlan(0, 64), (0, 3)),  # 17 + 64 + 61 = 142 <= 160: windows of 64
    ("decode", None, None, 1): (None, (4, 0)),
}


def _backend_against_reference(case: str, cap: int | None, granule: int | None, queries: int, dtype: torch.dtype,
                               device: torch.device, monkeypatch, widths=WIDTHS["H4-E32"], nope: int = NOPE,
                               value_dim: int = VALUE_DIM) -> None:
    """`CudaBackend.mla_attention` (its attention backend the torch reference's: only the MLA op is under test) on
    a `ForwardBatch` of the case against `ReferenceBackend.mla_attention`, each writing the step's rows itself."""
    from hybridcache.forward_batch import ForwardBatch
    from hybridcache.kernels.attention.reference_backend import ReferenceAttention
    from hybridcache.kernels.backend import ReferenceBackend
    from hybridcache.kernels.cuda_backend import CudaBackend

    if cap is not None:
        monkeypatch.setattr(mla_prefill, "EXPAND_MAX_TOKENS", cap)
        monkeypatch.setattr(mla_prefill, "WINDOW_GRANULE", granule)
    monkeypatch.setattr(mla_prefill, "EXPAND_MIN_QUERIES", queries)
    from hybridcache.kernels.attention import triton_latent

    heads, rank, shared = widths
    batch, kv, _, _ = _inputs(case, widths, dtype, device)
    plan, calls = BACKEND_PLANS[case, cap, granule, queries]
    assert mla_prefill.plan(batch.query_lens_cpu, batch.context_lens_cpu, 16) == plan
    seen = {"absorbed": 0, "expanded": 0}

    def spy(name, function, count):
        def call(*args, **kwargs):
            seen[name] += count(*args)
            return function(*args, **kwargs)
        return call

    monkeypatch.setattr(triton_latent, "latent_attention", spy("absorbed", triton_latent.latent_attention,
                                                               lambda q, *_: q.shape[0]))
    monkeypatch.setattr(mla_prefill, "expand_context", spy("expanded", mla_prefill.expand_context, lambda *_: 1))
    width = kv.kv_pool.shape[-1]
    rows = torch.cat([kv.kv_pool[0].reshape(-1, width)[kv.kv_rows], kv.kv_pool[1].reshape(-1, width)[kv.kv_rows]],
                     dim=-1)[:, : rank + shared]  # the step's rows, as `_inputs` wrote them
    w_uk, w_uv = _projections(heads, rank, dtype, device, nope, value_dim)
    q_nope, q_shared = _queries(sum(batch.query_lens_cpu), heads, shared, dtype, device, nope)
    positions = torch.cat([torch.arange(c - n, c) for n, c in zip(batch.query_lens_cpu, batch.context_lens_cpu,
                                                                     strict=True)])
    step = ForwardBatch(
        input_ids=torch.zeros(len(positions), dtype=torch.int64, device=device), positions=positions.to(device),
        cu_seqlens=batch.cu_seqlens, context_lens=batch.context_lens, block_tables=kv.block_tables,
        kv_rows=kv.kv_rows, state_slots=batch.state_slots, logits_indices=(batch.cu_seqlens[1:] - 1).long(),
        query_lens_cpu=batch.query_lens_cpu, context_lens_cpu=batch.context_lens_cpu)
    backend = CudaBackend(ReferenceAttention())
    got = backend.mla_attention(q_nope, q_shared, rows, w_uk, w_uv, kv.kv_pool.clone(), backend.prepare(step),
                                scale=0.3)
    assert (seen["absorbed"], seen["expanded"]) == calls
    reference = ReferenceBackend()
    f32 = [t.float() for t in (q_nope, q_shared, rows, w_uk, w_uv, kv.kv_pool)]
    want = reference.mla_attention(*f32, reference.prepare(step), scale=0.3)
    assert got.shape == want.shape == (len(positions), heads, value_dim)
    assert_within({"out": error_stats(got, want)}, {"out": OURS[dtype]})


@needs_interpreter
@pytest.mark.parametrize(("case", "cap", "granule", "queries"), list(BACKEND_PLANS), ids=lambda x: str(x))
def test_interpreted_backend_follows_the_plan(case: str, cap: int | None, granule: int | None, queries: int,
                                              monkeypatch) -> None:
    _backend_against_reference(case, cap, granule, queries, torch.float32, torch.device("cpu"), monkeypatch)


# The CUDA cases: windows must be whole key blocks of the dtype's prefill tiles (bf16's block_n is 64, fp32's 32)
CUDA_PLANS = [(dtype, *key) for dtype in (torch.bfloat16, torch.float32) for key in BACKEND_PLANS
              if key[2] is None or key[2] % default_prefill_config(64, dtype).block_n == 0]


@needs_cuda
@pytest.mark.parametrize(("dtype", "case", "cap", "granule", "queries"), CUDA_PLANS, ids=lambda x: str(x))
def test_cuda_backend_follows_the_plan(case: str, cap: int | None, granule: int | None, queries: int,
                                       dtype: torch.dtype, monkeypatch) -> None:
    _backend_against_reference(case, cap, granule, queries, dtype, torch.device("cuda"), monkeypatch)


def test_a_key_window_is_whole_key_blocks():
    """A window that ends inside a key block would have the kernel read that block's keys past the window, and
    block-table columns the window's table does not have: refused before the launch."""
    from hybridcache.kernels.attention import triton_paged

    q, pool = torch.zeros(4, 2, 32), torch.zeros(2, 3, 16, 2, 32)
    table, cu, ctx = torch.zeros(1, 3, dtype=torch.int32), torch.tensor([0, 4]), torch.tensor([40])
    for window in ((0, 48), (16, 64)):
        with pytest.raises(ValueError, match="must start and end on multiples of block_n 32"):
            triton_paged.paged_prefill_partials(q, pool, table, cu, ctx, [4], scale=1.0, key_window=window)
