"""MLA prefill over expanded keys and values: a step's contexts up-projected from their cached latent rows into a
scratch pool of every head's keys and values, so that the paged GQA prefill kernel runs them (`KimiMLA` on CUDA).

Absorbed attention (`latent.py`) scores E = 576 lanes and sums R = 512 a (query, key) pair and head, against the
expanded 192 and 128: 3.4x the arithmetic, which a prefill, unlike a decode step, is bound by (docs/bench.md,
"Kimi's MLA over latent rows, absorbed against expanded", has the figures). Up-projecting the context costs one
GEMM of its rows (C x R x H x (Dn + Dv)) and a scratch pool of 2 x H x max(Dn + Dr, Dv) values a context token
(24 KiB in bf16 at Kimi's widths), so a step expands only while its contexts total at most `EXPAND_MAX_TOKENS`
(768 MiB of scratch at Kimi's widths in bf16, and one up-projection's output, 256 MiB, while it is filled); past
that, and in a captured CUDA graph (whose host lengths are not the replay's), the step runs absorbed.

Worked example, two sequences with contexts 5 and 17 (pages of 16): the scratch pool has ceil(5/16) + ceil(17/16)
= 3 pages; sequence 0's keys fill page 0 (rows 5-15 unused), sequence 1's pages 1 and 2; the block table is
[[0, -], [1, 2]]. Every key of a context is expanded, cached and new alike; the kernel masks keys past each query.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F  # noqa: N812

from hybridcache.kernels.attention.latent import gather_rows

# The contexts a step may expand in all (scratch: 2 x H x width values a token; 768 MiB at Kimi's widths in bf16)
EXPAND_MAX_TOKENS = 32_768


def expands(query_lens_cpu: Sequence[int], context_lens_cpu: Sequence[int]) -> bool:
    """Whether a step runs expanded: not a decode step (every sequence one token: absorbed reads 21x fewer bytes),
    its contexts at most `EXPAND_MAX_TOKENS` in all, and not inside a CUDA graph capture."""
    if all(length == 1 for length in query_lens_cpu) or sum(context_lens_cpu) > EXPAND_MAX_TOKENS:
        return False
    return not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def expand_context(
    kv_pool: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor, block_tables: torch.Tensor,
    context_lens_cpu: Sequence[int], shared_width: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every sequence's context up-projected (module docstring): (scratch pool [2, pages, page, H, width], its block
    table [S, P] int32), width = max(Dn + Dr, Dv); keys [W_UK_h c | k_shared] and values W_UV_h c, both zero-padded
    to width. kv_pool: a layer's pool of latent rows [2, num_pages, page, 1, ceil(E / 2)]; w_uk [H, Dn, R], w_uv
    [H, Dv, R]; shared_width: Dr (E = R + Dr)."""
    heads, nope, rank = w_uk.shape
    value_dim = w_uv.shape[1]
    width = max(nope + shared_width, value_dim)
    page = kv_pool.shape[2]
    pages = [-(-length // page) for length in context_lens_cpu]
    rows = torch.cat([F.pad(gather_rows(kv_pool, block_tables[i], length, rank + shared_width),
                            (0, 0, 0, count * page - length))
                      for i, (length, count) in enumerate(zip(context_lens_cpu, pages, strict=True))])
    latent, num_rows = rows[:, :rank], rows.shape[0]
    pool = rows.new_zeros(2, num_rows, heads, width)  # filled in place: the scratch and one GEMM's output at a time
    pool[0, :, :, :nope] = (latent @ w_uk.reshape(heads * nope, rank).T).view(num_rows, heads, nope)
    pool[0, :, :, nope: nope + shared_width] = rows[:, None, rank:]
    pool[1, :, :, :value_dim] = (latent @ w_uv.reshape(heads * value_dim, rank).T).view(num_rows, heads, value_dim)
    table = torch.zeros(len(pages), max(pages, default=1), dtype=torch.int32)
    start = 0
    for i, count in enumerate(pages):
        table[i, :count] = torch.arange(start, start + count, dtype=torch.int32)
        start += count
    return pool.view(2, start, page, heads, width), table.to(kv_pool.device)


def padded_query(q_nope: torch.Tensor, q_shared: torch.Tensor, width: int) -> torch.Tensor:
    """[q_nope | q_shared] [T, H, Dn + Dr], zero-padded to the scratch pool's width."""
    query = torch.cat([q_nope, q_shared], dim=-1)
    return F.pad(query, (0, width - query.shape[-1]))
