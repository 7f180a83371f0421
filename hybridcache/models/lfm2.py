"""Liquid AI LFM2 (`Lfm2ForCausalLM`, model_type `lfm2`; LFM2-350M / 700M / 1.2B / 2.6B): gated short-convolution
layers ("conv") and GQA attention layers ("full_attention"), each pre-norm with a SwiGLU MLP.

Module tree (our names; the checkpoints' in brackets, renamed by the loader: `loader.RENAMED_SUFFIXES` /
`RENAMED_NAMES`)::

    model.embed_tokens                          [vocab, hidden]
    model.layers.{i}.input_layernorm            RMSNorm (y = w * round(x / rms(x))) [operator_norm]
    model.layers.{i}.conv                       ShortConv: in_proj [3H, H], conv [H, 1, K], out_proj [H, H]
                                                (layer_types[i] "conv")
    model.layers.{i}.self_attn                  q_proj, k_proj, v_proj, o_proj [out_proj]; q_norm, k_norm [head_dim]
                                                [q_layernorm, k_layernorm] (layer_types[i] "full_attention")
    model.layers.{i}.post_attention_layernorm   [ffn_norm]
    model.layers.{i}.mlp                        gate_proj [feed_forward.w1], up_proj [w3], down_proj [w2]
    model.norm                                  [model.embedding_norm: applied after the last layer, as transformers]
    lm_head                                     the embedding itself (tie_embedding, true in the released configs)

A layer: h = h + mixer(norm1(h)); h = h + mlp(norm2(h)) (`hybrid_lm.DecoderLayer`). The attention is plain GQA
(`GraniteAttention`: no output gate, softmax scale head_dim^-1/2) whose q_norm / k_norm are RMSNorms over each head
(`norm_eps`), then RoPE on the whole head. The norms round x / rms(x) to the model dtype before the weight multiplies
(transformers' Lfm2RMSNorm, Granite's).

Not supported (a ValueError says so): tensor parallelism, FP8 weights or KV, MTP.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from hybridcache.layers.mlp import MLP
from hybridcache.layers.norm import RMSNorm
from hybridcache.layers.short_conv import ShortConv
from hybridcache.models.config import LayerKind
from hybridcache.models.granite import GraniteAttention
from hybridcache.models.hybrid_lm import DecoderLayer, HybridCausalLM

Lfm2RMSNorm = functools.partial(RMSNorm, weight_in_fp32=False)


class Lfm2Attention(GraniteAttention):
    """Causal GQA (`GraniteAttention`) with RoPE whose queries and keys are RMSNorm-ed per head first (q_norm,
    k_norm [head_dim])."""

    def __init__(self, hidden_size: int, *, num_heads: int, num_kv_heads: int, head_dim: int, eps: float) -> None:
        super().__init__(hidden_size, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, bias=False,
                         scale=head_dim**-0.5, use_rope=True)
        self.q_norm = Lfm2RMSNorm(head_dim, eps)
        self.k_norm = Lfm2RMSNorm(head_dim, eps)

    def _project(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        query, key, value = super()._project(hidden)
        heads = (-1, self.head_dim)
        return (self.q_norm(query.unflatten(-1, heads)).flatten(-2), self.k_norm(key.unflatten(-1, heads)).flatten(-2),
                value)


class Lfm2ForCausalLM(HybridCausalLM):
    supported_model_types = ("lfm2",)
    supports_fp8 = False
    single_rank_reason = "its short-convolution and attention layers are not split across ranks yet"

    def _layer(self, layer_id: int) -> nn.Module:
        c = self.config
        name, mixer = ("conv", self._short_conv()) if c.layer_types[layer_id] is LayerKind.SHORT_CONV else (
            "self_attn", self._attention())
        return DecoderLayer(name, mixer, MLP(c.hidden_size, c.mlp.intermediate_size), c.hidden_size, c.rms_norm_eps,
                            norm=Lfm2RMSNorm)

    def _short_conv(self) -> nn.Module:
        conv = self.config.short_conv
        assert conv is not None
        return ShortConv(self.config.hidden_size, conv_kernel_size=conv.conv_kernel_size, bias=conv.bias)

    def _attention(self) -> nn.Module:
        c, a = self.config, self.config.attention
        return Lfm2Attention(c.hidden_size, num_heads=a.num_heads, num_kv_heads=a.num_kv_heads, head_dim=a.head_dim,
                             eps=c.rms_norm_eps)

    def _norm(self, dim: int) -> nn.Module:
        return Lfm2RMSNorm(dim, self.config.rms_norm_eps)
