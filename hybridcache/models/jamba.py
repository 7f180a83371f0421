"""AI21 Jamba (`JambaForCausalLM`, model_type `jamba`: Jamba-v0.1, Jamba 1.5 / 1.6 / 1.7 Mini and Large, Jamba
Reasoning 3B): Mamba1 and attention layers, each followed by a dense MLP or a sparse MoE block.

Module tree (names equal the checkpoint tensor names; the loader renames `model.final_layernorm` to `model.norm`,
`loader.RENAMED_NAMES`)::

    model.embed_tokens                            [vocab, hidden]
    model.layers.{i}.input_layernorm              RMSNorm (y = w * round(x / rms(x)), not zero-centred)
    model.layers.{i}.mamba                        Mamba1Mixer     (i % attn_layer_period != attn_layer_offset)
    model.layers.{i}.self_attn                    attention       (the others): GQA, no RoPE, no gate, no biases
    model.layers.{i}.pre_ff_layernorm             RMSNorm
    model.layers.{i}.feed_forward                 MLP: gate_proj / up_proj / down_proj (SiLU-gated), or where
                                                  i % expert_layer_period == expert_layer_offset and num_experts > 1:
    model.layers.{i}.feed_forward.router          [E, hidden]
    model.layers.{i}.feed_forward.experts.{e}.*   gate_proj / up_proj / down_proj (transformers' in-memory stacked
                                                  experts.gate_up_proj / experts.down_proj load too)
    model.norm                                    RMSNorm (checkpoint: model.final_layernorm)
    lm_head                                       [vocab, hidden] (the embedding itself when tied)

A layer: h = h + mixer(input_layernorm(h)); h = h + feed_forward(pre_ff_layernorm(h)). The MoE block routes as
transformers' JambaTopKRouter: softmax of the router logits in fp32, the top num_experts_per_tok weights kept as they
are (not renormalised), in the model dtype; out = sum_k w_k expert_k(x) (`backend.route`, `backend.moe`).

Not supported (a ValueError says so): tensor parallelism, FP8 weights or KV, MTP (Jamba has no MTP head), images.
`use_mamba_kernels` (which kernels transformers picks) is not read.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridcache.layers.linear import module_linear
from hybridcache.layers.mamba1 import Mamba1Mixer
from hybridcache.layers.mlp import MLP
from hybridcache.layers.norm import RMSNorm
from hybridcache.layers.step import StepContext
from hybridcache.models.config import LayerKind, ModelConfig
from hybridcache.models.granite import GraniteAttention, GraniteMoE
from hybridcache.models.hybrid_lm import DecoderLayer
from hybridcache.models.mamba_hybrid import MambaHybridLM


class JambaMoE(GraniteMoE):
    """x [N, hidden] -> sum_k w_k expert_k(x): the top-k of softmax(router(x)) (fp32 softmax, weights not
    renormalised, in x's dtype), SiLU-gated experts, no shared expert (`GraniteMoE`'s router and experts, routed
    otherwise)."""

    def forward(self, x: torch.Tensor, step: StepContext) -> torch.Tensor:
        top_weights, top_ids = step.backend.route(module_linear(self.router, x), self.top_k, False)
        return step.backend.moe(x, top_weights, top_ids, self.experts)


def mamba1_mixer(config: ModelConfig) -> Mamba1Mixer:
    """A Mamba1 layer of `config` (its `mamba1` group; the dt / B / C norms' eps is the model's)."""
    m = config.mamba1
    assert m is not None
    return Mamba1Mixer(config.hidden_size, intermediate_size=m.intermediate_size, state_size=m.state_size,
                       dt_rank=m.dt_rank, conv_kernel_size=m.conv_kernel_size, conv_bias=m.conv_bias,
                       proj_bias=m.proj_bias, eps=config.rms_norm_eps)


class JambaForCausalLM(MambaHybridLM):
    supported_model_types = ("jamba",)

    def _layer(self, layer_id: int) -> nn.Module:
        c = self.config
        return DecoderLayer(*self._mixer(layer_id), self._mlp(layer_id), c.hidden_size, c.rms_norm_eps, norm=RMSNorm,
                            mlp_name="feed_forward", post_norm_name="pre_ff_layernorm")

    def _mixer(self, layer_id: int) -> tuple[str, nn.Module]:
        c = self.config
        if c.layer_types[layer_id] is LayerKind.MAMBA1:
            return "mamba", mamba1_mixer(c)
        return "self_attn", GraniteAttention.from_config(c, bias=False, use_rope=False)

    def _mlp(self, layer_id: int) -> nn.Module:
        c, mlp = self.config, self.config.mlp
        if c.is_moe_layer(layer_id):
            return JambaMoE(c.hidden_size, num_experts=mlp.num_experts, top_k=mlp.num_experts_per_tok,
                            intermediate_size=mlp.moe_intermediate_size)
        return MLP(c.hidden_size, mlp.intermediate_size)
