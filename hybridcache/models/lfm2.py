"""Liquid AI LFM2 (`Lfm2ForCausalLM`, model_type `lfm2`; LFM2-350M / 700M / 1.2B / 2.6B): gated short-convolution
layers ("conv") and GQA attention layers ("full_attention"), each pre-norm with a SwiGLU MLP; and LFM2-MoE
(`Lfm2MoeForCausalLM`, model_type `lfm2_moe`; LFM2-8B-A1B), whose MLPs past its first `num_dense_layers` are MoE blocks.

Module tree (our names; the checkpoints' in brackets, renamed by the loader: `loader.RENAMED_SUFFIXES` /
`RENAMED_NAMES`)::

    model.embed_tokens                          [vocab, hidden]
    model.layers.{i}.input_layernorm            RMSNorm (y = w * round(x / rms(x))) [operator_norm]
    model.layers.{i}.conv                       ShortConv: in_proj [3H, H], conv [H, 1, K], out_proj [H, H]
                                                (layer_types[i] "conv")
    model.layers.{i}.self_attn                  q_proj, k_proj, v_proj, o_proj [out_proj]; q_norm, k_norm [head_dim]
                                                [q_layernorm, k_layernorm] (layer_types[i] "full_attention")
    model.layers.{i}.post_attention_layernorm   [ffn_norm]
    model.layers.{i}.feed_forward               gate_proj [w1], up_proj [w3], down_proj [w2]
    LFM2-MoE's MoE layers:
    model.layers.{i}.feed_forward.gate          weight [E, H], e_score_correction_bias [E] [feed_forward.expert_bias],
                                                both float32 (`GroupedTopKRouter`)
    model.layers.{i}.feed_forward.experts.{e}.* gate_proj [w1], up_proj [w3], down_proj [w2] (transformers' stacked
                                                experts.gate_up_proj / down_proj load too)
    model.norm                                  [model.embedding_norm: applied after the last layer, as transformers]
    lm_head                                     the embedding itself (tie_embedding, true in the released configs)

A layer: h = h + mixer(norm1(h)); h = h + feed_forward(norm2(h)) (`hybrid_lm.DecoderLayer`). An MoE block: scores =
sigmoid(gate(x)), the top k of scores + expert_bias picked, their scores renormalised (+ 1e-6) and times
routed_scaling_factor, the SiLU-gated experts through the backend's `moe`; no shared expert (Nemotron-H's router with
one group, in float32 where transformers computes LFM2-MoE's in the model dtype: equal in fp32, a rounding apart in
bf16, where a near tie may pick another expert). The attention is plain GQA
(`GraniteAttention`: no output gate, softmax scale head_dim^-1/2) whose q_norm / k_norm are RMSNorms over each head
(`norm_eps`), then RoPE on the whole head. The norms round x / rms(x) to the model dtype before the weight multiplies
(transformers' Lfm2RMSNorm, Granite's).

Not supported (a ValueError says so): tensor parallelism, FP8 weights or KV, MTP, images.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from hybridcache.kernels.backend import KernelBackend
from hybridcache.layers.mlp import MLP
from hybridcache.layers.norm import RMSNorm
from hybridcache.layers.short_conv import ShortConv
from hybridcache.layers.step import StepContext
from hybridcache.models.config import GroupedRouting, LayerKind
from hybridcache.models.granite import GraniteAttention
from hybridcache.models.hybrid_lm import DecoderLayer, HybridCausalLM
from hybridcache.models.nemotron_h import GroupedTopKRouter

Lfm2RMSNorm = functools.partial(RMSNorm, weight_in_fp32=False)


class Lfm2Attention(GraniteAttention):
    """Causal GQA (`GraniteAttention`) with RoPE whose queries and keys are RMSNorm-ed per head first (q_norm,
    k_norm [head_dim])."""

    def __init__(self, hidden_size: int, *, num_heads: int, num_kv_heads: int, head_dim: int, eps: float) -> None:
        super().__init__(hidden_size, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, bias=False,
                         scale=head_dim**-0.5, use_rope=True)
        self.q_norm = Lfm2RMSNorm(head_dim, eps)
        self.k_norm = Lfm2RMSNorm(head_dim, eps)

    def _project(self, hidden: torch.Tensor, backend: KernelBackend) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        query, key, value = super()._project(hidden, backend)
        heads = (-1, self.head_dim)
        return (self.q_norm(query.unflatten(-1, heads), backend).flatten(-2),
                self.k_norm(key.unflatten(-1, heads), backend).flatten(-2), value)


class Lfm2MoE(nn.Module):
    """LFM2-MoE's MoE block (module docstring): x [N, H] -> the routed SiLU-gated experts' weighted sum [N, H]."""

    def __init__(self, hidden_size: int, *, num_experts: int, top_k: int, intermediate_size: int,
                 routing: GroupedRouting, norm_topk_prob: bool) -> None:
        super().__init__()
        self.gate = GroupedTopKRouter(hidden_size, num_experts, top_k, routing, norm_topk_prob)
        self.experts = nn.ModuleList(MLP(hidden_size, intermediate_size, reduce=False) for _ in range(num_experts))

    def forward(self, x: torch.Tensor, step: StepContext) -> torch.Tensor:
        top_weights, top_ids = self.gate(x, step.backend)  # (float32 weights: each expert output x its weight in fp32)
        return step.backend.moe(x, top_weights, top_ids, self.experts)


class Lfm2ForCausalLM(HybridCausalLM):
    supported_model_types = ("lfm2",)
    supports_fp8 = False
    single_rank_reason = "its short-convolution and attention layers are not split across ranks"

    def _layer(self, layer_id: int) -> nn.Module:
        c = self.config
        name, mixer = ("conv", self._short_conv()) if c.layer_types[layer_id] is LayerKind.SHORT_CONV else (
            "self_attn", self._attention())
        return DecoderLayer(name, mixer, self._mlp(layer_id), c.hidden_size, c.rms_norm_eps, norm=Lfm2RMSNorm,
                            mlp_name="feed_forward")

    def _mlp(self, layer_id: int) -> nn.Module:
        """A dense SwiGLU MLP, or (LFM2-MoE, `config.is_moe_layer`) an `Lfm2MoE` block."""
        c, mlp = self.config, self.config.mlp
        if not c.is_moe_layer(layer_id):
            return MLP(c.hidden_size, mlp.intermediate_size)
        assert mlp.grouped_routing is not None
        return Lfm2MoE(c.hidden_size, num_experts=mlp.num_experts, top_k=mlp.num_experts_per_tok,
                       intermediate_size=mlp.moe_intermediate_size, routing=mlp.grouped_routing,
                       norm_topk_prob=mlp.norm_topk_prob)

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


class Lfm2MoeForCausalLM(Lfm2ForCausalLM):
    supported_model_types = ("lfm2_moe",)
