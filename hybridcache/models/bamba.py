"""IBM Bamba (`BambaForCausalLM`, model_type `bamba`; Bamba-9B, Bamba-9B-v2): Mamba2 layers with attention layers at
`attn_layer_indices`, a dense MLP after every mixer. Granite-4.0-H's mixers (`GraniteMoeHybridForCausalLM._mixer`) in
the skeleton's decoder layer (`hybrid_lm.DecoderLayer`, as Jamba's) under Bamba's names, without Granite's
multipliers or experts.

Module tree (names equal the checkpoint tensor names; the loader renames `model.final_layernorm` to `model.norm`,
`loader.RENAMED_NAMES`)::

    model.embed_tokens                          [vocab, hidden]
    model.layers.{i}.input_layernorm            RMSNorm (y = w * x / rms(x), not zero-centred)
    model.layers.{i}.mamba                      Mamba2Mixer        (i not in attn_layer_indices)
    model.layers.{i}.self_attn                  GraniteAttention   (i in attn_layer_indices): GQA, softmax scale
                                                head_dim^-0.5, RoPE on the first head_dim x partial_rotary_factor
                                                (0.5) channels of each head
    model.layers.{i}.pre_ff_layernorm
    model.layers.{i}.feed_forward               MLP: down_proj(silu(gate_proj(x)) * up_proj(x))
    model.norm (checkpoint: final_layernorm), lm_head

A layer: h = h + mixer(input_layernorm(h)); h = h + feed_forward(pre_ff_layernorm(h)). Not supported (a ValueError
says so): tensor parallelism, FP8 weights or KV, MTP, images.
"""

from __future__ import annotations

from torch import nn

from hybridcache.layers.mlp import MLP
from hybridcache.layers.norm import RMSNorm
from hybridcache.models.granite import GraniteMoeHybridForCausalLM
from hybridcache.models.hybrid_lm import DecoderLayer


class BambaForCausalLM(GraniteMoeHybridForCausalLM):
    supported_model_types = ("bamba",)
    supports_fp8 = False  # (Granite-4.0-H's FP8 is not inherited: no Bamba FP8 layout is known or tested)

    def _layer(self, layer_id: int) -> nn.Module:
        c = self.config
        assert c.mlp.intermediate_size is not None
        return DecoderLayer(*self._mixer(layer_id), MLP(c.hidden_size, c.mlp.intermediate_size), c.hidden_size,
                            c.rms_norm_eps, norm=RMSNorm, mlp_name="feed_forward", post_norm_name="pre_ff_layernorm")
