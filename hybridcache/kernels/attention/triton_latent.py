"""Latent attention on CUDA (Triton) over a pool of latent rows; same contract as `latent.latent_attention`, whose
docstring draws the rows' layout (a row's lanes [0, W) in the pool's keys half, [W, E) in its values half).

One kernel for prefill and decode (a CUDA prefill step runs expanded instead, `mla_prefill.py`, up to its cap:
this kernel's prefill serves longer contexts and captured graphs). The queries are flattened to rows of (token,
head), [T * H, E], so the H heads of a token, which all read the same latent rows, share every key tile (the heads
are the tensor cores' M side, as the query heads of a kv head are in the GQA decode kernel). A program takes BLOCK_M
such rows of one sequence and BLOCK_V of the R output lanes (program axis 0, so the programs of a block's output
lanes run side by side and read its key tiles from L2), walks the sequence's keys in blocks of BLOCK_N through the
block table with an online softmax in fp32 (exp2), scores over the E lanes BLOCK_E at a time, and sums its BLOCK_V
lanes of the rows' latents.

Worked example, H = 4, a sequence of 3 new tokens after 5 cached ones, BLOCK_M = 8: its 12 rows make two blocks;
block 0 holds rows 0-7 (tokens 0 and 1, positions 5 and 6, every head) and reads keys [0, 7); block 1 holds rows
8-11 (token 2, position 7) and rows 12-15 past the sequence (loaded as 0, never stored), and reads keys [0, 8).

Which sequence and block a program takes is read on the device: in a decode step (every sequence one token)
program p takes sequence p // ceil(H / BLOCK_M); otherwise each program counts the blocks of the sequences before
it from cu_seqlens (`_find_block`, a loop over the sequences). The host lengths only size the grid, so a CUDA graph
captured for more rows than a step has (`prefill_graphs.SequenceGraphs`: one sequence in a bucket of B rows) runs
its spare programs as empty ones.

Few programs over a long context (a decode step at a small batch: one program a sequence for Kimi's heads) would
leave most multiprocessors idle: their keys are cut into splits (`latent_splits`), one program each, whose partial
softmax sums the paged decode's merge kernel combines. The tiles come from one sweep (docs/bench.md, session 66).
fp32 inputs use IEEE fp32 dot products (not tf32), so fp32 runs match the reference to fp32 rounding.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from hybridcache.kernels import pdl
from hybridcache.kernels.attention.latent import check_latent_shapes
from hybridcache.kernels.attention.triton_paged import _MERGE_BLOCK_S, _decode_merge_kernel, num_sms

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


def latent_config(dtype: torch.dtype, decode_heads: int | None = None) -> LatentConfig:
    """The tiles for `dtype` (fp32 ones hold half as many values as bf16 ones), of a decode step when
    `decode_heads` (its head count) is given: H rows a sequence, so a block of rows is H rounded up to a power of
    two, at least 16 and at most the tile's (Kimi's 32 heads: 32 rows)."""
    if dtype == torch.float32:
        cfg = LatentConfig(block_m=32, block_n=32, block_e=32, block_v=64, num_warps=4)
    elif decode_heads is None:  # the fastest of session 66's and 68's sweeps at every prefill shape (docs/bench.md)
        return LatentConfig(block_m=32, block_n=64, block_e=32, block_v=512, num_warps=8)
    else:  # every output lane in one program: the scores once per row block (docs/bench.md, session 66's sweep)
        cfg = LatentConfig(block_m=32, block_n=32, block_e=64, block_v=512, num_warps=8)
    if decode_heads is None:
        return cfg
    return replace(cfg, block_m=max(16, min(cfg.block_m, triton.next_power_of_2(decode_heads))))


@triton.jit
def _lane_offsets(lanes, W: tl.constexpr, stride_kind):
    """A latent lane's offset from its row's start in the keys half: lanes < W there, the others in the values
    half (`stride_kind` further, at lane - W)."""
    return tl.where(lanes < W, lanes, stride_kind + lanes - W)


@triton.jit
def _find_block(cu_ptr, pid, num_seqs, H: tl.constexpr, BLOCK_M: tl.constexpr):
    """(sequence, block of its rows) of program `pid`, the blocks numbered sequence after sequence from the device
    lengths; sequence -1 for a program past the last block (a graph captured for more rows than the step has)."""
    seq = pid * 0 - 1
    block = pid * 0
    before = pid * 0  # the blocks of the sequences before i
    for i in range(0, num_seqs):
        count = ((tl.load(cu_ptr + i + 1) - tl.load(cu_ptr + i)) * H + BLOCK_M - 1) // BLOCK_M
        mine = (pid >= before) & (pid < before + count)
        seq = tl.where(mine, i, seq)
        block = tl.where(mine, pid - before, block)
        before += count
    return seq, block


@triton.jit(do_not_specialize=["num_splits", "num_seqs"])
def _latent_kernel(
    q_ptr, kv_ptr, out_ptr, acc_ptr, ml_ptr, bt_ptr, cu_ptr, ctx_ptr, num_seqs, qk_scale, num_splits,
    stride_kind, stride_page, stride_row, stride_bt,
    H: tl.constexpr, W: tl.constexpr, E: tl.constexpr, R: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_V: tl.constexpr,
    DECODE: tl.constexpr, PARTIAL: tl.constexpr, PRECISION: tl.constexpr,
):
    """One (output lanes, block of rows, key split) program. PARTIAL: the split-th of num_splits runs of whole key
    blocks of [0, last), cut from the device lengths; its unnormalised sums go to acc [T * H, splits, R] and
    (m, l) [T * H, splits, 2] for `triton_paged._decode_merge_kernel` (a split past a row's position leaves it
    m = -inf, l = 0). Otherwise every key of [0, last) and the normalised rows into out."""
    v_block = tl.program_id(0)
    pid = tl.program_id(1)
    split = tl.program_id(2)
    if DECODE:
        blocks_per_seq: tl.constexpr = (H + BLOCK_M - 1) // BLOCK_M
        seq = pid // blocks_per_seq
        block = pid % blocks_per_seq
        found = pid >= 0
    else:
        seq, block = _find_block(cu_ptr, pid, num_seqs, H, BLOCK_M)
        found = seq >= 0
        seq = tl.maximum(seq, 0)
    seq = seq.to(tl.int64)
    bos = tl.load(cu_ptr + seq).to(tl.int64)
    # (a program with no block: no row and no key)
    query_len = tl.where(found, (tl.load(cu_ptr + seq + 1) - tl.load(cu_ptr + seq)).to(tl.int32), 0)
    ctx = tl.where(found, tl.load(ctx_ptr + seq).to(tl.int32), 0)
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)  # (token, head) rows of the sequence: token rows // H
    row_ok = rows < query_len * H
    q_pos = ctx - query_len + rows // H
    q_rows = bos * H + rows.to(tl.int64)  # rows of q and out viewed [T * H, ...]
    last = tl.minimum(ctx, ctx - query_len + (block * BLOCK_M + BLOCK_M - 1) // H + 1)  # one past the last key seen
    lo = 0
    hi = last
    if PARTIAL:
        split_len = tl.cdiv(tl.cdiv(last, BLOCK_N), num_splits) * BLOCK_N
        lo = split * split_len
        hi = tl.minimum(lo + split_len, last)
    v_lanes = v_block * BLOCK_V + tl.arange(0, BLOCK_V)
    v_ok = v_lanes < R
    v_off = _lane_offsets(v_lanes, W, stride_kind)
    bt_row = bt_ptr + seq * stride_bt
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_V], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        keys_pos = start + tl.arange(0, BLOCK_N)
        key_ok = keys_pos < hi
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
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # a row that has seen no key yet (a split past its position) keeps m = -inf and sums 0, not NaN
        m_base = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_base)
        p = tl.exp2(s - m_base[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(kv_ptr + key_rows[:, None] + v_off[None, :], mask=key_ok[:, None] & v_ok[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    if PARTIAL:
        part = q_rows * num_splits + split
        tl.store(acc_ptr + part[:, None] * R + v_lanes[None, :], acc, mask=row_ok[:, None] & v_ok[None, :])
        first = row_ok & (rows * 0 + v_block == 0)  # (m, l) from the programs of the first lanes
        tl.store(ml_ptr + part * 2, m_i, mask=first)
        tl.store(ml_ptr + part * 2 + 1, l_i, mask=first)
    else:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # (a graph's padding sequence, context 0: no key, out 0)
        tl.store(out_ptr + q_rows[:, None] * R + v_lanes[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & v_ok[None, :])


# A key split covers at least this many keys: shorter runs cost more in partial sums than their programs gain
MIN_SPLIT_KEYS = 256
MAX_SPLITS = 128


def latent_splits(num_programs: int, max_context_len: int, num_sms: int) -> int:
    """Key splits per program: 1 when the (lanes, rows) programs already fill the multiprocessors, else as many as
    cover them about twice, each at least MIN_SPLIT_KEYS keys of the longest context, at most MAX_SPLITS. Host
    arithmetic only. Example: Kimi's decode (one program a sequence: 32 rows, all 512 lanes) on 132 SMs over
    100,000 keys: 1 sequence min(264, 390, 128) = 128 splits of ~780 keys; 64 sequences min(5, 390, 128) = 5; 132
    sequences or more, 1."""
    if num_programs >= num_sms:
        return 1
    wanted = -(-2 * num_sms // max(1, num_programs))
    return max(1, min(wanted, max_context_len // MIN_SPLIT_KEYS, MAX_SPLITS))


def latent_attention(
    q: torch.Tensor, kv_pool: torch.Tensor, block_tables: torch.Tensor, cu_seqlens: torch.Tensor,
    context_lens: torch.Tensor, query_lens_cpu: Sequence[int], max_context_len: int, *, scale: float, value_dim: int,
    config: LatentConfig | None = None, num_splits: int | None = None,
) -> torch.Tensor:
    """`latent.latent_attention` (q [T, H, E], a pool [2, pages, page, 1, W] -> [T, H, value_dim] in q's dtype);
    `context_lens` on the device, query_lens_cpu and max_context_len (the longest context, or more: a graph's
    capture passes max_model_len) on the host size the grid. num_splits: key splits (None: `latent_splits`). A
    decode step always writes partial sums and merges them (`triton_paged._decode_merge_kernel`), so a captured
    decode graph serves any context; other steps do only when split."""
    check_latent_shapes(q, kv_pool, value_dim)
    if not kv_pool.is_contiguous():
        raise ValueError("kv_pool must be contiguous")
    num_tokens, num_heads, latent_width = q.shape
    q = q.contiguous()
    out = q.new_empty(num_tokens, num_heads, value_dim)
    if num_tokens == 0:
        return out
    decode = all(length == 1 for length in query_lens_cpu)
    cfg = config or latent_config(q.dtype, num_heads if decode else None)
    if decode:
        num_blocks = len(query_lens_cpu) * triton.cdiv(num_heads, cfg.block_m)
    else:
        num_blocks = sum(triton.cdiv(length * num_heads, cfg.block_m) for length in query_lens_cpu)
    v_blocks = triton.cdiv(value_dim, cfg.block_v)
    if num_splits is None:
        num_splits = latent_splits(v_blocks * num_blocks, max_context_len, num_sms(q.device))
    partial = decode or num_splits > 1
    acc = ml = out  # (unread unless partial)
    if partial:
        acc = torch.empty(num_tokens, num_heads, num_splits, value_dim, dtype=torch.float32, device=q.device)
        ml = torch.empty(num_tokens, num_heads, num_splits, 2, dtype=torch.float32, device=q.device)
    _latent_kernel[(v_blocks, num_blocks, num_splits if partial else 1)](
        q, kv_pool, out, acc, ml, block_tables, cu_seqlens, context_lens, len(query_lens_cpu), scale * _LOG2E,
        num_splits,
        kv_pool.stride(0), kv_pool.stride(1), kv_pool.stride(2), block_tables.stride(0),
        H=num_heads, W=kv_pool.shape[-1], E=latent_width, R=value_dim, PAGE=kv_pool.shape[2],
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_E=cfg.block_e, BLOCK_V=cfg.block_v, DECODE=decode,
        PARTIAL=partial, PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=cfg.num_warps,
    )
    if partial:
        _decode_merge_kernel[(num_tokens, num_heads)](
            acc, ml, out, out.stride(0), out.stride(1), num_heads, num_splits, D=value_dim,
            D_PAD=triton.next_power_of_2(value_dim), BLOCK_S=_MERGE_BLOCK_S, **pdl.options(acc),
        )
    return out
