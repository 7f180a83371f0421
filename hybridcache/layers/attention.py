"""Gated full attention of Qwen3-Next / Qwen3.5 over the paged KV pool.

Per token (hidden [T, hidden]):
    q_proj(x) -> [T, Hq, 2D], split per head into query [T, Hq, D] | gate [T, Hq, D]
    query = q_norm(query), key = k_norm(k_proj(x)), both zero-centred RMSNorm over D
    query, key = partial RoPE (first rotary_dim channels) at the tokens' absolute positions
        (norms and RoPE: one backend op, `norm_rotary`)
    key/value are written to the layer's KV pool (backend.write_kv), then backend.attention reads them
    out = o_proj(attn * sigmoid(gate))                        (the gate: backend op `sigmoid_mul`)

Tensor parallel (`tp`): a rank holds its q heads (rows of q_proj, columns of o_proj) and the kv heads they
read (rows of k_proj / v_proj; replicated when there are fewer kv heads than ranks, see `layers.parallel`);
o_proj's partial sums are all-reduced, then its bias (if any) is added once.

FP8 KV (`kv_dtype` float8_e4m3fn, set by the loader for `kv_cache_dtype="fp8"`): keys and values are divided by
the layer's `k_scale` / `v_scale` (the checkpoint's, else 1.0), clamped to +-448 and stored as e4m3; the
attention op reads them back times the scales (`kv_for_cache`, which the Mamba2 hybrids' plain attention,
`models/granite.py::GraniteAttention`, shares).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from hybridcache.layers.fused import FusedProjection
from hybridcache.layers.linear import module_linear
from hybridcache.layers.norm import ZeroCenteredRMSNorm
from hybridcache.layers.parallel import UNSHARDED, Shard, TensorParallel, columns, rows
from hybridcache.layers.step import StepContext
from hybridcache.state_spec import AttentionSpec


def kv_for_cache(key: torch.Tensor, value: torch.Tensor, layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """key, value [T, Hkv, D] as `layer`'s KV pool stores them: with `layer.kv_dtype` set (FP8 KV: module
    docstring), divided in fp32 by its `k_scale` / `v_scale` and clamped to the format's largest finite value (the
    pool's write casts them); else as they are."""
    if layer.kv_dtype is None:
        return key, value
    fp8_max = torch.finfo(layer.kv_dtype).max
    return ((key.float() / layer.k_scale).clamp(-fp8_max, fp8_max),
            (value.float() / layer.v_scale).clamp(-fp8_max, fp8_max))


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
        tp: TensorParallel = UNSHARDED,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.split = tp.split_heads(num_heads, num_kv_heads, "attention heads (num_attention_heads)",
                                    "KV heads (num_key_value_heads)")
        num_heads, num_kv_heads = self.split.num_heads, self.split.num_groups
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim * 2, bias=bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=bias)
        self.qkv = FusedProjection(self.q_proj, self.k_proj, self.v_proj)
        self.q_norm = ZeroCenteredRMSNorm(head_dim, eps=eps)
        self.k_norm = ZeroCenteredRMSNorm(head_dim, eps=eps)
        self.kv_dtype: torch.dtype | None = None  # None: the model dtype; float8_e4m3fn: FP8 KV (module docstring)
        self.k_scale = 1.0
        self.v_scale = 1.0

    @property
    def input_projection(self) -> FusedProjection:
        """The projection of the layer's input (a norm before it may pre-quantise for it: `layers.linear.Fp8Rows`)."""
        return self.qkv

    def shards(self) -> dict[str, Shard]:
        """Parameter name -> this rank's part of the full parameter ({} unsharded)."""
        if self.tp.size == 1:
            return {}
        d, split = self.head_dim, self.split
        q = rows((2 * d * split.start, 2 * d * split.stop))
        kv = rows((d * split.group_start, d * split.group_stop))
        out = {"q_proj.weight": q, "k_proj.weight": kv, "v_proj.weight": kv,
               "o_proj.weight": columns((d * split.start, d * split.stop))}
        if self.o_proj.bias is not None:
            out.update({"q_proj.bias": q, "k_proj.bias": kv, "v_proj.bias": kv})
        return out

    def state_spec(self, dtype: torch.dtype, state_dtype: torch.dtype) -> AttentionSpec:
        """Paged KV in the model dtype, or `kv_dtype` when set (`state_dtype` is for recurrent state)."""
        del state_dtype
        return AttentionSpec(num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, dtype=self.kv_dtype or dtype)

    def forward(self, hidden: torch.Tensor, step: StepContext, kv_layer: torch.Tensor) -> torch.Tensor:
        """hidden [T, hidden] -> [T, hidden]; kv_layer [2, num_pages, kernel_block_size, Hkv, D] of this layer
        (updated in place)."""
        num_tokens = hidden.shape[0]
        query, key, value = self.qkv(hidden)
        query, gate = query.view(num_tokens, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        key = key.view(num_tokens, self.num_kv_heads, self.head_dim)
        value = value.view(num_tokens, self.num_kv_heads, self.head_dim)
        cos, sin = step.rope
        query, key = step.backend.norm_rotary(query, key, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps,
                                              cos, sin)
        key, value = kv_for_cache(key, value, self)
        attn = step.core(functools.partial(self._attend, kv_layer), query, key, value)
        attn = step.backend.sigmoid_mul(attn, gate).view(num_tokens, -1)
        if self.tp.size == 1 or self.o_proj.bias is None:
            return self.tp.all_reduce(module_linear(self.o_proj, attn))
        bias = self.o_proj.bias  # added once, after the partial sums
        out = F.linear(attn, self.o_proj.weight) if type(self.o_proj) is nn.Linear else self.o_proj.matmul(attn)
        return self.tp.all_reduce(out) + bias

    def _attend(self, kv_layer: torch.Tensor, step: StepContext, query: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor) -> torch.Tensor:
        """The layer's core (`StepContext.core`): key and value [T, Hkv, D] written to the pool, then query
        [T, Hq, D] attends over each sequence's context -> [T, Hq, D]."""
        step.backend.write_kv(kv_layer, key, value, step.batch)
        return step.backend.attention(query, kv_layer, step.batch, scale=self.head_dim**-0.5,
                                      kv_scales=(self.k_scale, self.v_scale))
