"""Latent attention on CUDA (Triton) over a pool of latent rows; same contract as `latent.latent_attention`, whose
docstring draws the rows' layout (a row's lanes [0, W) in the pool's keys half, [W, E) in its values half).

One kernel for prefill and decode. The queries are flattened to rows of (token, head), [T * H, E], so the H heads
of a token, which all read the same latent rows, share every key tile (the heads are the tensor cores' M side, as
the query heads of a kv head are in the GQA decode kernel). A program takes BLOCK_M such rows of one sequence and
BLOCK_V of the R output lanes (program axis 0, so the programs of a block's output lanes run side by side and read
its key tiles from L2), walks the sequence's keys in blocks of BLOCK_N through the block table with an online softmax
in fp32 (exp2), scores over the E lanes BLOCK_E at a time, and sums its BLOCK_V lanes of the rows' latents.

Worked example, H = 4, a sequence of 3 new tokens after 5 cached ones, BLOCK_M = 8: its 12 rows make two blocks;
block 0 holds rows 0-7 (tokens 0 and 1, positions 5 and 6, every head) and reads keys [0, 7); block 1 holds rows
8-11 (token 2, position 7) and rows 12-15 past the sequence (loaded as 0, never stored), and reads keys [0, 8).

Decode (every sequence one token) needs no block table of (sequence, block) pairs: program p takes sequence
p // ceil(H / BLOCK_M), so a CUDA graph's launch is fixed by the batch size. Otherwise the pairs come from
`varlen.chunk_indices` over the rows (cu_seqlens x H).

Not done: key splits for a few long contexts (one program per block of rows walks all its keys), tuned tiles.
fp32 inputs use IEEE fp32 dot products (not tf32), so fp32 runs match the reference to fp32 rounding.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from hybridcache.kernels.attention.latent import check_latent_shapes
from hybridcache.kernels.varlen import chunk_indices

_LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class LatentConfig:
    """Tiles: BLOCK_M rows of (token, head), BLOCK_N keys, BLOCK_E score lanes a step, BLOCK_V output lanes a
    program (each at least 16: the tensor cores' smallest tile)."""

    block_m: int
    block_n: int
    block_e: int
    block_v: int
    num_warps: int


def latent_config(dtype: torch.dtype) -> LatentConfig:
    """fp32 tiles are half as many values as bf16 ones (untuned: docs/bench.md has no figures for this kernel)."""
    if dtype == torch.float32:
        return LatentConfig(block_m=32, block_n=32, block_e=32, block_v=64, num_warps=4)
    return LatentConfig(block_m=64, block_n=64, block_e=64, block_v=128, num_warps=8)


@triton.jit
def _lane_offsets(lanes, W: tl.constexpr, stride_kind):
    """A latent lane's offset from its row's start in the keys half: lanes < W there, the others in the values
    half (`stride_kind` further, at lane - W)."""
    return tl.where(lanes < W, lanes, stride_kind + lanes - W)


@triton.jit
def _latent_kernel(
    q_ptr, kv_ptr, out_ptr, bt_ptr, cu_ptr, ctx_ptr, chunk_ptr, qk_scale,
    stride_kind, stride_page, stride_row, stride_bt,
    H: tl.constexpr, W: tl.constexpr, E: tl.constexpr, R: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_V: tl.constexpr,
    DECODE: tl.constexpr, PRECISION: tl.constexpr,
):
    v_block = tl.program_id(0)
    pid = tl.program_id(1)
    if DECODE:
        blocks_per_seq: tl.constexpr = (H + BLOCK_M - 1) // BLOCK_M
        seq = (pid // blocks_per_seq).to(tl.int64)
        block = pid % blocks_per_seq
    else:
        seq = tl.load(chunk_ptr + 2 * pid).to(tl.int64)
        block = tl.load(chunk_ptr + 2 * pid + 1)
    bos = tl.load(cu_ptr + seq).to(tl.int64)
    query_len = (tl.load(cu_ptr + seq + 1) - tl.load(cu_ptr + seq)).to(tl.int32)
    ctx = tl.load(ctx_ptr + seq).to(tl.int32)
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)  # (token, head) rows of the sequence: token rows // H
    row_ok = rows < query_len * H
    q_pos = ctx - query_len + rows // H
    q_rows = bos * H + rows.to(tl.int64)  # rows of q and out viewed [T * H, ...]
    last = tl.minimum(ctx, ctx - query_len + (block * BLOCK_M + BLOCK_M - 1) // H + 1)  # one past the last key seen
    v_lanes = v_block * BLOCK_V + tl.arange(0, BLOCK_V)
    v_ok = v_lanes < R
    v_off = _lane_offsets(v_lanes, W, stride_kind)
    bt_row = bt_ptr + seq * stride_bt
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_V], dtype=tl.float32)
    for start in range(0, last, BLOCK_N):
        keys_pos = start + tl.arange(0, BLOCK_N)
        key_ok = keys_pos < last
        page = tl.load(bt_row + keys_pos // PAGE, mask=key_ok, other=0).to(tl.int64)
        key_rows = page * stride_page + (keys_pos % PAGE).to(tl.int64) * stride_row
        s = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for first in tl.static_range(0, E, BLOCK_E):
            lanes = first + tl.arange(0, BLOCK_E)
            lane_ok = lanes < E
            q = tl.load(q_ptr + q_rows[:, None] * E + lanes[None, :], mask=row_ok[:, None] & lane_ok[None, :],
                        other=0.0)
            k = tl.load(kv_ptr + key_rows[:, None] + _lane_offsets(lanes, W, stride_kind)[None, :],
                        mask=key_ok[:, None] & lane_ok[None, :], other=0.0)
            s += tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION)
        s = tl.where((keys_pos[None, :] <= q_pos[:, None]) & key_ok[None, :], s * qk_scale, float("-inf"))
        # key 0 is in the first block and every row sees it (q_pos >= 0), so m_new is finite from the first block on
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(kv_ptr + key_rows[:, None] + v_off[None, :], mask=key_ok[:, None] & v_ok[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # (a graph's padding sequence, context 0: no key, out 0)
    tl.store(out_ptr + q_rows[:, None] * R + v_lanes[None, :], out.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & v_ok[None, :])


def latent_attention(
    q: torch.Tensor, kv_pool: torch.Tensor, block_tables: torch.Tensor, cu_seqlens: torch.Tensor,
    context_lens: torch.Tensor, query_lens_cpu: Sequence[int], *, scale: float, value_dim: int,
    config: LatentConfig | None = None,
) -> torch.Tensor:
    """`latent.latent_attention` (q [T, H, E], a pool [2, pages, page, 1, W] -> [T, H, value_dim] in q's dtype) in
    one launch; `context_lens` on the device (query_lens_cpu sizes the grid)."""
    check_latent_shapes(q, kv_pool, value_dim)
    if not kv_pool.is_contiguous():
        raise ValueError("kv_pool must be contiguous")
    num_tokens, num_heads, latent_width = q.shape
    q = q.contiguous()
    out = q.new_empty(num_tokens, num_heads, value_dim)
    if num_tokens == 0:
        return out
    cfg = config or latent_config(q.dtype)
    decode = all(length == 1 for length in query_lens_cpu)
    if decode:
        table = cu_seqlens  # (unread)
        num_blocks = len(query_lens_cpu) * triton.cdiv(num_heads, cfg.block_m)
    else:
        table = chunk_indices(cu_seqlens * num_heads, [length * num_heads for length in query_lens_cpu], cfg.block_m)
        num_blocks = table.shape[0]
    grid = (triton.cdiv(value_dim, cfg.block_v), num_blocks)
    _latent_kernel[grid](
        q, kv_pool, out, block_tables, cu_seqlens, context_lens, table, scale * _LOG2E,
        kv_pool.stride(0), kv_pool.stride(1), kv_pool.stride(2), block_tables.stride(0),
        H=num_heads, W=kv_pool.shape[-1], E=latent_width, R=value_dim, PAGE=kv_pool.shape[2],
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_E=cfg.block_e, BLOCK_V=cfg.block_v, DECODE=decode,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=cfg.num_warps,
    )
    return out
