"""The decoder skeleton shared by Qwen3.5, Qwen3.5-MoE and Qwen3-Next.

Module tree (names equal the checkpoint tensor names)::

    model.embed_tokens                      [vocab, hidden]
    model.layers.{i}.input_layernorm        zero-centred RMSNorm
    model.layers.{i}.linear_attn            gated DeltaNet       (layer_types[i] == "linear_attention")
    model.layers.{i}.self_attn              gated attention      (layer_types[i] == "full_attention")
    model.layers.{i}.post_attention_layernorm
    model.layers.{i}.mlp                    MLP or SparseMoeBlock (config.is_moe_layer(i))
    model.norm
    lm_head                                 [vocab, hidden] (the embedding itself when tied)

Pool indices: the j-th DeltaNet layer uses pools.conv[j] / pools.ssm[j]; the j-th attention layer uses
pools.kv[j] (j counts only layers of that kind, in layer order).
"""

from __future__ import annotations

import torch
from torch import nn

from hybridcache.forward_batch import DevicePools, ForwardBatch, LayerShapes
from hybridcache.layers.attention import GatedAttention
from hybridcache.layers.gated_deltanet import GatedDeltaNet
from hybridcache.layers.mlp import MLP, SparseMoeBlock
from hybridcache.layers.norm import ZeroCenteredRMSNorm
from hybridcache.layers.rotary import rotary_cos_sin
from hybridcache.models.config import LINEAR_ATTENTION, ModelConfig


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, deltanet_cls: type[nn.Module]) -> None:
        super().__init__()
        self.is_linear = config.layer_types[layer_id] == LINEAR_ATTENTION
        eps = config.rms_norm_eps
        if self.is_linear:
            self.linear_attn = deltanet_cls(
                config.hidden_size,
                num_k_heads=config.linear_num_key_heads,
                num_v_heads=config.linear_num_value_heads,
                k_head_dim=config.linear_key_head_dim,
                v_head_dim=config.linear_value_head_dim,
                conv_kernel_size=config.linear_conv_kernel_dim,
                eps=eps,
            )
        else:
            self.self_attn = GatedAttention(
                config.hidden_size,
                num_heads=config.num_attention_heads,
                num_kv_heads=config.num_key_value_heads,
                head_dim=config.head_dim,
                bias=config.attention_bias,
                eps=eps,
            )
        if config.is_moe_layer(layer_id):
            self.mlp = SparseMoeBlock(
                config.hidden_size,
                num_experts=config.num_experts,
                top_k=config.num_experts_per_tok,
                moe_intermediate_size=config.moe_intermediate_size,
                shared_expert_intermediate_size=config.shared_expert_intermediate_size,
                norm_topk_prob=config.norm_topk_prob,
            )
        else:
            self.mlp = MLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = ZeroCenteredRMSNorm(config.hidden_size, eps=eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(config.hidden_size, eps=eps)


class _Backbone(nn.Module):
    """Holds `embed_tokens`, `layers`, `norm` so that their names start with `model.`."""

    def __init__(self, config: ModelConfig, deltanet_cls: type[nn.Module]) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, deltanet_cls) for i in range(config.num_hidden_layers)
        )
        self.norm = ZeroCenteredRMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class HybridCausalLM(nn.Module):
    """Base class of the supported models; subclasses set `deltanet_cls` and `supported_model_types`.

    `model(batch, pools)` runs one forward over a `ForwardBatch` and returns fp32 logits
    [len(batch.logits_indices), vocab] (one row per sequence in engine batches).
    """

    deltanet_cls: type[nn.Module] = GatedDeltaNet
    supported_model_types: tuple[str, ...] = ()

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        if config.model_type not in self.supported_model_types:
            raise ValueError(
                f"{type(self).__name__} supports model_type {self.supported_model_types}, "
                f"not {config.model_type!r}"
            )
        self.config = config
        self.model = _Backbone(config, self.deltanet_cls)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()
        self.eval()
        self.requires_grad_(False)

    def tie_weights(self) -> None:
        """Make `lm_head` share the embedding matrix when the config ties them (again after `to_empty`)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def layer_shapes(self) -> LayerShapes:
        c = self.config
        return LayerShapes(
            num_attention_layers=c.num_attention_layers,
            num_kv_heads=c.num_key_value_heads,
            head_dim=c.head_dim,
            num_linear_layers=c.num_linear_layers,
            conv_dim=c.conv_dim,
            conv_width=c.conv_width,
            num_v_heads=c.linear_num_value_heads,
            k_head_dim=c.linear_key_head_dim,
            v_head_dim=c.linear_value_head_dim,
        )

    def forward(self, batch: ForwardBatch, pools: DevicePools) -> torch.Tensor:
        """Run the step under `torch.inference_mode`; the pools are updated in place. The logits are
        returned as an ordinary tensor (cloned out of inference mode) so callers may modify them in place."""
        with torch.inference_mode():
            logits = self._forward(batch, pools)
        return logits.clone()

    def _forward(self, batch: ForwardBatch, pools: DevicePools) -> torch.Tensor:
        c = self.config
        hidden = self.model.embed_tokens(batch.input_ids)  # [T, hidden]
        if batch.embeds is not None:
            hidden[batch.embed_rows] = batch.embeds.to(hidden.dtype)
        rope = rotary_cos_sin(batch.positions, c.rotary_dim, c.rope_theta, hidden.dtype)
        linear_id = attention_id = 0
        for layer in self.model.layers:
            residual = hidden
            hidden = layer.input_layernorm(hidden)
            if layer.is_linear:
                hidden = layer.linear_attn(hidden, batch, pools.conv[linear_id], pools.ssm[linear_id])
                linear_id += 1
            else:
                hidden = layer.self_attn(hidden, rope, batch, pools.kv[attention_id])
                attention_id += 1
            hidden = residual + hidden
            residual = hidden
            hidden = residual + layer.mlp(layer.post_attention_layernorm(hidden))
        last = self.model.norm(hidden[batch.logits_indices])
        return self.lm_head(last).float()
