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
    model.layers.{i}.self_attn              GraniteAttention: GQA, keys times key_multiplier before RoPE (the whole
                                            head), softmax scale head_dim^-0.5
    model.layers.{i}.pre_ff_layernorm
    model.layers.{i}.feed_forward           MLP: down_proj(silu(gate_proj(x) * g) * up_proj(x)) * d, (g, d) =
                                            mlp_multipliers
    model.norm (checkpoint: final_layernorm), lm_head (logits times lm_head_multiplier)

A layer, with n = input_layernorm(h):

    h = h + ssm_out * mamba(ssm_in * n) + attention_out * self_attn(attention_in * n)
    h = h + feed_forward(pre_ff_layernorm(h))

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

from hybridcache.layers.mlp import MLP
from hybridcache.layers.norm import RMSNorm
from hybridcache.layers.step import StepContext
from hybridcache.models.config import ModelConfig
from hybridcache.models.granite import GraniteAttention
from hybridcache.models.mamba_hybrid import MambaHybridLM, mamba2_mixer
from hybridcache.state_spec import LayerSpec, LayerState


def _scaled(x: torch.Tensor, multiplier: float) -> torch.Tensor:
    return x if multiplier == 1.0 else x * multiplier


class FalconH1MLP(MLP):
    """down_proj(silu(gate_proj(x) * gate_multiplier) * up_proj(x)) * down_multiplier (transformers' FalconH1MLP)."""

    def __init__(self, hidden_size: int, intermediate_size: int, gate_multiplier: float,
                 down_multiplier: float) -> None:
        super().__init__(hidden_size, intermediate_size)
        self.gate_multiplier, self.down_multiplier = gate_multiplier, down_multiplier

    def forward(self, x: torch.Tensor, step: StepContext) -> torch.Tensor:
        gate, up = self.gate_up(x)
        return _scaled(self.down(_scaled(gate, self.gate_multiplier), up, step), self.down_multiplier)


class FalconH1DecoderLayer(nn.Module):
    """The parallel layer (module docstring); `forward_split` as `hybrid_lm.DecoderLayer`'s, its state the pair (KV
    pool of its attention, Mamba2 state of its mixer)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        c, a, m = config, config.attention, config.multipliers
        self.multipliers = m
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mamba = mamba2_mixer(c)
        self.self_attn = GraniteAttention.from_config(c, bias=a.bias, use_rope=True, key_multiplier=m.key)
        self.pre_ff_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        assert c.mlp.intermediate_size is not None
        self.feed_forward = FalconH1MLP(c.hidden_size, c.mlp.intermediate_size, m.mlp_gate, m.mlp_down)

    def state_specs(self, dtype: torch.dtype, state_dtype: torch.dtype) -> tuple[LayerSpec, LayerSpec]:
        """(the attention's paged KV, the Mamba2 mixer's conv and ssm state): two state layers."""
        return self.self_attn.state_spec(dtype, state_dtype), self.mamba.state_spec(dtype, state_dtype)

    def forward_split(self, hidden: torch.Tensor, pending: torch.Tensor | None, step: StepContext,
                      state: Sequence[LayerState]) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer on hidden + pending, returned as (residual, out) whose sum is its output."""
        kv, mamba_state = state
        m = self.multipliers
        if pending is None:
            normed = self.input_layernorm(hidden, step.backend)
        else:
            hidden, normed = self.input_layernorm.add(hidden, pending, step.backend)
        # (the mixer's core output is read before the attention's core runs: piecewise graphs run them one by one)
        ssm = _scaled(self.mamba(_scaled(normed, m.ssm_in), step, mamba_state), m.ssm_out)
        attn = _scaled(self.self_attn(_scaled(normed, m.attention_in), step, kv), m.attention_out)
        hidden, normed = self.pre_ff_layernorm.add(hidden, ssm + attn, step.backend)
        return hidden, self.feed_forward(normed, step)


class FalconH1ForCausalLM(MambaHybridLM):
    supported_model_types = ("falcon_h1",)
    states_per_layer = 2  # (KV, Mamba2 state) per decoder layer

    def _layer(self, layer_id: int) -> nn.Module:
        del layer_id  # (every layer alike)
        return FalconH1DecoderLayer(self.config)
