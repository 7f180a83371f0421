"""Torch reference of paged attention: the KV write to flat KV rows (`kv_rows`) and causal GQA attention over
block tables (softmax in fp32, like transformers' eager attention).

Notation: T new tokens, Hq / Hkv query / key-value heads, D head dim; a layer's pool is
[2, num_pages, kernel_block_size, Hkv, D] (0 = keys, 1 = values).
"""

from __future__ import annotations

import torch


def write_kv(
    kv_pool: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, kv_rows: torch.Tensor
) -> None:
    """Write new keys/values into one layer's paged KV pool, in place.

    kv_pool      [2, num_pages, kernel_block_size, Hkv, D]   (0 = keys, 1 = values)
    keys, values [T, Hkv, D]
    kv_rows      [T] int64   flat row page * kernel_block_size + offset of each token; a negative row: the token
                             is not written (a graph's padding row)
    """
    flat = kv_pool.view(2, -1, *kv_pool.shape[3:])
    keep = kv_rows >= 0
    flat[0, kv_rows[keep]] = keys[keep].to(kv_pool.dtype)
    flat[1, kv_rows[keep]] = values[keep].to(kv_pool.dtype)


def dequantize_kv(kv: torch.Tensor, dtype: torch.dtype, kv_scales: tuple[float, float]) -> torch.Tensor:
    """[2, ...] keys and values read from the pool -> `dtype`: an FP8 pool's values times their layer's (k_scale,
    v_scale); a pool already in `dtype` as it is."""
    if kv.dtype == dtype:
        return kv
    k_scale, v_scale = kv_scales
    return torch.stack([kv[0].to(dtype) * k_scale, kv[1].to(dtype) * v_scale])


def gather_kv(
    kv_pool: torch.Tensor, pages: torch.Tensor, context_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of positions [0, context_len) of one sequence.

    kv_pool [2, num_pages, kernel_block_size, Hkv, D]; pages [P] int (the sequence's block-table row)
    returns keys, values [context_len, Hkv, D]
    """
    block = kv_pool.shape[2]
    used = pages[: -(-context_len // block)].long()
    kv = kv_pool[:, used].reshape(2, -1, *kv_pool.shape[3:])[:, :context_len]
    return kv[0], kv[1]


def paged_attention(
    q: torch.Tensor,
    kv_pool: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens: torch.Tensor,
    query_lens: tuple[int, ...],
    context_lens: tuple[int, ...],
    *,
    scale: float,
    kv_scales: tuple[float, float] = (1.0, 1.0),
) -> torch.Tensor:
    """Causal GQA attention of a varlen batch over a paged KV pool (its new K/V already written).

    q            [T, Hq, D]    queries of all sequences, concatenated
    kv_pool      [2, num_pages, kernel_block_size, Hkv, D]
    block_tables [S, P] int32  kernel pages of each sequence
    cu_seqlens   [S + 1]       query rows of sequence i: cu_seqlens[i]:cu_seqlens[i+1]
    query_lens, context_lens   per-sequence host ints; the new tokens sit at positions
                               [context_len - query_len, context_len)
    kv_scales    (k_scale, v_scale) of an FP8 pool (`dequantize_kv`)
    returns      [T, Hq, D] in q's dtype

    Query head h reads kv head h // (Hq / Hkv). Query at position p sees keys at positions <= p
    (softmax in fp32, like transformers' eager attention). Sequences with one query token (decode) are
    computed together by `paged_decode_attention`; the others one by one.
    """
    out = torch.empty_like(q)
    num_q_heads, num_kv_heads = q.shape[1], kv_pool.shape[3]
    group = num_q_heads // num_kv_heads
    starts = cu_seqlens.tolist()
    decode_ids = [i for i, query_len in enumerate(query_lens) if query_len == 1]
    if decode_ids:
        rows = torch.tensor([starts[i] for i in decode_ids], device=q.device)
        lens = torch.tensor([context_lens[i] for i in decode_ids], device=q.device)
        out[rows] = paged_decode_attention(q[rows], kv_pool, block_tables[decode_ids], lens, scale=scale,
                                           kv_scales=kv_scales)
    for i, (query_len, context_len) in enumerate(zip(query_lens, context_lens, strict=True)):
        if query_len == 1:
            continue
        rows = slice(starts[i], starts[i] + query_len)
        keys, values = dequantize_kv(torch.stack(gather_kv(kv_pool, block_tables[i], context_len)), q.dtype, kv_scales)
        keys = keys.repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, ctx, D]
        values = values.repeat_interleave(group, dim=1).transpose(0, 1)
        query = q[rows].transpose(0, 1)  # [Hq, qlen, D]
        scores = (query @ keys.transpose(-1, -2)) * scale
        query_pos = torch.arange(context_len - query_len, context_len, device=q.device)
        key_pos = torch.arange(context_len, device=q.device)
        scores = scores.masked_fill(key_pos[None, :] > query_pos[:, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out[rows] = (probs @ values).transpose(0, 1)
    return out


def paged_decode_attention(
    q: torch.Tensor, kv_pool: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor, *, scale: float,
    kv_scales: tuple[float, float] = (1.0, 1.0),
) -> torch.Tensor:
    """One query token per sequence, N sequences at once, over the paged pool.

    q [N, Hq, D] (the token at position context_len - 1 of each sequence); kv_pool [2, num_pages,
    kernel_block_size, Hkv, D]; block_tables [N, P]; context_lens [N] -> [N, Hq, D] in q's dtype.
    Keys are gathered for P * kernel_block_size positions per sequence; those >= context_len are masked and their
    values zeroed (whatever those slots hold, NaN included, never reaches the output).
    """
    num, num_q_heads, head_dim = q.shape
    num_kv_heads = kv_pool.shape[3]
    max_len = int(context_lens.max())
    pages = block_tables[:, : -(-max_len // kv_pool.shape[2])].long()
    kv = dequantize_kv(kv_pool[:, pages].reshape(2, num, -1, num_kv_heads, head_dim), q.dtype, kv_scales)
    keys, values = kv[0].transpose(1, 2), kv[1].transpose(1, 2)  # [N, Hkv, L, D]
    query = q.reshape(num, num_kv_heads, num_q_heads // num_kv_heads, head_dim)  # head h = kv * group + g
    scores = (query @ keys.transpose(-1, -2)) * scale  # [N, Hkv, group, L]
    beyond = torch.arange(keys.shape[2], device=q.device)[None, :] >= context_lens[:, None]  # [N, L]
    scores = scores.masked_fill(beyond[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    # a zero probability times a NaN or inf is NaN: slots past a context (recycled pages: stale KV, or a freed
    # checkpoint's state bytes read as KV) are zeroed, not only masked
    values = values.masked_fill(beyond[:, None, :, None], 0)
    return (probs @ values).reshape(num, num_q_heads, head_dim)
