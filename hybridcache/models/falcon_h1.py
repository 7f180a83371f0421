"""TII Falcon-H1 (`FalconH1ForCausalLM`, model_type `falcon_h1`; Falcon-H1-0.5B / 1.5B / 1.5B-Deep / 3B / 7B / 34B,
their -Instruct, Falcon-H1R-7B): every decoder layer runs attention and a Mamba2 mixer side by side on the same normed
input and adds their scaled outputs, then a SiLU-gated MLP, all with muP multipliers (`config.multipliers`, and the
Mamba2 mixer's `in_multipliers`).

Module tree (names equal the checkpoint tensor names; the loader renames `model.final_layernorm` to `model.norm`,
`loader.RENAMED_NAMES`)::

    model.embed_tokens                      [vocab, hidden], times embedding_multiplier
    model.layers.{i}.input_layernorm        RMSNorm (y = w * x / rms(x), not zero-centred)
    model.layers.{i}.mamba                  Mamba2Mixer: in_proj's z | x | B | C | dt times ssm_multipliers; the gated
                                            norm only with mamba_rms_norm (else y * silu(z)), before the gate with
                                            mamba_norm_before_gate; out_proj's bias projectors_bias
    model.layers.{i}.self_attn              GraniteAttention: GQA, keys times key_multiplier before RoPE (RoPE on the
                                            whole head), softmax scale head_dim^-0.5
    model.layers.{i}.pre_ff_layernorm
    model.layers.{i}.feed_forward           MLP: down_proj(silu(gate_proj(x) * g) * up_proj(x)) * d, (g, d) =
                                            mlp_multipliers
    model.norm (checkpoint: final_layernorm), lm_head (logits times lm_head_multiplier)

A layer, with n = input_layernorm(h):

    h = h + ssm_out * mamba(ssm_in * n) + attention_out * self_attn(attention_in * n)
    h = h + feed_forward(pre_ff_layernorm(h))

The layer's multipliers are constants of the linears they sit next to, so they are folded into those linears' weights
once they are loaded (`FalconH1DecoderLayer.fold_multipliers_`, from the model's `after_loading_`), and the forward
multiplies by none of them (a decode step of Falcon-H1-1.5B-Deep otherwise ran about twelve element-wise launches more
in each of its 66 layers):

    mamba.in_proj    rows times ssm_in and their range's ssm_multiplier (z, x, B, C, dt); bias times the latter
    mamba.out_proj   times ssm_out (weight and bias)
    q_proj, v_proj   weight times attention_in;  k_proj: weight times attention_in * key, bias times key
    o_proj           times attention_out
    gate_proj        times mlp_multipliers[0];  down_proj: times mlp_multipliers[1]

Each folded weight is the fp32 product rounded once to the model dtype: exact algebra, a rounding away from
transformers' order in bf16 (it rounds after the linear, then after the product). The embedding and lm_head
multipliers stay in the forward (one product a step each; a tied embedding could not hold both).

Its state: the layer holds paged KV *and* a Mamba2 state, so the model declares two state layers per decoder layer
(`states_per_layer` 2: `HybridCausalLM`'s docstring): state layer 2i is layer i's attention (an `AttentionSpec`,
addressed by the sequence's blocks), 2i + 1 its Mamba2 mixer (a `RecurrentSpec`, addressed by its slot). The pools
group them by spec as for any model (one KV group for the L attention state layers, one conv and one ssm group for
the L Mamba2 ones), so the cache, the copy plans and the scheduler see blocks and slots as ever.

Not supported (a ValueError says so): tensor parallelism, FP8 weights or KV, MTP, images.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from hybridcache.layers.linear import scale_linear_
from hybridcache.layers.mlp import MLP
from hybridcache.layers.norm import RMSNorm
from hybridcache.layers.step import StepContext
from hybridcache.models.config import ModelConfig
from hybridcache.models.granite import GraniteAttention
from hybridcache.models.mamba_hybrid import MambaHybridLM, mamba2_mixer
from hybridcache.state_spec import LayerSpec, LayerState


class FalconH1DecoderLayer(nn.Module):
    """The parallel layer (module docstring); `forward_split` as `hybrid_lm.DecoderLayer`'s, its state the pair (KV
    pool of its attention, Mamba2 state of its mixer)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        c, a, m = config, config.attention, config.multipliers
        self.multipliers = m
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mamba = mamba2_mixer(c)
        self.self_attn = GraniteAttention.from_config(c, bias=a.bias, use_rope=True)
        self.pre_ff_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        assert c.mlp.intermediate_size is not None
        self.feed_forward = MLP(c.hidden_size, c.mlp.intermediate_size)

    def fold_multipliers_(self) -> None:
        """Fold the layer's muP multipliers into its linears (module docstring); once, after loading."""
        m, attn, mlp = self.multipliers, self.self_attn, self.feed_forward
        self.mamba.fold_multipliers_(m.ssm_in)
        scale_linear_(self.mamba.out_proj, m.ssm_out)
        scale_linear_(attn.q_proj, m.attention_in, 1.0)
        scale_linear_(attn.k_proj, m.attention_in * m.key, m.key)
        scale_linear_(attn.v_proj, m.attention_in, 1.0)
        scale_linear_(attn.o_proj, m.attention_out)
        scale_linear_(mlp.gate_proj, m.mlp_gate)
        scale_linear_(mlp.down_proj, m.mlp_down)

    def state_specs(self, dtype: torch.dtype, state_dtype: torch.dtype) -> tuple[LayerSpec, LayerSpec]:
        """(the attention's paged KV, the Mamba2 mixer's conv and ssm state): two state layers."""
        return self.self_attn.state_spec(dtype, state_dtype), self.mamba.state_spec(dtype, state_dtype)

    def forward_split(self, hidden: torch.Tensor, pending: torch.Tensor | None, step: StepContext,
                      state: Sequence[LayerState]) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer on hidden + pending, returned as (residual, out) whose sum is its output."""
        kv, mamba_state = state
        if pending is None:
            normed = self.input_layernorm(hidden, step.backend)
        else:
            hidden, normed = self.input_layernorm.add(hidden, pending, step.backend)
        # (the mixer's core output is read before the attention's core runs: piecewise graphs run them one by one)
        ssm = self.mamba(normed, step, mamba_state)  # (the multipliers are in the weights: fold_multipliers_)
        attn = self.self_attn(normed, step, kv)
        hidden, normed = self.pre_ff_layernorm.add(hidden, ssm + attn, step.backend)
        return hidden, self.feed_forward(normed, step)


class FalconH1ForCausalLM(MambaHybridLM):
    supported_model_types = ("falcon_h1",)
    states_per_layer = 2  # (KV, Mamba2 state) per decoder layer

    def _layer(self, layer_id: int) -> nn.Module:
        del layer_id  # (every layer alike)
        return FalconH1DecoderLayer(self.config)

    def after_loading_(self) -> None:
        for layer in self.model.layers:
            layer.fold_multipliers_()
