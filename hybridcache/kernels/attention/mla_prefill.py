"""MLA prefill over expanded keys and values: a step's contexts up-projected from their cached latent rows into a
scratch pool of every head's keys and values, so that the paged GQA prefill kernel runs them (`KimiMLA` on CUDA).

Absorbed attention (`latent.py`) scores E = 576 lanes and sums R = 512 a (query, key) pair and head, against the
expanded 192 and 128: 3.4x the arithmetic, which a prefill, unlike a decode step, is bound by (docs/bench.md,
"Kimi's MLA over latent rows, absorbed against expanded", has the figures). Up-projecting the context costs one
GEMM of its rows (C x R x H x (Dn + Dv)) and a scratch pool of 2 x H x max(Dn + Dr, Dv) values a context token
(24 KiB in bf16 at Kimi's widths), so one expansion holds at most `EXPAND_MAX_TOKENS` context tokens (768 MiB of
scratch at Kimi's widths in bf16, and one up-projection's output, 256 MiB, while it is filled).

`plan` splits a step (`ExpandPlan`): its leading decode rows run absorbed (a decode row reads 21x fewer bytes so);
the other sequences run expanded when they have queries enough to pay for their expansion (below): in one pass when
their contexts total at most the cap, else in windows of key positions [j L, (j + 1) L) (`windowed_attention`).
Each window's keys are expanded in turn into the same scratch size, attended with the kernel's partial sums kept
(`triton_paged.paged_prefill_partials`), and the windows' sums merged (`merge_partials`). L is the largest
multiple of `WINDOW_GRANULE` (and of the page) for which the window's expansion, sum_i min(context_i, L), fits the
cap. A step with more sequences than the cap has room for at that granule, or one inside a CUDA graph capture
(whose host lengths are not the replay's), runs absorbed.

When expanding pays: an expanded sequence of q queries over c context keys costs about f + (e + r) c while q is
small (f a fixed cost of the op's launches; e a key's up-projection GEMMs and scratch writes; r the paged kernel's
read of the scratch, which bounds it up to a few hundred queries), an absorbed one about a q c. Fitted to the engine
op on an H100 at Kimi's widths (docs/bench.md, session 68): f ~ 0.25 ms, e ~ 4.7e-8 s, r ~ 1.3e-8 s, and with the
absorbed prefill tile a ~ 0.65-0.87e-9 s, so expanding pays from about (f / c + e + r) / a queries a key: ~100 over
16,000-30,000 keys, ~83 over 100,000. The step's sequences after the lead expand when their queries per context
key, sum q_i c_i / sum c_i, are at least `EXPAND_MIN_QUERIES` (96); with fewer (a short new turn over a long
conversation, decode rows among the chunks) they run absorbed, whose time is then about the context's bytes read,
as a decode step's. (Over short contexts f weighs more: by the same fit ~400 queries a key over 1,000 keys, which
the one threshold does not follow; there both paths take a fraction of a millisecond.)

Worked examples (cap 32,768, granule 1,024, 96 queries a key): query lens (1, 1, 2048), contexts (900, 5000,
70,000): two leading decode rows absorbed; the chunk's 70,000 keys exceed the cap, so L = 32,768 and three windows,
[0, 32,768), [32,768, 65,536) and [65,536, 70,000), each expanded and attended by all 2,048 queries (those at
positions before a window's first key get m = -inf, l = 0 there). Two 2,048-token chunks over contexts (20,000,
20,000): sum_i min(c_i, L) <= 32,768 gives L = 16,384, windows [0, 16,384) and [16,384, 20,000). A 20-token turn
over a 50,000-token conversation: 20 queries a key, absorbed.

Worked example of one expansion, two sequences with window keys 5 and 17 (pages of 16): the scratch pool has
ceil(5/16) + ceil(17/16) = 3 pages; sequence 0's keys fill page 0 (rows 5-15 unused), sequence 1's pages 1 and 2;
the block table is [[0, -, ...], [1, 2, ...]] (16 columns, `table_width`), shifted right by lo / 16 columns for a
window starting at key lo (the kernel reads the table only inside the window). Every key of a window is expanded,
cached and new alike; the kernel masks keys past each query.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F  # noqa: N812

from hybridcache.forward_batch import table_width
from hybridcache.kernels.attention.latent import gather_rows

# The context tokens one expansion may hold (scratch: 2 x H x width values a token; 768 MiB at Kimi's widths in bf16)
EXPAND_MAX_TOKENS = 32_768
# Windows start at multiples of this (and of the page): a multiple of every prefill tile's block_n
WINDOW_GRANULE = 1024
# The queries per context key (sum q_i c_i / sum c_i over the expanded sequences) from which expanding pays
EXPAND_MIN_QUERIES = 96


@dataclass(frozen=True)
class ExpandPlan:
    """How a prefill step's MLA runs (module docstring): its first `lead` sequences (decode rows) absorbed, the
    rest expanded in one pass (window None) or in windows of `window` key positions."""

    lead: int
    window: int | None


def plan(query_lens_cpu: Sequence[int], context_lens_cpu: Sequence[int], page: int) -> ExpandPlan | None:
    """The step's `ExpandPlan`, or None when it runs absorbed whole: a decode step (every sequence one token), a
    step inside a CUDA graph capture, one whose sequences after the lead have fewer than `EXPAND_MIN_QUERIES`
    queries per context key, or one whose expanded sequences are too many for a window of the granule."""
    lead = next((i for i, length in enumerate(query_lens_cpu) if length != 1), len(query_lens_cpu))
    if lead == len(query_lens_cpu) or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
        return None
    queries, contexts = query_lens_cpu[lead:], context_lens_cpu[lead:]
    if sum(q * c for q, c in zip(queries, contexts, strict=True)) < EXPAND_MIN_QUERIES * sum(contexts):
        return None
    if sum(contexts) <= EXPAND_MAX_TOKENS:
        return ExpandPlan(lead, None)
    granule = math.lcm(WINDOW_GRANULE, page)
    for window in range(EXPAND_MAX_TOKENS // granule * granule, 0, -granule):
        if sum(min(length, window) for length in contexts) <= EXPAND_MAX_TOKENS:
            return ExpandPlan(lead, window)
    return None


def scratch_width(nope: int, shared_width: int, value_dim: int) -> int:
    """The scratch pool's head dim: keys [k_nope | k_shared] (Dn + Dr) and values (Dv), both padded to the wider."""
    return max(nope + shared_width, value_dim)


def workspace_bytes(num_heads: int, nope: int, shared_width: int, value_dim: int, rank: int, num_tokens: int,
                    dtype: torch.dtype) -> int:
    """The most one layer's expanded MLA holds at once for a step of up to `num_tokens` queries (an upper figure;
    the engine keeps it out of the pools on CUDA, `CudaBackend.workspace_bytes`): an expansion at the cap (its
    gathered latent rows, the scratch pool, one up-projection's output), the padded query and its concatenation,
    and in windows the fp32 running output, a window's partials and their sum.

    Kimi-Linear-48B's widths in bf16 (32 heads, Dn = Dv = 128, Dr = 64, R = 512; width 192), 8,192 queries: rows
    32,768 x 576 x 2 B = 38 MB, scratch 2 x 32,768 x 32 x 192 x 2 B = 805 MB, an up-projection 32,768 x 32 x 128 x
    2 B = 268 MB, queries 2 x 8,192 x 32 x 192 x 2 B = 201 MB, fp32 sums 3 x 8,192 x 32 x 192 x 4 B = 604 MB:
    1.92 GB."""
    size = torch.empty((), dtype=dtype).element_size()
    width = scratch_width(nope, shared_width, value_dim)
    cap = EXPAND_MAX_TOKENS
    expansion = cap * (rank + shared_width) * size + 2 * cap * num_heads * width * size
    expansion += cap * num_heads * max(nope, value_dim) * size
    queries = 2 * num_tokens * num_heads * width * size + 3 * num_tokens * num_heads * width * 4
    return expansion + queries


def expand_context(
    kv_pool: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor, block_tables: torch.Tensor,
    context_lens_cpu: Sequence[int], shared_width: int, window: tuple[int, int | None] = (0, None),
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every sequence's keys at positions in `window` [lo, hi) (hi None: to its end) up-projected (module
    docstring): (scratch pool [2, pages, page, H, width], its block table [S, P] int32, P = ceil(min(hi, longest) /
    page) rounded up to a multiple of 16 (`table_width`: one Triton specialisation of its stride), the columns
    before lo / page and past a row's pages unused), width = max(Dn + Dr, Dv); keys [W_UK_h c | k_shared] and values
    W_UV_h c, both zero-padded to width. kv_pool: a layer's pool of latent rows [2, num_pages, page, 1,
    ceil(E / 2)]; w_uk [H, Dn, R], w_uv [H, Dv, R]; shared_width: Dr (E = R + Dr); lo a multiple of the page."""
    heads, nope, rank = w_uk.shape
    value_dim = w_uv.shape[1]
    width = scratch_width(nope, shared_width, value_dim)
    page = kv_pool.shape[2]
    lo, hi = window
    if lo % page:
        raise ValueError(f"a window starts at {lo}, not a multiple of the page {page}")
    ends = [length if hi is None else min(length, hi) for length in context_lens_cpu]
    keys = [max(end - lo, 0) for end in ends]
    pages = [-(-n // page) for n in keys]
    first = lo // page
    rows = torch.cat([_rows(kv_pool, block_tables[i][first:], n, count * page, rank + shared_width)
                      for i, (n, count) in enumerate(zip(keys, pages, strict=True))])
    latent, num_rows = rows[:, :rank], rows.shape[0]
    pool = rows.new_zeros(2, num_rows, heads, width)  # filled in place: the scratch and one GEMM's output at a time
    pool[0, :, :, :nope] = (latent @ w_uk.reshape(heads * nope, rank).T).view(num_rows, heads, nope)
    pool[0, :, :, nope: nope + shared_width] = rows[:, None, rank:]
    pool[1, :, :, :value_dim] = (latent @ w_uv.reshape(heads * value_dim, rank).T).view(num_rows, heads, value_dim)
    table = torch.zeros(len(pages), table_width(max(-(-end // page) for end in ends)), dtype=torch.int32)
    start = 0
    for i, count in enumerate(pages):
        table[i, first: first + count] = torch.arange(start, start + count, dtype=torch.int32)
        start += count
    return pool.view(2, start, page, heads, width), table.to(kv_pool.device)


def _rows(kv_pool: torch.Tensor, pages: torch.Tensor, keys: int, padded: int, latent_width: int) -> torch.Tensor:
    """The latent rows [padded, E] of a sequence's first `keys` positions from its block-table row `pages` (zero
    past `keys`)."""
    return F.pad(gather_rows(kv_pool, pages, keys, latent_width), (0, 0, 0, padded - keys))


def padded_query(q_nope: torch.Tensor, q_shared: torch.Tensor, width: int) -> torch.Tensor:
    """[q_nope | q_shared] [T, H, Dn + Dr], zero-padded to the scratch pool's width."""
    query = torch.cat([q_nope, q_shared], dim=-1)
    return F.pad(query, (0, width - query.shape[-1]))


Partials = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, tuple[int, int]], tuple[torch.Tensor, torch.Tensor]]


def merge_partials(
    running: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None, acc: torch.Tensor, ml: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fold one launch's partials (`triton_paged.paged_prefill_partials`: acc [T, H, S, D], ml [T, H, S, 2]) into
    a running (acc [T, H, D], m [T, H], l [T, H]) in fp32 (None: the first); the output is acc / l[..., None]. The
    sums of `triton_paged._decode_merge_kernel`, in torch: with M the greatest m so far, acc = sum 2^(m_s - M)
    acc_s and l likewise. A row with no key yet keeps m = -inf and sums 0. `acc` and the running sums are updated
    in place (a window's partials are as large as the running output: a chunk of 8,192 tokens over 32 heads of 192
    lanes is 200 MB of each)."""
    m_new, l_new = ml[..., 0], ml[..., 1]
    top = m_new.amax(-1)
    if running is not None:
        top = torch.maximum(top, running[1])
    base = torch.where(torch.isinf(top), torch.zeros_like(top), top)  # no key yet: every weight 2^-inf = 0
    weights = torch.exp2(m_new - base[..., None])
    total = acc.mul_(weights[..., None]).sum(2)
    sums = (l_new * weights).sum(-1)
    if running is not None:
        old = torch.exp2(running[1] - base)
        total = running[0].mul_(old[..., None]).add_(total)
        sums += running[2] * old
    return total, top, sums


def windowed_attention(
    q_nope: torch.Tensor, q_shared: torch.Tensor, kv_pool: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor,
    block_tables: torch.Tensor, context_lens_cpu: Sequence[int], window: int, partials: Partials,
) -> torch.Tensor:
    """The expanded attention [T, H, Dv] (in q's dtype) of a prefill whose contexts run in windows of `window` key
    positions (module docstring): per window, `expand_context` then `partials(query, pool, table, (lo, hi))` (the
    kernel's unmerged sums of those keys: `triton_paged.paged_prefill_partials`), folded by `merge_partials`."""
    running = None
    query = padded_query(q_nope, q_shared, scratch_width(w_uk.shape[1], q_shared.shape[-1], w_uv.shape[1]))
    for lo in range(0, max(context_lens_cpu), window):
        pool, table = expand_context(kv_pool, w_uk, w_uv, block_tables, context_lens_cpu, q_shared.shape[-1],
                                     (lo, lo + window))
        running = merge_partials(running, *partials(query, pool, table, (lo, lo + window)))
        del pool, table
    acc, _, sums = running
    return (acc[..., : w_uv.shape[1]] / sums[..., None]).to(q_nope.dtype)
