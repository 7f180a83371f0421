"""AllenAI OLMo Hybrid (`OlmoHybridForCausalLM`, model_type `olmo_hybrid`; Olmo-Hybrid-7B): gated DeltaNet layers
("linear_attention", pre-norm) and attention layers ("full_attention", OLMo 2/3's post-norm), a dense SwiGLU MLP in
every layer.

Module tree (names equal the checkpoint tensor names; the checkpoints hold the conv as `q_conv1d`, `k_conv1d`,
`v_conv1d`, which the loader concatenates into `conv1d`, `loader.CONCATENATED_SUFFIXES`, and transformers'
`save_pretrained` writes the DeltaNet layers' norms as `attention_layer_norm` / `feedforward_layer_norm`, which the
loader renames, `loader.RENAMED_SUFFIXES`)::

    model.embed_tokens                           [vocab, hidden]
    DeltaNet layer i (pre-norm):
    model.layers.{i}.input_layernorm             RMSNorm (y = round(w * x / rms(x)), in fp32, rounded once)
    model.layers.{i}.linear_attn                 SeparateGatedDeltaNet: q_proj, k_proj, v_proj, g_proj, a_proj,
                                                 b_proj, conv1d (no bias), A_log, dt_bias, o_norm (eps 1e-5), o_proj
    model.layers.{i}.post_attention_layernorm
    model.layers.{i}.mlp                         gate_proj, up_proj, down_proj
    attention layer i (post-norm):
    model.layers.{i}.self_attn                   q_proj, k_proj, v_proj, o_proj; q_norm [Hq * D], k_norm [Hkv * D]
    model.layers.{i}.post_attention_layernorm
    model.layers.{i}.mlp
    model.layers.{i}.post_feedforward_layernorm
    model.norm, lm_head

A DeltaNet layer: h = h + mixer(norm1(h)); h = h + mlp(norm2(h)). An attention layer (no norm before its blocks):
h = h + norm1(attention(h)); h = h + norm2(mlp(h)). The DeltaNet is Qwen's (`layers/gated_deltanet.py`) with
separate projections, beta = 2 sigmoid(b) under `linear_allow_neg_eigval` and its gated norm's eps fixed at 1e-5
(transformers' OlmoHybridRMSNormGated, after fla's FusedRMSNormGated). The attention is plain GQA (no output gate)
whose q_norm / k_norm normalise each token's whole query / key projection (every head together, not per head), then
RoPE on the whole head, unless config.json writes rope_theta null (the released checkpoints: no rotary embedding).

Not supported (a ValueError says so): tensor parallelism (the q_norm / k_norm over every head would need the ranks'
heads gathered), FP8 weights or KV, MTP, images.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from hybridcache.kernels.backend import KernelBackend
from hybridcache.layers.gated_deltanet import SeparateGatedDeltaNet
from hybridcache.layers.mlp import MLP
from hybridcache.layers.norm import RMSNorm
from hybridcache.layers.step import StepContext
from hybridcache.models.config import LayerKind
from hybridcache.models.granite import GraniteAttention
from hybridcache.models.hybrid_lm import DecoderLayer, HybridCausalLM
from hybridcache.state_spec import LayerState

# The DeltaNet's gated output norm's eps: transformers hard-codes fla's FusedRMSNormGated default, whatever
# rms_norm_eps says
GATED_NORM_EPS = 1e-5

# OLMo's RMSNorm: normalised in fp32, times the weight in fp32, rounded once (transformers' OlmoHybridRMSNorm)
OlmoRMSNorm = functools.partial(RMSNorm, weight_in_fp32=True)


class OlmoHybridAttention(GraniteAttention):
    """Causal GQA (`GraniteAttention`) whose query and key projections are normalised first, each over its whole
    width: q_norm [Hq * D], k_norm [Hkv * D] (OLMo 2's QK-norm)."""

    def __init__(self, hidden_size: int, *, num_heads: int, num_kv_heads: int, head_dim: int, bias: bool,
                 use_rope: bool, eps: float) -> None:
        super().__init__(hidden_size, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, bias=bias,
                         scale=head_dim**-0.5, use_rope=use_rope)
        self.q_norm = OlmoRMSNorm(num_heads * head_dim, eps)
        self.k_norm = OlmoRMSNorm(num_kv_heads * head_dim, eps)

    def _project(self, hidden: torch.Tensor, backend: KernelBackend) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        query, key, value = super()._project(hidden, backend)
        return self.q_norm(query, backend), self.k_norm(key, backend), value


class PostNormDecoderLayer(nn.Module):
    """OLMo 2/3's layer: h + post_attention_layernorm(self_attn(h)), then h + post_feedforward_layernorm(mlp(h));
    `forward_split` as `hybrid_lm.DecoderLayer`'s (its output as (residual, out), their sum)."""

    def __init__(self, attention: nn.Module, mlp: nn.Module, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.self_attn = attention
        self.post_attention_layernorm = OlmoRMSNorm(hidden_size, eps)
        self.mlp = mlp
        self.post_feedforward_layernorm = OlmoRMSNorm(hidden_size, eps)

    @property
    def mixer(self) -> nn.Module:
        return self.self_attn

    def forward_split(self, hidden: torch.Tensor, pending: torch.Tensor | None, step: StepContext,
                      state: LayerState) -> tuple[torch.Tensor, torch.Tensor]:
        if pending is not None:
            hidden = hidden + pending
        hidden = hidden + self.post_attention_layernorm(self.self_attn(hidden, step, state), step.backend)
        return hidden, self.post_feedforward_layernorm(self.mlp(hidden, step), step.backend)


class OlmoHybridForCausalLM(HybridCausalLM):
    deltanet_cls = SeparateGatedDeltaNet
    deltanet_norm_eps = GATED_NORM_EPS
    supported_model_types = ("olmo_hybrid",)
    supports_fp8 = False
    single_rank_reason = "its attention layers are not split across ranks (their q_norm / k_norm span every head)"

    def _layer(self, layer_id: int) -> nn.Module:
        c = self.config
        mlp = MLP(c.hidden_size, c.mlp.intermediate_size)
        if c.layer_types[layer_id] is LayerKind.LINEAR_ATTENTION:
            return DecoderLayer("linear_attn", self._deltanet(), mlp, c.hidden_size, c.rms_norm_eps, norm=OlmoRMSNorm)
        return PostNormDecoderLayer(self._attention(), mlp, c.hidden_size, c.rms_norm_eps)

    def _attention(self) -> nn.Module:
        c, a = self.config, self.config.attention
        return OlmoHybridAttention(c.hidden_size, num_heads=a.num_heads, num_kv_heads=a.num_kv_heads,
                                   head_dim=a.head_dim, bias=a.bias, use_rope=a.use_rope, eps=c.rms_norm_eps)

    def _norm(self, dim: int) -> nn.Module:
        return OlmoRMSNorm(dim, self.config.rms_norm_eps)

