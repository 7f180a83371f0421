"""Latent attention over a paged pool (Kimi Linear's MLA with its latent cached, `models/kimi_linear.KimiMLA`): where a
token's latent row lies in a layer's pool, and the torch reference of the attention (the CUDA kernel:
`triton_latent.py`).

A token's latent row is [c | k_shared], E = R + Dr wide: the normed latent c (R = kv_lora_rank) and the key part
every head shares (Dr = qk_rope_head_dim). A layer's pool keeps the shape every attention layer's has,
[2, num_pages, page, 1, W]: one kv head of W = ceil(E / 2) lanes, the row's first W lanes in the keys half and the
rest, zero-padded to W, in the values half. A token and layer then take 2 W values (E, or E + 1), where the expanded
keys and values of every head took 2 x H x max(Dqk, Dv): 1,152 bytes against 24 KiB for the released models
(E = 512 + 64, bf16). Worked example, E = 5 (R = 3, Dr = 2), W = 3:

    row          [c0 c1 c2 s0 s1]
    keys half    [c0 c1 c2]          values half  [s0 s1 0]
    lane e of the row: keys half lane e for e < W, values half lane e - W for the others

The attention runs with the heads' up-projections absorbed (`KimiMLA`): head h's query becomes qa_h =
[W_UK_h^T q_nope_h | q_shared_h], E wide, which scores the rows directly, and its output is the softmax-weighted
sum of the rows' latents c, R wide, which `KimiMLA` maps up by W_UV_h:

    out[t, h] = sum_j softmax_j(scale * qa[t, h] . row_j) c_j      over the rows j at positions <= t's

(qa_h . row_j = q_nope_h . (W_UK_h c_j) + q_shared_h . k_shared_j: head h's query against its expanded key.)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F  # noqa: N812

from hybridcache.kernels.attention.reference import gather_kv


def plane_width(latent_width: int) -> int:
    """W, the pool's head dim for latent rows of E = `latent_width` lanes: ceil(E / 2)."""
    return -(-latent_width // 2)


def split_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Latent rows [T, E] -> their (keys half, values half), each [T, 1, W] (`write_kv`'s key and value): lanes
    [0, W) and [W, E) zero-padded to W (module docstring)."""
    width = plane_width(rows.shape[-1])
    return rows[:, None, :width], F.pad(rows[:, None, width:], (0, 2 * width - rows.shape[-1]))


def gather_rows(kv_pool: torch.Tensor, pages: torch.Tensor, context_len: int, latent_width: int) -> torch.Tensor:
    """The latent rows [context_len, E] of positions [0, context_len) of one sequence (pages: its block-table
    row) from a pool [2, num_pages, page, 1, W]."""
    keys, values = gather_kv(kv_pool, pages, context_len)
    return torch.cat([keys[:, 0], values[:, 0]], dim=-1)[:, :latent_width]


def check_latent_shapes(q: torch.Tensor, kv_pool: torch.Tensor, value_dim: int) -> None:
    """ValueError unless q [T, H, E] fits a pool of latent rows [2, pages, page, 1, W] (W = ceil(E / 2), the same
    dtype) with 0 < value_dim <= E."""
    latent_width = q.shape[-1]
    if kv_pool.dim() != 5 or kv_pool.shape[0] != 2 or kv_pool.shape[3] != 1:
        raise ValueError(f"a latent pool is [2, pages, page, 1, W], got {tuple(kv_pool.shape)}")
    if kv_pool.shape[-1] != plane_width(latent_width):
        raise ValueError(f"latent rows of {latent_width} lanes lie in a pool of head dim "
                         f"{plane_width(latent_width)}, got {kv_pool.shape[-1]}")
    if not 0 < value_dim <= latent_width:
        raise ValueError(f"value_dim {value_dim} must be in [1, {latent_width}]")
    if kv_pool.dtype != q.dtype:
        raise ValueError(f"the latent pool's dtype {kv_pool.dtype} must be q's {q.dtype}")


def latent_attention(
    q: torch.Tensor,
    kv_pool: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens: torch.Tensor,
    query_lens: Sequence[int],
    context_lens: Sequence[int],
    *,
    scale: float,
    value_dim: int,
) -> torch.Tensor:
    """Causal latent attention of a varlen batch over a pool of latent rows (the step's rows already written).

    q            [T, H, E]   absorbed queries of all sequences, concatenated
    kv_pool      [2, num_pages, page, 1, W]   latent rows (module docstring)
    block_tables [S, P]; cu_seqlens [S + 1]; query_lens, context_lens: per-sequence host ints, the new tokens at
                 positions [context_len - query_len, context_len)
    value_dim    R: the output is the weighted sum of the rows' first R lanes
    returns      [T, H, R] in q's dtype (softmax in fp32, its probabilities rounded to q's dtype before the sum, as
                 `reference.paged_attention`)
    """
    check_latent_shapes(q, kv_pool, value_dim)
    num_tokens, num_heads, latent_width = q.shape
    out = q.new_empty(num_tokens, num_heads, value_dim)
    starts = cu_seqlens.tolist()
    for i, (query_len, context_len) in enumerate(zip(query_lens, context_lens, strict=True)):
        rows = gather_rows(kv_pool, block_tables[i], context_len, latent_width)  # [ctx, E]
        query = q[starts[i]: starts[i] + query_len].transpose(0, 1)  # [H, qlen, E]
        scores = (query @ rows.T) * scale  # [H, qlen, ctx]
        query_pos = torch.arange(context_len - query_len, context_len, device=q.device)
        key_pos = torch.arange(context_len, device=q.device)
        scores = scores.masked_fill(key_pos[None, :] > query_pos[:, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out[starts[i]: starts[i] + query_len] = (probs @ rows[:, :value_dim]).transpose(0, 1)
    return out


def absorbed_attention(q_nope: torch.Tensor, q_shared: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor,
                       attend: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """MLA with kv_b_proj absorbed (module docstring): the absorbed query [W_UK_h^T q_nope_h | q_shared_h] [T, H, E]
    -> `attend` (a latent attention: [T, H, R]) -> mapped up per head by W_UV_h: [T, H, Dv]."""
    absorbed = torch.cat([torch.einsum("thd,hdr->thr", q_nope, w_uk), q_shared], dim=-1)
    return torch.einsum("thr,hvr->thv", attend(absorbed), w_uv)
