"""Paged causal GQA attention on CUDA (Triton) over one layer's KV pool; same contract as
`attention/reference.py` (`write_kv`, `paged_attention`).

Pool: kv_pool [2, num_pages, page, Hkv, D] (0 = keys, 1 = values); block_tables [S, P] lists each sequence's
pages; the new tokens of sequence i sit at positions [context_len - query_len, context_len).

Prefill (`paged_prefill_attention`, any query lengths): a flash-attention loop. One program per
(sequence, block of BLOCK_M queries, query head); it walks the sequence's keys in blocks of BLOCK_N,
finding each key's row through the block table (so a chunk that starts mid-page, or a cached prefix of any
length, needs nothing special), with an online softmax in fp32 (exp2). Key blocks wholly at or before the
block's first query position skip the causal mask; the rest are masked (key <= query position). A short chunk over
a long context (a few query blocks per head: 32 programs for 200 queries on 16 heads, 132 SMs) splits each
program's keys into runs of whole blocks, one program each (`_prefill_split_kernel`, `prefill_splits` picks the
count on the host; the runs are cut from the device lengths), whose partial sums the decode merge kernel combines.

Decode (`paged_decode_attention`, one query per sequence): split-KV ("flash decoding"). One program per
(sequence, kv head, split) handles all Hq/Hkv query heads of that kv head at once (the group is padded to 16
rows for the tensor cores), so each key/value byte is read once; a second launch merges the splits'
partial softmax sums. The number of splits is chosen on the host from the longest context so that the grid
covers the multiprocessors about twice; each sequence's own context is cut into that many runs of whole key
blocks on the device (a CUDA graph, captured for max_model_len, splits a 1,000-token context as finely as an
eager step would, instead of leaving all of it to the first split).

Any head dim D up to MAX_HEAD_DIM (`_head_lanes`): every tile spans D_PAD = D rounded up to a power of two lanes,
those past D masked: their loads of q, keys and values give 0 (nothing added to the scores, output columns 0) and
nothing is stored past D into the output or the fp32 partials (pool rows, q, out and partials are D wide). A
power-of-two D fills its tiles: the mask is a constant True that the compiler drops, so those launches compile as
unmasked ones (tests/kernels/test_hopper_compile.py checks that no lane compare is left). Head dim 24 (the hybrid
families' tiny test configs) runs in 32-lane tiles, 80 in 128, 192 in 256.

fp32 inputs use IEEE fp32 dot products (not tf32), so fp32 runs match the reference to fp32 rounding.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from hybridcache.kernels import pdl
from hybridcache.kernels.attention.triton_backend import HEAD_DIM_LIMIT, MAX_HEAD_DIM
from hybridcache.kernels.varlen import chunk_indices as make_chunk_indices

_LOG2E = 1.4426950408889634
# The merge reads the splits' maxima this many at a time, whatever their number (a block sized from the split count
# would compile one variant per power of two at run time; the result is the same, the max being exact).
_MERGE_BLOCK_S = 128


@dataclass(frozen=True)
class PrefillConfig:
    """Tile shape of the prefill kernel (BLOCK_N must divide nothing: keys are looked up row by row)."""

    block_m: int = 64
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2


def default_prefill_config(head_dim: int, dtype: torch.dtype) -> PrefillConfig:
    """Tiles for this head size (the tiles' width, a power of two: `paged_prefill_attention` passes the head dim
    rounded up) and dtype. bf16: 128 x 64 with 8 warps, the fastest of four tilings benchmarked at D = 256
    (docs/bench.md, "Figures behind the code's choices"); fp32 tiles are twice as wide in bytes, so smaller ones fit
    in shared memory."""
    if dtype == torch.float32:
        return PrefillConfig(block_m=32, block_n=32, num_warps=4, num_stages=1)
    return PrefillConfig(block_m=128, block_n=64, num_warps=8, num_stages=2)


@triton.jit
def _write_kv_kernel(kv_ptr, k_ptr, v_ptr, rows_ptr, stride_kind, stride_kt, stride_kh, stride_vt, stride_vh,
                     D: tl.constexpr, HD: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Token t's key and value [Hkv, D] -> row rows[t] of the pool's keys and values (int64 offsets: a pool's K|V
    halves may lie more than 2^31 elements apart); a negative row writes nothing."""
    pdl.start(PDL)
    t = tl.program_id(0).to(tl.int64)
    row = tl.load(rows_ptr + t).to(tl.int64)
    offsets = tl.arange(0, BLOCK)
    inside = offsets < HD * (row >= 0).to(tl.int32)  # (a negative row: no lane)
    head, dim = offsets // D, offsets % D
    key = tl.load(k_ptr + t * stride_kt + head * stride_kh + dim, mask=inside)
    value = tl.load(v_ptr + t * stride_vt + head * stride_vh + dim, mask=inside)
    tl.store(kv_ptr + row * HD + offsets, key, mask=inside)
    tl.store(kv_ptr + stride_kind + row * HD + offsets, value, mask=inside)


def write_kv(kv_pool: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, kv_rows: torch.Tensor) -> None:
    """keys, values [T, Hkv, D] -> kv_pool rows kv_rows [T] (page * page_size + offset), in place: one launch for
    both (converted to the pool's dtype first when they are not in it; an FP8 pool's bytes are copied as such). A
    negative row writes nothing (a graph's padding row)."""
    num_tokens, num_kv_heads, head_dim = keys.shape
    if num_tokens == 0:
        return
    keys, values = keys.to(kv_pool.dtype), values.to(kv_pool.dtype)
    if kv_pool.element_size() == 1:  # float8: moved as bytes
        kv_pool, keys, values = kv_pool.view(torch.uint8), keys.view(torch.uint8), values.view(torch.uint8)
    if keys.stride(-1) != 1 or values.stride(-1) != 1 or not kv_pool.is_contiguous():
        raise ValueError("keys and values need unit stride on their last dim and kv_pool must be contiguous")
    hd = num_kv_heads * head_dim
    _write_kv_kernel[(num_tokens,)](
        kv_pool, keys, values, kv_rows, kv_pool.stride(0), keys.stride(0), keys.stride(1), values.stride(0),
        values.stride(1), D=head_dim, HD=hd, BLOCK=triton.next_power_of_2(hd), num_warps=4, **pdl.options(kv_pool),
    )


@triton.jit
def _head_lanes(D: tl.constexpr, D_PAD: tl.constexpr):
    """A head's lanes: dims [D_PAD] (D rounded up to a power of two) and which are real, dims < D; a constant True
    when D == D_PAD, so the compiler drops every mask made of it (a power-of-two head compiles as unmasked)."""
    dims = tl.arange(0, D_PAD)
    if D == D_PAD:
        return dims, tl.full([D_PAD], 1, tl.int1)
    else:
        return dims, dims < D


@triton.jit
def _attend_block(
    acc, m_i, l_i, q, qk_scale, kv_ptr, bt_row_ptr, start, ctx, q_pos, dims, dim_ok, kv_head_off,
    stride_kind, stride_page, stride_row,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr, PRECISION: tl.constexpr,
    MAY_BE_EMPTY: tl.constexpr = False,
):
    """One key block of the online softmax; scores in log2 units (qk_scale = softmax scale * log2 e, times k_scale
    for an FP8 pool, whose keys and values are read as stored and converted to q's dtype; v_scale is applied to
    the output by the caller). MAY_BE_EMPTY: a row may have seen no key yet after this block (a key split past
    its position): its maximum stays -inf and its sums 0 instead of NaN. Lanes past the head dim (dim_ok False)
    load 0: they add nothing to the scores, and their output columns stay 0."""
    keys_pos = start + tl.arange(0, BLOCK_N)
    key_ok = keys_pos < ctx
    page = tl.load(bt_row_ptr + keys_pos // PAGE, mask=key_ok, other=0).to(tl.int64)
    rows = page * stride_page + (keys_pos % PAGE).to(tl.int64) * stride_row + kv_head_off
    lanes = key_ok[:, None] & dim_ok[None, :]
    k = tl.load(kv_ptr + rows[:, None] + dims[None, :], mask=lanes, other=0.0).to(q.dtype)
    v = tl.load(kv_ptr + stride_kind + rows[:, None] + dims[None, :], mask=lanes, other=0.0).to(q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    if MASK:
        ok = (keys_pos[None, :] <= q_pos[:, None]) & key_ok[None, :]
        s = tl.where(ok, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_base = m_new
    if MAY_BE_EMPTY:
        m_base = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_base)
    p = tl.exp2(s - m_base[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit
def _query_block(
    q_ptr, bt_ptr, cu_ptr, ctx_ptr, chunk_ptr, pid_m, head, stride_qt, stride_qh, stride_bt,
    GROUP: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """A prefill program's query block (chunk table entry `pid_m`: its sequence and block of BLOCK_M queries) for
    query head `head`: q [BLOCK_M, D_PAD] (0 past D), the head's lanes and which are real (`_head_lanes`), the
    rows' positions, their row indices and which are real, the sequence's context length, its kv head offset and
    block-table row, `last` (one past the last key any row sees) and `unmasked_end` (keys before it are <= every
    row's position, so need no causal mask)."""
    seq = tl.load(chunk_ptr + 2 * pid_m).to(tl.int64)
    block = tl.load(chunk_ptr + 2 * pid_m + 1)
    bos = tl.load(cu_ptr + seq).to(tl.int64)
    query_len = tl.load(cu_ptr + seq + 1) - tl.load(cu_ptr + seq)
    ctx = tl.load(ctx_ptr + seq)
    first_pos = ctx - query_len + block * BLOCK_M  # position of the block's first query
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)  # query index within the sequence
    row_ok = rows < query_len
    q_pos = first_pos + tl.arange(0, BLOCK_M)
    dims, dim_ok = _head_lanes(D, D_PAD)
    q = tl.load(q_ptr + (bos + rows)[:, None] * stride_qt + head * stride_qh + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    kv_head_off = (head // GROUP).to(tl.int64) * D
    bt_row_ptr = bt_ptr + seq * stride_bt
    last = tl.minimum(first_pos + BLOCK_M, ctx)
    unmasked_end = (first_pos + 1) // BLOCK_N * BLOCK_N
    return q, q_pos, dims, dim_ok, bos, rows, row_ok, ctx, kv_head_off, bt_row_ptr, last, unmasked_end


@triton.jit
def _prefill_kernel(
    q_ptr, kv_ptr, out_ptr, bt_ptr, cu_ptr, ctx_ptr, chunk_ptr, qk_scale, v_scale,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_kind, stride_page, stride_row, stride_bt,
    GROUP: tl.constexpr, PAGE: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    head = tl.program_id(1)
    q, q_pos, dims, dim_ok, bos, rows, row_ok, ctx, kv_head_off, bt_row_ptr, last, unmasked_end = _query_block(
        q_ptr, bt_ptr, cu_ptr, ctx_ptr, chunk_ptr, pid_m, head, stride_qt, stride_qh, stride_bt, GROUP, D, D_PAD,
        BLOCK_M, BLOCK_N)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    for start in range(0, unmasked_end, BLOCK_N):
        acc, m_i, l_i = _attend_block(acc, m_i, l_i, q, qk_scale, kv_ptr, bt_row_ptr, start, ctx, q_pos, dims,
                                      dim_ok, kv_head_off, stride_kind, stride_page, stride_row, PAGE, BLOCK_N, False,
                                      PRECISION)
    for start in range(unmasked_end, last, BLOCK_N):
        acc, m_i, l_i = _attend_block(acc, m_i, l_i, q, qk_scale, kv_ptr, bt_row_ptr, start, ctx, q_pos, dims,
                                      dim_ok, kv_head_off, stride_kind, stride_page, stride_row, PAGE, BLOCK_N, True,
                                      PRECISION)
    out = acc / l_i[:, None] * v_scale
    tl.store(out_ptr + (bos + rows)[:, None] * stride_ot + head * stride_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


@triton.jit(do_not_specialize=["num_splits", "key_lo", "key_hi"])
def _prefill_split_kernel(
    q_ptr, kv_ptr, acc_ptr, ml_ptr, bt_ptr, cu_ptr, ctx_ptr, chunk_ptr, qk_scale, v_scale, num_splits, key_lo, key_hi,
    stride_qt, stride_qh, stride_kind, stride_page, stride_row, stride_bt,
    GROUP: tl.constexpr, PAGE: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
):
    """`_prefill_kernel` over one of `num_splits` key ranges (program axis 2): the key blocks a query block sees
    within the window [key_lo, key_hi) of positions (key_lo a multiple of BLOCK_N; the block table is read only
    there), [key_lo, min(key_hi, last)), cut into equal runs of whole blocks from the device lengths (so a graph
    captured for a long context serves any); unnormalised partials acc (times v_scale), m, l for
    `_decode_merge_kernel` or `mla_prefill.merge_partials`. A split (or window) past a row's position leaves that row
    m = -inf, l = 0."""
    pid_m = tl.program_id(0)
    head = tl.program_id(1)
    split = tl.program_id(2)
    num_heads = tl.num_programs(1)
    q, q_pos, dims, dim_ok, bos, rows, row_ok, ctx, kv_head_off, bt_row_ptr, last, unmasked_end = _query_block(
        q_ptr, bt_ptr, cu_ptr, ctx_ptr, chunk_ptr, pid_m, head, stride_qt, stride_qh, stride_bt, GROUP, D, D_PAD,
        BLOCK_M, BLOCK_N)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    end = tl.minimum(key_hi, last)
    split_len = tl.cdiv(tl.cdiv(tl.maximum(end - key_lo, 0), BLOCK_N), num_splits) * BLOCK_N
    lo = key_lo + split * split_len
    hi = tl.minimum(lo + split_len, end)
    for start in range(lo, tl.minimum(unmasked_end, hi), BLOCK_N):
        acc, m_i, l_i = _attend_block(acc, m_i, l_i, q, qk_scale, kv_ptr, bt_row_ptr, start, ctx, q_pos, dims,
                                      dim_ok, kv_head_off, stride_kind, stride_page, stride_row, PAGE, BLOCK_N, False,
                                      PRECISION, True)
    for start in range(tl.maximum(unmasked_end, lo), hi, BLOCK_N):
        acc, m_i, l_i = _attend_block(acc, m_i, l_i, q, qk_scale, kv_ptr, bt_row_ptr, start, ctx, q_pos, dims,
                                      dim_ok, kv_head_off, stride_kind, stride_page, stride_row, PAGE, BLOCK_N, True,
                                      PRECISION, True)
    # partials: acc [T, Hq, splits, D], (m, l) [T, Hq, splits, 2]
    part = ((bos + rows) * num_heads + head) * num_splits + split
    tl.store(acc_ptr + part[:, None] * D + dims[None, :], acc * v_scale, mask=row_ok[:, None] & dim_ok[None, :])
    tl.store(ml_ptr + part * 2, m_i, mask=row_ok)
    tl.store(ml_ptr + part * 2 + 1, l_i, mask=row_ok)


@triton.jit
def _decode_split_kernel(
    q_ptr, kv_ptr, acc_ptr, ml_ptr, bt_ptr, ctx_ptr, qk_scale, v_scale,
    stride_qn, stride_qh, stride_kind, stride_page, stride_row, stride_bt,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, PAGE: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):
    """One (sequence, kv head, split) program: the split-th of num_splits equal runs of whole key blocks of this
    sequence's own context (cut from its device length, so a graph captured for the longest context keeps every
    split busy for any); partial sums for `_decode_merge_kernel` (a split past the context: m = -inf, l = 0)."""
    pdl.start(PDL)
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_kv_heads = tl.num_programs(1)
    num_splits = tl.num_programs(2)
    ctx = tl.load(ctx_ptr + seq)
    split_len = tl.cdiv(tl.cdiv(ctx, BLOCK_N), num_splits) * BLOCK_N
    lo = split * split_len
    hi = tl.minimum(lo + split_len, ctx)
    group = tl.arange(0, BLOCK_G)
    group_ok = group < GROUP
    heads = kv_head * GROUP + group
    dims, dim_ok = _head_lanes(D, D_PAD)
    q = tl.load(q_ptr + seq * stride_qn + heads[:, None] * stride_qh + dims[None, :],
                mask=group_ok[:, None] & dim_ok[None, :], other=0.0)
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, D_PAD], dtype=tl.float32)
    q_pos = tl.full([BLOCK_G], 0, dtype=tl.int32) + ctx - 1
    for start in range(lo, hi, BLOCK_N):
        acc, m_i, l_i = _attend_block(acc, m_i, l_i, q, qk_scale, kv_ptr, bt_ptr + seq * stride_bt, start, hi,
                                      q_pos, dims, dim_ok, kv_head.to(tl.int64) * D, stride_kind, stride_page,
                                      stride_row, PAGE, BLOCK_N, True, PRECISION)
    # partials: acc [N, Hq, splits, D], (m, l) [N, Hq, splits, 2]
    part = (seq * num_kv_heads * GROUP + heads) * num_splits + split
    tl.store(acc_ptr + part[:, None] * D + dims[None, :], acc * v_scale, mask=group_ok[:, None] & dim_ok[None, :])
    tl.store(ml_ptr + part * 2, m_i, mask=group_ok)
    tl.store(ml_ptr + part * 2 + 1, l_i, mask=group_ok)


@triton.jit(do_not_specialize=["num_splits"])  # with a fixed BLOCK_S: one variant for every split count
def _decode_merge_kernel(acc_ptr, ml_ptr, out_ptr, stride_on, stride_oh, num_heads, num_splits,
                         D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr):
    """out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s with M = max_s m_s (empty splits: m = -inf)."""
    pdl.start(PDL)
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    base = (seq * num_heads + head) * num_splits
    m_max = tl.full([BLOCK_S], float("-inf"), dtype=tl.float32)
    for first in range(0, num_splits, BLOCK_S):
        splits = first + tl.arange(0, BLOCK_S)
        m_max = tl.maximum(m_max, tl.load(ml_ptr + (base + splits) * 2, mask=splits < num_splits,
                                          other=float("-inf")))
    top = tl.max(m_max, axis=0)
    dims, dim_ok = _head_lanes(D, D_PAD)
    num = tl.zeros([D_PAD], dtype=tl.float32)
    den = tl.zeros([D_PAD], dtype=tl.float32)  # the same in every lane; a vector keeps the loop types fixed
    for split in range(0, num_splits):
        weight = tl.exp2(tl.load(ml_ptr + (base + split) * 2) - top)
        den += weight * tl.load(ml_ptr + (base + split) * 2 + 1)
        num += weight * tl.load(acc_ptr + (base + split) * D + dims, mask=dim_ok, other=0.0)
    tl.store(out_ptr + seq * stride_on + head * stride_oh + dims, (num / den).to(out_ptr.dtype.element_ty),
             mask=dim_ok)


@functools.cache
def num_sms(device: torch.device) -> int:
    """The device's multiprocessors, read once a device (64 off CUDA: the interpreter's runs); what the split
    counts of these kernels and of `triton_latent` cover."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 64


def _precision(dtype: torch.dtype) -> str:
    """IEEE fp32 products for fp32 inputs (Triton's default would be tf32); bf16/fp16 ignore it."""
    return "ieee" if dtype == torch.float32 else "tf32"


def _check(q: torch.Tensor, kv_pool: torch.Tensor) -> None:
    if kv_pool.dtype not in (q.dtype, torch.float8_e4m3fn):
        raise ValueError(f"kv_pool must be in q's dtype {q.dtype} or float8_e4m3fn, got {kv_pool.dtype}")
    head_dim = q.shape[-1]
    if kv_pool.shape[-1] != head_dim:
        raise ValueError(f"q's head dim {head_dim} must match the pool's {kv_pool.shape[-1]}")
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(f"head dim {head_dim} is over {MAX_HEAD_DIM}: {HEAD_DIM_LIMIT}")
    if q.stride(-1) != 1 or not kv_pool.is_contiguous():
        raise ValueError("q needs unit stride on its last dim and kv_pool must be contiguous")


def _output(q: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """The attention's output: `out` when given (q's shape and dtype, unit stride on D, any other strides; only its
    [.., :D] entries are written), else a new tensor like q."""
    if out is None:
        return torch.empty_like(q)
    if out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError(f"out must be {list(q.shape)} in {q.dtype} with unit stride on its last dim, got "
                         f"{list(out.shape)} in {out.dtype}")
    return out


def paged_prefill_attention(
    q: torch.Tensor,
    kv_pool: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens: torch.Tensor,
    context_lens: torch.Tensor,
    query_lens_cpu: Sequence[int],
    *,
    scale: float,
    config: PrefillConfig | None = None,
    chunk_indices: torch.Tensor | None = None,
    kv_scales: tuple[float, float] = (1.0, 1.0),
    num_splits: int = 1,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Varlen causal attention: q [T, Hq, D] -> [T, Hq, D] in q's dtype (new K/V already in the pool).

    kv_pool in q's dtype, or float8_e4m3fn read as stored x kv_scales (k_scale, v_scale).

    cu_seqlens [S+1], context_lens [S], block_tables [S, P] on the device; query_lens_cpu gives the grid;
    chunk_indices: `varlen.chunk_indices(cu_seqlens, query_lens_cpu, config.block_m)` if already built.
    num_splits > 1: each (query block, head) program's keys are cut into that many runs, each its own program
    (`_prefill_split_kernel`), and the partial softmax sums merged per row (`_decode_merge_kernel`): short queries
    over a long context fill the multiprocessors (`prefill_splits` picks the count).
    out: written instead of a new tensor (`_output`).
    """
    _check(q, kv_pool)
    num_tokens, num_heads, head_dim = q.shape
    out = _output(q, out)
    if num_tokens == 0:
        return out
    cfg = _prefill_config(q, config)
    table = make_chunk_indices(cu_seqlens, query_lens_cpu, cfg.block_m) if chunk_indices is None else chunk_indices
    if num_splits <= 1:
        _prefill_kernel[(table.shape[0], num_heads)](
            q, kv_pool, out, block_tables, cu_seqlens, context_lens, table, scale * _LOG2E * kv_scales[0],
            kv_scales[1], q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            kv_pool.stride(0), kv_pool.stride(1), kv_pool.stride(2), block_tables.stride(0),
            **_prefill_geometry(q, kv_pool, cfg),
        )
        return out
    partial, ml = _split_partials(q, kv_pool, block_tables, cu_seqlens, context_lens, table, cfg,
                                  scale * _LOG2E * kv_scales[0], kv_scales[1], num_splits, (0, _NO_KEY_LIMIT))
    _decode_merge_kernel[(num_tokens, num_heads)](
        partial, ml, out, out.stride(0), out.stride(1), num_heads, num_splits, D=head_dim,
        D_PAD=triton.next_power_of_2(head_dim),
        BLOCK_S=_MERGE_BLOCK_S, **pdl.options(partial),
    )
    return out


_NO_KEY_LIMIT = 2**31 - 1


def paged_prefill_partials(
    q: torch.Tensor,
    kv_pool: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens: torch.Tensor,
    context_lens: torch.Tensor,
    query_lens_cpu: Sequence[int],
    *,
    scale: float,
    key_window: tuple[int, int],
    num_splits: int = 1,
    config: PrefillConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`paged_prefill_attention`'s arguments (q and the pool in one dtype), the keys at positions in `key_window`
    [lo, hi) only (lo and hi multiples of the config's block_n: the kernel reads whole key blocks, and the block
    table only for pages inside the window), left
    unmerged: (acc [T, Hq, num_splits, D], ml [T, Hq, num_splits, 2]) in fp32, each split's unnormalised output
    and its (max score, sum of exp2(score - max)) in log2 units. A row that sees no key there has m = -inf, l = 0.
    `mla_prefill.merge_partials` folds windows together (MLA's windowed prefill)."""
    _check(q, kv_pool)
    cfg = _prefill_config(q, config)
    if key_window[0] % cfg.block_n or key_window[1] % cfg.block_n:
        raise ValueError(f"the key window [{key_window[0]}, {key_window[1]}) must start and end on multiples of "
                         f"block_n {cfg.block_n}")
    table = make_chunk_indices(cu_seqlens, query_lens_cpu, cfg.block_m)
    return _split_partials(q, kv_pool, block_tables, cu_seqlens, context_lens, table, cfg, scale * _LOG2E, 1.0,
                           num_splits, key_window)


def _prefill_config(q: torch.Tensor, config: PrefillConfig | None) -> PrefillConfig:
    """The prefill kernels' tiles: `config`, or the default for q's head dim rounded up to a power of two and dtype."""
    return config or default_prefill_config(triton.next_power_of_2(q.shape[-1]), q.dtype)


def _prefill_geometry(q: torch.Tensor, kv_pool: torch.Tensor, cfg: PrefillConfig) -> dict:
    """The prefill kernels' compile-time arguments and launch options for these tiles."""
    return dict(GROUP=q.shape[1] // kv_pool.shape[3], PAGE=kv_pool.shape[2], D=q.shape[-1],
                D_PAD=triton.next_power_of_2(q.shape[-1]), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                PRECISION=_precision(q.dtype), num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def _split_partials(q, kv_pool, block_tables, cu_seqlens, context_lens, table, cfg, qk_scale, v_scale,
                    num_splits, key_window) -> tuple[torch.Tensor, torch.Tensor]:
    num_tokens, num_heads, head_dim = q.shape
    partial = torch.empty(num_tokens, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
    ml = torch.empty(num_tokens, num_heads, num_splits, 2, dtype=torch.float32, device=q.device)
    _prefill_split_kernel[(table.shape[0], num_heads, num_splits)](
        q, kv_pool, partial, ml, block_tables, cu_seqlens, context_lens, table, qk_scale, v_scale, num_splits,
        key_window[0], min(key_window[1], _NO_KEY_LIMIT), q.stride(0), q.stride(1),
        kv_pool.stride(0), kv_pool.stride(1), kv_pool.stride(2), block_tables.stride(0),
        **_prefill_geometry(q, kv_pool, cfg),
    )
    return partial, ml


# A split of the prefill kernel's keys covers at least this many: shorter runs cost more in partial sums written and
# merged than their programs gain (the attention of a chunk over a short context is small anyway).
MIN_SPLIT_KEYS = 1024
MAX_PREFILL_SPLITS = 16


def prefill_splits(num_programs: int, max_context_len: int, num_sms: int) -> int:
    """Key splits per program of the prefill kernel (`paged_prefill_attention`'s num_splits): 1 when its
    (query block, head) programs already fill half the multiprocessors or the longest context is under two
    MIN_SPLIT_KEYS; else as many as keep the programs within one wave (a bf16 program of 128 x 256 fp32
    accumulators fills an SM's registers: one at a time per SM), each split at least MIN_SPLIT_KEYS keys, at most
    MAX_PREFILL_SPLITS. Host arithmetic only. Measured on the H200 (docs/bench.md, issue 32, "split-K"): 32
    programs over 16,200 keys 0.709 ms unsplit, 0.256 ms in 4 splits (2 to 16 splits: 0.256-0.428 ms); 128
    programs in 2 splits were slower (0.202 -> 0.264 ms over 3,900 keys).

    Example: next-1b's + 200 request, 2 query blocks of 128 x 16 heads = 32 programs over 16,200 keys on 132 SMs:
    min(132 // 32 = 4, 16,200 // 1,024 = 15, 16) = 4 splits of ~4,000 keys; phase A's 960 new tokens over 3,900
    keys: 8 x 16 = 128 programs, 1.
    """
    if 2 * num_programs > num_sms or max_context_len < 2 * MIN_SPLIT_KEYS:
        return 1
    wanted = num_sms // max(1, num_programs)
    return max(1, min(wanted, max_context_len // MIN_SPLIT_KEYS, MAX_PREFILL_SPLITS))


@dataclass(frozen=True)
class DecodeLaunch:
    """The decode split kernel's launch: warps, software-pipeline stages, and how many times over its (sequence,
    kv head, split) programs cover the multiprocessors (`decode_splits`)."""

    num_warps: int = 4
    num_stages: int = 2
    coverage: int = 2


def decode_splits(
    num_seqs: int, num_kv_heads: int, max_context_len: int, block_n: int, num_sms: int, coverage: int = 2,
) -> tuple[int, int]:
    """(num_splits, split_len): enough (sequence, kv head, split) programs to cover the multiprocessors about
    `coverage` times, each split a whole number of key blocks, split_len those of the longest context's (the
    kernel cuts each sequence's own context into num_splits runs of whole blocks: split_len for the longest). Host
    arithmetic only.

    Example: 1 sequence, 2 kv heads, 16,000 keys, blocks of 64, 132 SMs -> 132 splits wanted, 250 key blocks,
    so splits of 2 blocks (128 keys): (125, 128).
    """
    sms = num_sms
    blocks = max(1, -(-max_context_len // block_n))
    wanted = max(1, math.ceil(coverage * sms / max(1, num_seqs * num_kv_heads)))
    splits = min(wanted, blocks)
    split_len = -(-blocks // splits) * block_n
    return -(-max_context_len // split_len) if max_context_len else 1, split_len


def paged_decode_attention(
    q: torch.Tensor,
    kv_pool: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    max_context_len: int,
    *,
    scale: float,
    block_n: int = 64,
    kv_scales: tuple[float, float] = (1.0, 1.0),
    launch: DecodeLaunch | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query per sequence: q [N, Hq, D] at position context_len - 1 -> [N, Hq, D] in q's dtype.

    max_context_len: the largest context_len, from the host (sets the number of splits; an upper bound will do).
    kv_pool in q's dtype, or float8_e4m3fn read as stored x kv_scales (k_scale, v_scale). launch: the split kernel's
    launch (None: the default `DecodeLaunch`; `benchmarks/attention_decode_sweep.py` times others). out: written
    instead of a new tensor (`_output`; a mixed step's leading rows of the prefill kernel's output, `triton_backend`).
    """
    _check(q, kv_pool)
    num, num_heads, head_dim = q.shape
    num_kv_heads = kv_pool.shape[3]
    group = num_heads // num_kv_heads
    out = _output(q, out)
    if num == 0:
        return out
    launch = launch or DecodeLaunch()
    d_pad = triton.next_power_of_2(head_dim)
    if q.dtype == torch.float32:
        block_n = min(block_n, 32)
    sms = num_sms(q.device)
    num_splits, _ = decode_splits(num, num_kv_heads, max_context_len, block_n, sms, launch.coverage)
    partial = torch.empty(num, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
    ml = torch.empty(num, num_heads, num_splits, 2, dtype=torch.float32, device=q.device)
    _decode_split_kernel[(num, num_kv_heads, num_splits)](
        q, kv_pool, partial, ml, block_tables, context_lens, scale * _LOG2E * kv_scales[0], kv_scales[1],
        q.stride(0), q.stride(1), kv_pool.stride(0), kv_pool.stride(1), kv_pool.stride(2), block_tables.stride(0),
        GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), PAGE=kv_pool.shape[2], D=head_dim,
        D_PAD=d_pad, BLOCK_N=block_n, PRECISION=_precision(q.dtype), num_warps=launch.num_warps,
        num_stages=launch.num_stages, **pdl.options(q),
    )
    _decode_merge_kernel[(num, num_heads)](
        partial, ml, out, out.stride(0), out.stride(1), num_heads, num_splits,
        D=head_dim, D_PAD=d_pad, BLOCK_S=_MERGE_BLOCK_S,
        **pdl.options(partial),
    )
    return out


def paged_attention(
    q: torch.Tensor,
    kv_pool: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens: torch.Tensor,
    context_lens: torch.Tensor,
    query_lens_cpu: Sequence[int],
    context_lens_cpu: Sequence[int],
    *,
    scale: float,
    kv_scales: tuple[float, float] = (1.0, 1.0),
    num_splits: int = 1,
) -> torch.Tensor:
    """Any batch (the reference `paged_attention` contract): all-decode batches take the split-KV decode
    kernel, others the prefill kernel for every sequence (`num_splits` key splits)."""
    if all(length == 1 for length in query_lens_cpu):
        return paged_decode_attention(q, kv_pool, block_tables, context_lens, max(context_lens_cpu), scale=scale,
                                      kv_scales=kv_scales)
    return paged_prefill_attention(q, kv_pool, block_tables, cu_seqlens, context_lens, query_lens_cpu, scale=scale,
                                   kv_scales=kv_scales, num_splits=num_splits)
