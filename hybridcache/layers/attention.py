"""Gated full attention of Qwen3-Next / Qwen3.5 over the paged KV pool.

Per token (hidden [T, hidden]):
    q_proj(x) -> [T, Hq, 2D], split per head into query [T, Hq, D] | gate [T, Hq, D]
    query = q_norm(query), key = k_norm(k_proj(x)), both zero-centred RMSNorm over D
    query, key = partial RoPE (first rotary_dim channels) at the tokens' absolute positions
    key/value are written to the pool via slot_mapping, then attention reads positions [0, context_len)
    out = o_proj(attn * sigmoid(gate))
"""

from __future__ import annotations

import torch
from torch import nn

from hybridcache.forward_batch import ForwardBatch
from hybridcache.kernels import reference
from hybridcache.layers.norm import ZeroCenteredRMSNorm
from hybridcache.layers.rotary import apply_partial_rotary


class GatedAttention(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        *,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        bias: bool,
        eps: float,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim * 2, bias=bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=bias)
        self.q_norm = ZeroCenteredRMSNorm(head_dim, eps=eps)
        self.k_norm = ZeroCenteredRMSNorm(head_dim, eps=eps)

    def forward(
        self,
        hidden: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        batch: ForwardBatch,
        kv_pool: torch.Tensor,
    ) -> torch.Tensor:
        """hidden [T, hidden]; rope = (cos, sin) [T, rotary_dim] at batch.positions;
        kv_pool [2, num_pages, kernel_block_size, Hkv, D] of this layer (updated in place) -> [T, hidden]."""
        num_tokens = hidden.shape[0]
        query, gate = self.q_proj(hidden).view(num_tokens, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        query = self.q_norm(query)
        key = self.k_norm(self.k_proj(hidden).view(num_tokens, self.num_kv_heads, self.head_dim))
        value = self.v_proj(hidden).view(num_tokens, self.num_kv_heads, self.head_dim)
        cos, sin = rope
        query = apply_partial_rotary(query, cos, sin)
        key = apply_partial_rotary(key, cos, sin)
        reference.write_kv(kv_pool, key, value, batch.slot_mapping)
        attn = reference.paged_attention(
            query,
            kv_pool,
            batch.block_tables,
            batch.cu_seqlens,
            batch.query_lens_cpu,
            batch.context_lens_cpu,
            scale=self.head_dim**-0.5,
        )
        attn = attn.reshape(num_tokens, -1) * torch.sigmoid(gate.reshape(num_tokens, -1))
        return self.o_proj(attn)
