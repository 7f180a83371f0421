"""`ModelConfig`: the hyper-parameters of a supported hybrid model, parsed from a Hugging Face config.json.

This module imports no torch: the cache simulator sizes caches from it.

Accepted layouts of config.json:

- a text model (`Qwen3_5ForCausalLM`, `Qwen3_5MoeForCausalLM`, `Qwen3NextForCausalLM`,
  `GraniteMoeHybridForCausalLM`, `NemotronHForCausalLM`, `BambaForCausalLM`, `FalconH1ForCausalLM`,
  `JambaForCausalLM`, `OlmoHybridForCausalLM`, `Lfm2ForCausalLM`, `Lfm2MoeForCausalLM`, `KimiLinearForCausalLM`):
  every field at the top level;
- a multimodal wrapper (`Qwen3_5ForConditionalGeneration`, `Qwen3_5MoeForConditionalGeneration`): the
  language model's fields live in `text_config`; `architectures`, `tie_word_embeddings` and `eos_token_id`
  are read from the top level when present there, otherwise from `text_config`;
- rotary settings either in transformers-5 style (`rope_parameters: {rope_type, rope_theta,
  partial_rotary_factor, ...}`) or in the older style (`rope_theta`, `partial_rotary_factor`,
  `rope_scaling` at the top level, its type under `rope_type` or `type`). `rope_type` is "default" or a scaled
  RoPE whose frequencies transformers computes once (`SCALED_ROPE_TYPES`: "linear", "yarn", "llama3"; its keys,
  e.g. `factor`, `original_max_position_embeddings`, kept as written in `AttentionConfig.rope_scaling`);
  "dynamic" and "longrope", which rescale with the sequence length at run time, are refused, as is "proportional"
  (it rotates the whole head). `mrope_section` (default (11, 11, 10), as transformers) lays out Qwen3.5's
  interleaved M-RoPE for image tokens; text-only input has equal position ids on the three axes, where M-RoPE is
  plain RoPE.

A field config.json leaves out (or sets to null) takes the default of transformers' configuration class of the
model type (`Qwen3_5TextConfig`, `Qwen3_5MoeTextConfig`, `Qwen3NextConfig`, `GraniteMoeHybridConfig`,
`NemotronHConfig`, `BambaConfig`, `FalconH1Config`, `JambaConfig`, `OlmoHybridConfig`, `Lfm2Config`,
`Lfm2MoeConfig`, `KimiLinearConfig`: `_DEFAULTS`),
except the fields that size the model, which must be present: `vocab_size`, `hidden_size`, `num_hidden_layers`,
`num_attention_heads`.

Granite-4.0-H (`granitemoehybrid`): Mamba2 and attention layers, named in `layer_types` (or the older
`layers_block_type`) as "mamba" / "attention" or transformers 5's "linear_attention" / "full_attention" (there, a
"linear_attention" layer is Mamba2); the `mamba_*` fields make the `Mamba2Config` group (`mamba_d_head` "auto":
mamba_expand * hidden_size / mamba_n_heads; `time_step_limit` a pair, its bound written as a number, "Infinity" or
transformers' {"__float__": "Infinity"}); `embedding_multiplier`, `residual_multiplier`, `logits_scaling` and
`attention_multiplier` (the attention's softmax scale) are read into `multipliers` and `AttentionConfig.scale`;
`position_embedding_type` "rope" rotates the whole head, anything else ("nope", null) gives attention without RoPE;
the feed-forward block is `shared_mlp` (width `shared_intermediate_size`) plus, when `num_local_experts` > 0, routed
experts of width `intermediate_size` (top `num_experts_per_tok`, softmax over the top-k logits).
Nemotron-H (`nemotron_h`): each layer one block, its kind from `layers_block_type` ("mamba" / "linear_attention",
"attention" / "full_attention", "mlp"; a layer with no mixer state, `LayerKind.MLP`) or the older
`hybrid_override_pattern` (one letter a layer: M, *, -); `num_hidden_layers`, when written, must equal their count.
The Mamba2 group reads `mamba_num_heads` x `mamba_head_dim`, `n_groups`, `ssm_state_size`, `conv_kernel`,
`use_conv_bias`, `use_bias` (in_proj and out_proj, as transformers), `chunk_size`, `time_step_limit` (the older
`mamba_n_groups`, `mamba_d_conv`, `mamba_conv_bias`, `mamba_chunk_size`, `mamba_dt_limit` win where written, as in
`NemotronHConfig`); `layer_norm_epsilon` is the norms' eps; `mamba_ssm_cache_dtype` (default float32) is
`mamba_ssm_dtype`; the MLP layers are `intermediate_size` wide, `mlp_hidden_act` "relu2" (non-gated); the attention
has no rotary embedding. Its MoE layers ("moe", pattern letter E; `LayerKind.MLP` too, `is_moe_layer` true): ungated
relu^2 experts, `n_routed_experts` of `moe_intermediate_size`, top `num_experts_per_tok`, routed by sigmoid scores
plus `e_score_correction_bias` within the best `topk_group` of `n_group` groups (`GroupedRouting`:
`norm_topk_prob`, `routed_scaling_factor`), one ungated relu^2 shared expert of
`moe_shared_expert_intermediate_size` (transformers builds one whatever `n_shared_experts` says), the experts inside
`moe_latent_size` projections when it is set. Refused: `mlp_bias` or `attention_bias` true, another activation, a
grouping the router cannot run (n_group not dividing the experts, fewer than 2 experts a group, topk_group out of
[1, n_group], more picks than the kept groups hold).
Bamba (`bamba`): Granite's `mamba_*` fields; attention layers at `attn_layer_indices` (the others Mamba2); RoPE on
head_dim x partial_rotary_factor channels, the factor 0.5 unless `rope_parameters` names one (transformers' BambaConfig
sets 0.5 over a top-level value), `attn_rotary_emb` where written equal to that count; a dense MLP of
`intermediate_size`. Refused: `mlp_bias` true, `attn_layer_indices` naming no layer, a `layers_block_type` that
disagrees with them.
Falcon-H1 (`falcon_h1`): every layer `LayerKind.HYBRID` (attention and Mamba2 side by side); Mamba2 channels
`mamba_d_ssm` (null: mamba_expand * hidden_size) in `mamba_n_heads` heads, Granite's other `mamba_*` fields plus
`mamba_rms_norm`, `mamba_norm_before_gate`, `projectors_bias` (out_proj's bias) and `ssm_multipliers` (five: z, x,
B, C, dt); the muP scalars `embedding_multiplier`, `lm_head_multiplier`, `key_multiplier`, `attention_in_multiplier`,
`attention_out_multiplier`, `ssm_in_multiplier`, `ssm_out_multiplier`, `mlp_multipliers` (gate, down) into
`multipliers`; RoPE on the whole head. Refused: `mamba_use_mlp` false, `attn_layer_indices` set, a layer type other
than "hybrid", `partial_rotary_factor` other than 1, `mlp_bias` true.
Jamba (`jamba`): Mamba1 layers (`LayerKind.MAMBA1`, the `Mamba1Config` group: `mamba_expand` * hidden_size channels,
`mamba_d_state`, `mamba_dt_rank` ("auto": ceil(hidden_size / 16)), `mamba_d_conv`, `mamba_conv_bias`,
`mamba_proj_bias`) and attention layers without RoPE where i % attn_layer_period == attn_layer_offset (a written
`layers_block_type`, which transformers ignores, must agree); a SiLU-gated MLP of `intermediate_size` after every
mixer, or, where i % expert_layer_period == expert_layer_offset and `num_experts` > 1, `num_experts` (or its alias
`num_local_experts`, as JambaConfig maps it) routed experts of that width (top `num_experts_per_tok` of the softmax,
not renormalised); `head_dim` read where written, else hidden_size / num_attention_heads. Refused: an offset not below
its period, `attention_bias` true, `mamba_inner_layernorms` false, another activation, `num_local_experts` and
`num_experts` both written and different, a null where JambaConfig requires a value (`num_key_value_heads`,
`rms_norm_eps`, ...: `_JAMBA_NOT_NULL`); `use_mamba_kernels` and `sliding_window` (transformers' Jamba reads neither)
are not read.
OLMo Hybrid (`olmo_hybrid`): gated DeltaNet ("linear_attention") and attention ("full_attention") layers, at least
one of each (as transformers checks; left out, every fourth layer attends); the DeltaNet group's fields as Qwen's
(`linear_*`; left out: as many key and value heads as attention heads, key head dim 0.75 * hidden_size / key heads,
value head dim twice that), `linear_allow_neg_eigval` (default true: beta = 2 sigmoid(b),
`GatedDeltaConfig.beta_scale`); the attention's head_dim hidden_size / num_attention_heads unless written, RoPE on the
whole head only where `rope_theta` is not written as null (the released checkpoints write `rope_parameters:
{"rope_theta": null}`: no rotary embedding; `rope_parameters: null` is transformers' default RoPE, theta 10,000);
`partial_rotary_factor` other than 1 is refused (transformers' OLMo rotary rotates the whole head).
LFM2 (`lfm2`): short-convolution ("conv", `LayerKind.SHORT_CONV`) and attention ("full_attention") layers, from
`layer_types` or else `full_attn_idxs` (both left out: every layer attends, as transformers); `Lfm2Config`'s names:
`norm_eps` (not rms_norm_eps, which transformers does not read), `block_ff_dim` (wins over intermediate_size) and
`tie_embedding` (wins over tie_word_embeddings, default true) as transformers' aliases, `conv_L_cache` (the conv's
kernel size) and `conv_bias` (the short conv's in_proj, conv and out_proj) in the `ShortConvConfig` group; the MLP
width as `Lfm2MLP` adjusts it (`block_auto_adjust_ff_dim`: 2/3 of it, times `block_ffn_dim_multiplier`, rounded up
to a multiple of `block_multiple_of`); RoPE on the whole head (`partial_rotary_factor` other than 1 and
`attention_bias` true are refused; transformers reads neither); `conv_dim` / `conv_dim_out` are not read (transformers'
short conv is hidden_size wide).
LFM2-MoE (`lfm2_moe`): LFM2's layers (`layer_types` required, as transformers' Lfm2MoeConfig; no block_ff_dim alias and
no width adjustment: `Lfm2MoeMLP` is intermediate_size wide) whose first `num_dense_layers` MLPs are dense and the rest
MoE blocks: `num_experts` SiLU-gated experts of `moe_intermediate_size`, top `num_experts_per_tok` of sigmoid scores
plus `expert_bias` (`use_expert_bias`; false is refused), their scores renormalised (+ 1e-6) when `norm_topk_prob`,
times `routed_scaling_factor`; no shared expert (`GroupedRouting` with one group).
Kimi Linear (`kimi_linear`): KDA ("linear_attention", the `gated_delta` group with as many key as value heads:
`linear_attn_config`'s `num_heads` of `head_dim`, `short_conv_kernel_size`) and MLA ("full_attention", the `mla`
group: `q_lora_rank`, `kv_lora_rank`, `qk_nope_head_dim`, `qk_rope_head_dim`, `v_head_dim`; `attention` holds its
paged KV's shape, no rotary embedding) layers from `layer_types`, else `linear_attn_config`'s 1-based `kda_layers` /
`full_attn_layers`; the checkpoints' spellings (`num_experts`, `num_experts_per_token`, `num_shared_experts`,
`moe_renormalize`, `num_expert_group`, `model_max_length`) read as `KimiLinearConfig`'s names (`_KIMI_ALIASES`);
dense SiLU MLPs in the "dense" layers of `mlp_layer_types` (else the first `first_k_dense_replace`), MoE blocks in the
others (SiLU experts of `moe_intermediate_size`, group-limited sigmoid routing with `e_score_correction_bias`, a shared
expert of `n_shared_experts` x moe_intermediate_size). Refused: `mla_use_nope` false, MTP layers, another router
activation or `hidden_act`, `moe_layer_freq` other than 1, `attention_bias` true, num_key_value_heads other than
num_attention_heads, the later models' `mla_use_output_gate` / `mhc` / `use_full_rank_gate`.
A malformed file (not JSON, not an object, a field of the wrong type, a count of 0 that would divide) is a
`ValueError` naming config.json and the field.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, replace
from enum import Enum
from pathlib import Path
from typing import Any

_logger = logging.getLogger(__name__)


class LayerKind(str, Enum):
    """The token mixer of a decoder layer, spelled as in config.json's `layer_types` (a str; `str()` and
    formatting give the value, as Python 3.11's StrEnum, which 3.10 lacks)."""

    __str__ = str.__str__
    __format__ = str.__format__

    LINEAR_ATTENTION = "linear_attention"  # gated DeltaNet
    FULL_ATTENTION = "full_attention"  # (gated) attention over the paged KV cache
    MAMBA2 = "mamba"  # Mamba2 (Granite-4.0-H's spelling; transformers 5 writes "linear_attention" there)
    MLP = "mlp"  # a feed-forward block as a layer of its own, no token mixer, no state (Nemotron-H's "-" and, with
    # `is_moe_layer` true, its MoE layers "E")
    HYBRID = "hybrid"  # attention and Mamba2 side by side on the same input, then an MLP (Falcon-H1's every layer):
    # the layer holds paged KV and a Mamba2 state, so it is both an attention layer and a Mamba2 layer
    MAMBA1 = "mamba1"  # Mamba1 with Jamba's inner norms (Jamba writes "mamba", which for Granite means Mamba2)
    SHORT_CONV = "conv"  # LFM2's gated short convolution: a conv state only


# The layer kinds with a fixed-size state (Falcon-H1's hybrid layers hold one beside their KV)
RECURRENT_KINDS = frozenset({LayerKind.LINEAR_ATTENTION, LayerKind.MAMBA2, LayerKind.HYBRID, LayerKind.MAMBA1,
                             LayerKind.SHORT_CONV})

# The layer kinds of each text model type, by their config.json spellings.
_QWEN_KINDS = {"linear_attention": LayerKind.LINEAR_ATTENTION, "full_attention": LayerKind.FULL_ATTENTION}
_MAMBA_KINDS = {"mamba": LayerKind.MAMBA2, "linear_attention": LayerKind.MAMBA2, "attention": LayerKind.FULL_ATTENTION,
                "full_attention": LayerKind.FULL_ATTENTION}
# Nemotron-H: transformers 5's names, the older ones it remaps, and `hybrid_override_pattern`'s letters
_NEMOTRON_KINDS = {**_MAMBA_KINDS, "mlp": LayerKind.MLP, "moe": LayerKind.MLP}  # (MoE: `is_moe_layer` says it)
_NEMOTRON_PATTERN = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
_FALCON_KINDS = {"hybrid": LayerKind.HYBRID}  # (transformers' FalconH1Config.layers_block_type: "hybrid" every layer)
_JAMBA_KINDS = {"mamba": LayerKind.MAMBA1, "attention": LayerKind.FULL_ATTENTION}
_LFM2_KINDS = {"conv": LayerKind.SHORT_CONV, "full_attention": LayerKind.FULL_ATTENTION}


# model_type of the text model each supported model_type stands for.
_TEXT_MODEL_TYPES = {
    "qwen3_5": "qwen3_5_text",
    "qwen3_5_text": "qwen3_5_text",
    "qwen3_5_moe": "qwen3_5_moe_text",
    "qwen3_5_moe_text": "qwen3_5_moe_text",
    "qwen3_next": "qwen3_next",
    "granitemoehybrid": "granitemoehybrid",
    "nemotron_h": "nemotron_h",
    "bamba": "bamba",
    "falcon_h1": "falcon_h1",
    "jamba": "jamba",
    "olmo_hybrid": "olmo_hybrid",
    "lfm2": "lfm2",
    "lfm2_moe": "lfm2_moe",
    "kimi_linear": "kimi_linear",
}

# transformers' defaults (its configuration classes of each text model type) for the fields config.json may leave
# out; `tests/models/test_config.py` checks them against the installed transformers.
_COMMON_DEFAULTS: dict[str, Any] = {
    "head_dim": 256, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "full_attention_interval": 4,
    "partial_rotary_factor": 0.25, "rope_theta": 10000.0, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
    "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
}
_MOE_DEFAULTS: dict[str, Any] = {"moe_intermediate_size": 512, "shared_expert_intermediate_size": 512}
_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen3_5_text": {**_COMMON_DEFAULTS, "num_key_value_heads": 4, "intermediate_size": 12288},
    "qwen3_5_moe_text": {**_COMMON_DEFAULTS, **_MOE_DEFAULTS, "num_key_value_heads": 2, "num_experts": 256,
                         "num_experts_per_tok": 8},
    "qwen3_next": {**_COMMON_DEFAULTS, **_MOE_DEFAULTS, "num_key_value_heads": 2, "intermediate_size": 5632,
                   "num_experts": 512, "num_experts_per_tok": 10, "decoder_sparse_step": 1},
    # (head_dim: hidden_size / num_attention_heads and num_key_value_heads: num_attention_heads, set when parsed)
    "granitemoehybrid": {
        "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "partial_rotary_factor": 1.0,
        "intermediate_size": 11008, "shared_intermediate_size": 1024, "num_local_experts": 8,
        "num_experts_per_tok": 2, "embedding_multiplier": 1.0, "residual_multiplier": 1.0,
        "attention_multiplier": 1.0, "logits_scaling": 1.0, "mamba_n_heads": 128, "mamba_n_groups": 1,
        "mamba_d_state": 256, "mamba_d_head": "auto", "mamba_d_conv": 4, "mamba_expand": 2, "mamba_chunk_size": 256,
    },
    # (`NemotronHConfig`; rope_theta and partial_rotary_factor unused: its attention has no rotary embedding)
    "nemotron_h": {
        "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 4096, "layer_norm_epsilon": 1e-5,
        "intermediate_size": 21504, "mlp_hidden_act": "relu2", "mamba_hidden_act": "silu", "mamba_num_heads": 128,
        "mamba_head_dim": 64, "n_groups": 8, "ssm_state_size": 128, "conv_kernel": 4, "chunk_size": 128,
        "mamba_ssm_cache_dtype": "float32", "rope_theta": 10000.0, "partial_rotary_factor": 1.0,
        "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 7688,
        "moe_shared_expert_intermediate_size": 7688, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0,
    },
    # (`BambaConfig`: partial_rotary_factor 0.5 whatever the top level says, as transformers sets it; head_dim:
    # hidden_size / num_attention_heads, set when parsed)
    "bamba": {
        "num_key_value_heads": 8, "max_position_embeddings": 262144, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "partial_rotary_factor": 0.5, "intermediate_size": 14336, "mamba_n_heads": 128, "mamba_n_groups": 1,
        "mamba_d_state": 256, "mamba_d_head": "auto", "mamba_d_conv": 4, "mamba_expand": 2, "mamba_chunk_size": 256,
    },
    # (`FalconH1Config`; head_dim: hidden_size / num_attention_heads, set when parsed; mamba_d_ssm written null:
    # mamba_expand * hidden_size)
    "falcon_h1": {
        "num_key_value_heads": 8, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "partial_rotary_factor": 1.0, "intermediate_size": 14336, "mamba_d_ssm": 1024, "mamba_n_heads": 128,
        "mamba_d_head": "auto", "mamba_n_groups": 1, "mamba_d_state": 256, "mamba_d_conv": 4, "mamba_expand": 2,
        "mamba_chunk_size": 256, "embedding_multiplier": 1.0, "lm_head_multiplier": 1.0, "key_multiplier": 1.0,
        "attention_in_multiplier": 1.0, "attention_out_multiplier": 1.0, "ssm_in_multiplier": 1.0,
        "ssm_out_multiplier": 1.0, "mlp_multipliers": [1.0, 1.0], "ssm_multipliers": [1.0, 1.0, 1.0, 1.0, 1.0],
    },
    # (`JambaConfig`; head_dim: hidden_size / num_attention_heads, set when parsed; rope_theta and
    # partial_rotary_factor unused: its attention has no rotary embedding)
    "jamba": {
        "num_key_value_heads": 8, "max_position_embeddings": 262144, "rms_norm_eps": 1e-6, "intermediate_size": 14336,
        "num_experts": 16, "num_experts_per_tok": 2, "expert_layer_period": 2, "expert_layer_offset": 1,
        "attn_layer_period": 8, "attn_layer_offset": 4, "mamba_d_state": 16, "mamba_d_conv": 4, "mamba_expand": 2,
        "mamba_dt_rank": "auto", "rope_theta": 10000.0, "partial_rotary_factor": 1.0,
    },
    # (`OlmoHybridConfig`; the head counts and dims it derives from other fields: `_olmo_defaults`)
    "olmo_hybrid": {
        "max_position_embeddings": 65536, "rms_norm_eps": 1e-6, "intermediate_size": 11008, "rope_theta": 10000.0,
        "partial_rotary_factor": 1.0, "linear_conv_kernel_dim": 4,
    },
    # (`Lfm2Config`; head_dim: hidden_size / num_attention_heads, set when parsed; rms_norm_eps is its norm_eps)
    "lfm2": {
        "max_position_embeddings": 128000, "rms_norm_eps": 1e-5, "intermediate_size": 12288, "num_key_value_heads": 8,
        "rope_theta": 1000000.0, "partial_rotary_factor": 1.0, "conv_L_cache": 3, "block_multiple_of": 256,
        "block_ffn_dim_multiplier": 1.0,
    },
    # (`KimiLinearConfig`, under the names transformers keeps: `_KIMI_ALIASES` maps the checkpoints' spellings;
    # num_key_value_heads: num_attention_heads, set when parsed)
    "kimi_linear": {
        "max_position_embeddings": 1048576, "rms_norm_eps": 1e-5, "intermediate_size": 9216,
        "moe_intermediate_size": 1024, "num_local_experts": 256, "num_experts_per_tok": 8, "n_shared_experts": 1,
        "routed_scaling_factor": 2.446, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "qk_nope_head_dim": 128, "n_group": 1, "topk_group": 1, "linear_head_dim": 128, "linear_num_heads": 32,
        "linear_conv_kernel_dim": 4, "first_k_dense_replace": 1,
    },
    "lfm2_moe": {
        "max_position_embeddings": 128000, "rms_norm_eps": 1e-5, "intermediate_size": 7168, "num_key_value_heads": 8,
        "rope_theta": 1000000.0, "partial_rotary_factor": 1.0, "conv_L_cache": 3, "moe_intermediate_size": 1792,
        "num_dense_layers": 2, "num_experts_per_tok": 4, "num_experts": 32, "routed_scaling_factor": 1.0,
    },
}

# rope_type values whose inverse frequencies transformers' `ROPE_INIT_FUNCTIONS` computes from config.json alone,
# each with the keys it needs, numbers > 0 (original_max_position_embeddings, left out, is max_position_embeddings,
# as in transformers' `standardize_rope_params`).
SCALED_ROPE_TYPES: dict[str, tuple[str, ...]] = {
    "linear": ("factor",),
    "yarn": ("factor", "original_max_position_embeddings"),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}
# Types transformers knows that hybridcache refuses, with the reason.
_REFUSED_ROPE_TYPES = {
    "dynamic": "rescales with the sequence length at run time",
    "longrope": "rescales with the sequence length at run time",
    "proportional": "rotates the whole head, not the first rotary_dim channels",
}
# The rope_parameters keys that are not scaling settings (read into AttentionConfig's own fields, or unused).
_ROPE_BASE_KEYS = ("rope_type", "type", "rope_theta", "partial_rotary_factor", "mrope_section", "mrope_interleaved")


@dataclass(frozen=True)
class AttentionConfig:
    """Gated full attention: `num_heads` query heads (each with an output gate), `num_kv_heads` key/value
    heads of `head_dim`, RoPE on the first `rotary_dim` channels of each head.

    `rope_scaling`: () for plain RoPE, else the sorted (key, value) items of a scaled RoPE, `rope_type` among them
    (e.g. (("factor", 4.0), ("original_max_position_embeddings", 262144), ("rope_type", "yarn"))), lists as
    tuples; `max_position_embeddings`: the model's, which YaRN may read (`layers.rotary.scaled_inv_freq`).
    `use_rope` False: no rotary embedding at all (Granite-4.0-H's "nope"); `scale`: see `softmax_scale`."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    bias: bool
    rope_theta: float
    partial_rotary_factor: float
    mrope_section: tuple[int, int, int] = (11, 11, 10)
    rope_scaling: tuple[tuple[str, Any], ...] = ()
    max_position_embeddings: int = 32768
    use_rope: bool = True
    scale: float | None = None

    @property
    def softmax_scale(self) -> float:
        """The attention's scale of q.k: `scale` when config.json sets one (Granite's attention_multiplier), else
        1 / sqrt(head_dim)."""
        return self.head_dim**-0.5 if self.scale is None else self.scale

    @property
    def rotary_dim(self) -> int:
        """Leading channels of each attention head that RoPE rotates (the rest pass through)."""
        return int(self.head_dim * self.partial_rotary_factor)


@dataclass(frozen=True)
class GatedDeltaConfig:
    """Gated DeltaNet: `num_k_heads` query/key heads of `k_head_dim`, `num_v_heads` value heads of
    `v_head_dim`, a depthwise causal convolution of `conv_kernel_size` over q | k | v. `allow_neg_eigval` (OLMo
    Hybrid's `linear_allow_neg_eigval`): beta = 2 sigmoid(b), in (0, 2), so the state's transition I - beta k k^T
    may have a negative eigenvalue."""

    num_k_heads: int
    num_v_heads: int
    k_head_dim: int
    v_head_dim: int
    conv_kernel_size: int
    allow_neg_eigval: bool = False

    @property
    def beta_scale(self) -> float:
        """What sigmoid(b) is multiplied by to give beta: 2 with `allow_neg_eigval`, else 1."""
        return 2.0 if self.allow_neg_eigval else 1.0

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.k_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.v_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the short convolution: q | k | v."""
        return 2 * self.key_dim + self.value_dim

    @property
    def conv_width(self) -> int:
        """Past pre-convolution inputs kept per channel: kernel size - 1."""
        return self.conv_kernel_size - 1


@dataclass(frozen=True)
class MLAConfig:
    """Kimi Linear's multi-head latent attention (DeepSeek-V2's MLA without rotary embedding, `mla_use_nope`): q
    from `q_proj` (or `q_a_proj` -> norm -> `q_b_proj` of rank `q_lora_rank`), a latent of `kv_lora_rank` and a
    key part of `qk_rope_head_dim` shared by every head from `kv_a_proj_with_mqa`, the latent expanded per head
    into a key part of `qk_nope_head_dim` and a value of `v_head_dim` by `kv_b_proj`. A head's key is
    [k_nope | k_shared] (`qk_head_dim` wide), the softmax scale qk_head_dim^-1/2. The paged KV holds the expanded
    keys and values, both zero-padded to `cache_head_dim` (`ModelConfig.attention.head_dim`)."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_head_dim(self) -> int:
        """The head dim of the paged KV: the wider of the key and value heads, rounded up to a power of two (the
        CUDA paged-attention kernel's need; 192 -> 256 for the released models)."""
        return 1 << (max(self.qk_head_dim, self.v_head_dim) - 1).bit_length()


@dataclass(frozen=True)
class Mamba2Config:
    """Mamba2: `num_heads` heads of `head_dim` channels, `num_groups` groups of B and C with `state_size` each, a
    depthwise causal convolution of `conv_kernel_size` over x | B | C; dt clamped to `time_step_limit` after its
    softplus; `chunk_size`: the checkpoint's scan chunk (kept for reference; results do not depend on it)."""

    num_heads: int
    head_dim: int
    num_groups: int
    state_size: int
    conv_kernel_size: int
    conv_bias: bool
    proj_bias: bool
    chunk_size: int
    time_step_limit: tuple[float, float] = (0.0, float("inf"))
    # Falcon-H1's variations (the others keep these defaults): no gated norm (`rms_norm` False: y * silu(z)), the norm
    # before the gate, out_proj's bias apart from in_proj's (None: `proj_bias`), and the scales of z, x, B, C, dt after
    # in_proj (its muP vector, `ssm_multipliers`)
    rms_norm: bool = True
    norm_before_gate: bool = False
    out_proj_bias: bool | None = None
    in_multipliers: tuple[float, float, float, float, float] = (1.0, 1.0, 1.0, 1.0, 1.0)

    @property
    def intermediate_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the short convolution: x | B | C."""
        return self.intermediate_size + 2 * self.num_groups * self.state_size

    @property
    def conv_width(self) -> int:
        """Past pre-convolution inputs kept per channel: kernel size - 1."""
        return self.conv_kernel_size - 1


@dataclass(frozen=True)
class Mamba1Config:
    """Mamba1 (Jamba's): `intermediate_size` channels (mamba_expand * hidden_size), each with `state_size` state
    entries of their own decay; dt of rank `dt_rank` before dt_proj; a depthwise causal convolution of
    `conv_kernel_size` over the channels; `conv_bias` on it, `proj_bias` on in_proj and out_proj."""

    intermediate_size: int
    state_size: int
    dt_rank: int
    conv_kernel_size: int
    conv_bias: bool
    proj_bias: bool

    @property
    def conv_dim(self) -> int:
        """Channels of the short convolution: x."""
        return self.intermediate_size

    @property
    def conv_width(self) -> int:
        """Past pre-convolution inputs kept per channel: kernel size - 1."""
        return self.conv_kernel_size - 1


@dataclass(frozen=True)
class ShortConvConfig:
    """LFM2's gated short convolution over the hidden_size channels: B | C | x = in_proj(h), y = C * conv(B * x)
    (depthwise, causal, `conv_kernel_size` taps, no activation), out_proj(y); `bias` on in_proj, the conv and
    out_proj (`conv_bias`)."""

    conv_kernel_size: int
    bias: bool

    @property
    def conv_width(self) -> int:
        """Past pre-convolution inputs kept per channel: kernel size - 1."""
        return self.conv_kernel_size - 1


@dataclass(frozen=True)
class Multipliers:
    """The muP scalings, all 1 but where config.json sets them. Granite's: the embedding times `embedding`, each
    block's output times `residual` before its residual add, the logits divided by `logits_scaling`. Falcon-H1's:
    the embedding times `embedding`, the logits times `logits` (its lm_head_multiplier), the keys times `key` (before
    RoPE), the attention's input and output times `attention_in` / `attention_out`, the Mamba2 mixer's times `ssm_in`
    / `ssm_out`, the MLP's gate projection times `mlp_gate` (before its SiLU) and its output times `mlp_down`."""

    embedding: float = 1.0
    residual: float = 1.0
    logits_scaling: float = 1.0
    logits: float = 1.0
    key: float = 1.0
    attention_in: float = 1.0
    attention_out: float = 1.0
    ssm_in: float = 1.0
    ssm_out: float = 1.0
    mlp_gate: float = 1.0
    mlp_down: float = 1.0


@dataclass(frozen=True)
class GroupedRouting:
    """Nemotron-H's router (DeepSeek-V3's "noaux_tc"), in fp32: scores = sigmoid(logits); the choice reads
    scores + e_score_correction_bias (a per-expert tensor of the checkpoint), in which each of `num_groups` groups
    of E / num_groups experts ranks by the sum of its two best, the `topk_groups` best groups are kept and the top
    k experts of those picked; the weights are the picks' uncorrected scores, divided by their sum (+ `renorm_eps`)
    when `norm_topk_prob`, times `scaling_factor` (`routed_scaling_factor`). LFM2-MoE's router is the one-group case
    with its `expert_bias` as the correction bias and a renorm_eps of 1e-6."""

    num_groups: int
    topk_groups: int
    scaling_factor: float
    renorm_eps: float = 1e-20


@dataclass(frozen=True)
class FeedForwardConfig:
    """The feed-forward block after each mixer: a dense SiLU-gated MLP of `intermediate_size`, or a sparse
    MoE block (`num_experts` routed experts, top `num_experts_per_tok`, plus a gated shared expert) where
    `is_moe_layer`. `num_experts == 0` means dense everywhere. `in_own_layers` (Nemotron-H): no block after the
    mixers; the dense blocks (non-gated, `ModelConfig.hidden_act` "relu2") are the layers of kind `LayerKind.MLP`,
    and so are its MoE layers, `moe_layer_ids` (ungated relu^2 experts and shared expert, routed by
    `grouped_routing`, the experts inside `moe_latent_size` projections when set)."""

    intermediate_size: int | None
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    norm_topk_prob: bool
    decoder_sparse_step: int
    mlp_only_layers: tuple[int, ...]
    in_own_layers: bool = False
    moe_layer_ids: tuple[int, ...] = ()
    grouped_routing: GroupedRouting | None = None
    moe_latent_size: int | None = None

    @classmethod
    def dense(cls, intermediate_size: int, in_own_layers: bool = False) -> FeedForwardConfig:
        """A dense SiLU-gated MLP of `intermediate_size` (no experts) after every mixer, or in layers of its own."""
        return cls(intermediate_size=intermediate_size, num_experts=0, num_experts_per_tok=0, moe_intermediate_size=0,
                   shared_expert_intermediate_size=0, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=(),
                   in_own_layers=in_own_layers)

    def is_moe_layer(self, layer_id: int) -> bool:
        """True where layer `layer_id` has a sparse MoE block (the transformers rule; where the feed-forward blocks
        are layers of their own, `in_own_layers`, or where `moe_layer_ids` lists them (Jamba), those layers)."""
        if self.in_own_layers or self.moe_layer_ids:
            return layer_id in self.moe_layer_ids
        return (
            layer_id not in self.mlp_only_layers
            and self.num_experts > 0
            and (layer_id + 1) % self.decoder_sparse_step == 0
        )


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of one hybrid decoder-only model: the model-wide fields, then one group per layer
    family (`attention`, `gated_delta`, `mamba2`, `mamba1`, `short_conv`, `mla`) and the feed-forward group (`mlp`). A
    new family is a new group, a new `LayerKind` and a new mixer (Kimi Linear's KDA reuses `gated_delta` and
    `LayerKind.LINEAR_ATTENTION`). `gated_delta` holds transformers' Qwen defaults where the model has no DeltaNet or
    KDA layer (nothing reads it then); `mamba2`, `mamba1`, `short_conv` and `mla` are None where the model has no such
    layer.

    `model_type` is the text model's type (`qwen3_5_text`, `qwen3_5_moe_text`, `qwen3_next`, `granitemoehybrid`,
    `nemotron_h`, `bamba`, `falcon_h1`, `jamba`, `olmo_hybrid`, `lfm2`, `lfm2_moe`, `kimi_linear`) even when
    config.json describes a multimodal wrapper;
    `architecture` is the config.json entry as written.
    `mamba_ssm_dtype`: the recurrent state dtype config.json names (Qwen3.5 checkpoints say "float32"), None
    when it names none; what `--mamba-ssm-cache-dtype auto` resolves to (see `engine_args.auto_ssm_dtype`).
    """

    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[LayerKind, ...]
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]
    tie_word_embeddings: bool
    torch_dtype: str
    rms_norm_eps: float
    hidden_act: str
    attention: AttentionConfig
    gated_delta: GatedDeltaConfig
    mlp: FeedForwardConfig
    mamba_ssm_dtype: str | None = None
    mamba2: Mamba2Config | None = None
    multipliers: Multipliers = Multipliers()
    mamba1: Mamba1Config | None = None
    short_conv: ShortConvConfig | None = None
    mla: MLAConfig | None = None

    # ---- derived quantities -------------------------------------------------------------------------
    @property
    def max_model_len(self) -> int:
        """The longest prompt + output the model serves, as vLLM derives it: `max_position_embeddings`, or with a
        scaled RoPE that stretches it, YaRN's original_max_position_embeddings x factor and linear's
        max_position_embeddings x factor (llama3's scaling leaves it). Qwen3-Next with YaRN factor 4 over 262,144
        original positions: 1,048,576."""
        scaling = dict(self.attention.rope_scaling)
        if scaling.get("rope_type") == "yarn":
            return int(scaling["original_max_position_embeddings"] * scaling["factor"])
        if scaling.get("rope_type") == "linear":
            return int(self.max_position_embeddings * scaling["factor"])
        return self.max_position_embeddings

    @property
    def linear_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t is LayerKind.LINEAR_ATTENTION)

    @property
    def attention_layer_ids(self) -> tuple[int, ...]:
        """Layers with paged KV (attention layers, and Falcon-H1's hybrid layers)."""
        return tuple(i for i, t in enumerate(self.layer_types) if t in (LayerKind.FULL_ATTENTION, LayerKind.HYBRID))

    @property
    def mamba2_layer_ids(self) -> tuple[int, ...]:
        """Layers with a Mamba2 mixer (Mamba2 layers, and Falcon-H1's hybrid layers)."""
        return tuple(i for i, t in enumerate(self.layer_types) if t in (LayerKind.MAMBA2, LayerKind.HYBRID))

    @property
    def mamba1_layer_ids(self) -> tuple[int, ...]:
        """Layers with a Mamba1 mixer (Jamba's)."""
        return tuple(i for i, t in enumerate(self.layer_types) if t is LayerKind.MAMBA1)

    @property
    def recurrent_layer_ids(self) -> tuple[int, ...]:
        """Layers with a fixed-size state (gated DeltaNet, Mamba2, Falcon-H1's hybrid layers, Mamba1, LFM2's short
        convolution)."""
        return tuple(i for i, t in enumerate(self.layer_types) if t in RECURRENT_KINDS)

    def has_feed_forward(self, layer_id: int) -> bool:
        """Whether layer `layer_id` runs a feed-forward block: every layer, or (`mlp.in_own_layers`) those of
        kind MLP."""
        return not self.mlp.in_own_layers or self.layer_types[layer_id] is LayerKind.MLP

    @property
    def num_linear_layers(self) -> int:
        return len(self.linear_layer_ids)

    @property
    def num_attention_layers(self) -> int:
        return len(self.attention_layer_ids)

    def is_moe_layer(self, layer_id: int) -> bool:
        """True where layer `layer_id` has a sparse MoE block (the transformers rule)."""
        return self.mlp.is_moe_layer(layer_id)

    # ---- parsing ------------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """Parse a config.json dict. Raises `ValueError` naming config.json and the field for unsupported,
        inconsistent or malformed settings."""
        if not isinstance(raw, Mapping):
            raise ValueError(f"config.json must hold a JSON object, not {type(raw).__name__}")
        try:
            return cls._parse(raw)._validated()
        except (TypeError, KeyError, AttributeError, ZeroDivisionError) as error:  # a field of a shape not checked
            raise ValueError(f"config.json is malformed: {type(error).__name__}: {error}") from None

    @classmethod
    def _parse(cls, raw: Mapping[str, Any]) -> ModelConfig:
        architectures = raw.get("architectures") or []
        if not architectures:
            raise ValueError("config.json has no 'architectures' entry")
        if not isinstance(architectures, list) or not all(isinstance(name, str) for name in architectures):
            raise ValueError(f"config.json architectures {architectures!r} must be a list of class names")
        text = raw.get("text_config") or raw
        if not isinstance(text, Mapping):
            raise ValueError(f"config.json text_config must be an object, not {type(text).__name__}")
        field = "text_config.model_type" if text is not raw and text.get("model_type") else "model_type"
        written = text.get("model_type") or raw.get("model_type")
        model_type = _TEXT_MODEL_TYPES.get(written or "")
        if model_type is None:
            raise ValueError(f"unsupported {field} {written!r} in config.json; supported: {sorted(_TEXT_MODEL_TYPES)}")
        if model_type == "kimi_linear":
            return _kimi_linear_config(raw, text, architectures[0])
        granite, nemotron, jamba = model_type == "granitemoehybrid", model_type == "nemotron_h", model_type == "jamba"
        bamba, falcon = model_type == "bamba", model_type == "falcon_h1"
        olmo, lfm2, lfm2_moe = model_type == "olmo_hybrid", model_type in ("lfm2", "lfm2_moe"), model_type == "lfm2_moe"
        if nemotron:
            text = _nemotron_section(text)
        if lfm2:
            text = _lfm2_section(text, moe=lfm2_moe)
        if jamba:
            text = _jamba_section(text)
        if bamba:  # (BambaConfig sets partial_rotary_factor 0.5 over the top-level one; rope_parameters' wins)
            text = {**text, "partial_rotary_factor": None}
        fields = _Fields(text, _derived_defaults(model_type, text))

        def pick(key: str, default: Any = None) -> Any:
            """A wrapper-level setting wins over the text config's (they are the same in practice)."""
            if key in raw and raw[key] is not None:
                return raw[key]
            return text.get(key, default)

        moe_layer_ids: tuple[int, ...] = ()
        if nemotron:
            layer_types = _nemotron_layer_types(text)
        elif jamba:
            layer_types, moe_layer_ids = _jamba_layout(fields)
        else:
            layer_types = text.get("layer_types")
        num_layers = len(layer_types) if nemotron and text.get("num_hidden_layers") is None else (
            fields.integer("num_hidden_layers"))
        if bamba or falcon:
            layer_types = _bamba_layer_types(text, num_layers) if bamba else _falcon_layer_types(text, num_layers)
        if layer_types is None and granite:  # the older key; neither: every layer Mamba2 (as transformers)
            layer_types = text.get("layers_block_type") or ["mamba"] * num_layers
        if layer_types is None and olmo:
            layer_types = _olmo_layer_types(num_layers)
        if layer_types is None:
            interval = fields.integer("full_attention_interval")
            layer_types = [
                LayerKind.LINEAR_ATTENTION if (i + 1) % interval else LayerKind.FULL_ATTENTION
                for i in range(num_layers)
            ]
        if not isinstance(layer_types, list) or not all(isinstance(t, str) for t in layer_types):
            raise ValueError(f"config.json layer_types {layer_types!r} must be a list of layer type names")
        kinds = (_NEMOTRON_KINDS if nemotron else _MAMBA_KINDS if granite or bamba else _FALCON_KINDS if falcon
                 else _JAMBA_KINDS if jamba else _LFM2_KINDS if lfm2 else _QWEN_KINDS)
        if len(layer_types) != num_layers or set(layer_types) - set(kinds):
            raise ValueError(f"layer_types {tuple(layer_types)} do not describe {num_layers} supported layers "
                             f"(layer types of {written!r}: {sorted(kinds)})")
        if nemotron:
            moe_layer_ids = tuple(i for i, t in enumerate(layer_types) if t == "moe")
        layer_types = tuple(kinds[t] for t in layer_types)
        if olmo and len(set(layer_types)) < 2:  # (transformers' OlmoHybridConfig.validate_architecture)
            raise ValueError(f"config.json layer_types {[str(t) for t in layer_types]}: OLMo Hybrid needs at least "
                             "one 'linear_attention' and one 'full_attention' layer")

        hidden_act = _nemotron_activation(fields) if nemotron else text.get("hidden_act", "silu")
        if hidden_act != "silu" and not nemotron:
            raise ValueError(f"hidden_act {hidden_act!r} is not supported (only 'silu')")
        if granite:
            attention = _attention_config(fields, use_rope=_granite_rope(text.get("position_embedding_type")),
                                          scale=fields.number("attention_multiplier"))
        elif olmo or lfm2:
            attention = _whole_head_rope_attention_config(fields, "OLMo Hybrid" if olmo else "LFM2")
        else:
            attention = _attention_config(fields, use_rope=not (nemotron or jamba))
        if (nemotron or jamba or lfm2) and attention.bias:
            family = "LFM2" if lfm2 else architectures[0]
            raise ValueError(f"config.json attention_bias true is not supported for {family} (transformers' "
                             "attention of this model has no biases)")
        if bamba:
            _check_bamba_rotary(text, attention)
        if falcon:
            _check_falcon_h1(fields, attention)
        mamba1 = None
        if nemotron:
            mlp, mamba2 = _nemotron_feed_forward_config(fields, moe_layer_ids), _nemotron_mamba2_config(fields)
        elif granite:
            mlp, mamba2 = _granite_feed_forward_config(fields), _mamba2_config(fields)
        elif bamba:
            mlp, mamba2 = _dense_feed_forward_config(fields, "Bamba"), _mamba2_config(fields)
        elif falcon:
            mlp, mamba2 = _dense_feed_forward_config(fields, "Falcon-H1"), _falcon_mamba2_config(fields)
        elif jamba:
            mlp, mamba2, mamba1 = _jamba_feed_forward_config(fields, moe_layer_ids), None, _mamba1_config(fields)
        elif lfm2_moe:
            mlp, mamba2 = _lfm2_moe_feed_forward_config(fields), None
        elif lfm2:
            mlp, mamba2 = _feed_forward_config(_Fields({**text, "intermediate_size": _lfm2_mlp_width(fields)},
                                                       fields.defaults), model_type), None
        else:
            mlp, mamba2 = _feed_forward_config(fields, model_type), None
        ssm_dtype = fields.value("mamba_ssm_cache_dtype") if nemotron else pick("mamba_ssm_dtype")

        return cls(
            architecture=architectures[0],
            model_type=model_type,
            vocab_size=fields.integer("vocab_size"),
            hidden_size=fields.integer("hidden_size"),
            num_hidden_layers=num_layers,
            layer_types=layer_types,
            max_position_embeddings=fields.integer("max_position_embeddings"),
            eos_token_ids=token_ids(pick("eos_token_id"), "config.json eos_token_id"),
            tie_word_embeddings=boolean(text.get("tie_word_embeddings") if lfm2 else pick("tie_word_embeddings"),
                                        "tie_word_embeddings", default=lfm2),
            torch_dtype=str(pick("dtype") or pick("torch_dtype") or "bfloat16"),
            rms_norm_eps=fields.number("layer_norm_epsilon" if nemotron else "rms_norm_eps"),
            hidden_act=hidden_act,
            attention=attention,
            gated_delta=_gated_delta_config(fields if mamba2 is None and mamba1 is None and not lfm2
                                            else _Fields({}, _COMMON_DEFAULTS),
                                            allow_neg_eigval=olmo and fields.boolean("linear_allow_neg_eigval", True)),
            mlp=mlp,
            mamba_ssm_dtype=None if ssm_dtype is None else str(ssm_dtype),
            mamba2=mamba2,
            multipliers=_multipliers(fields) if granite else _falcon_multipliers(fields) if falcon else Multipliers(),
            mamba1=mamba1,
            short_conv=ShortConvConfig(conv_kernel_size=fields.integer("conv_L_cache", minimum=2),  # (1: no state)
                                       bias=fields.boolean("conv_bias", default=False)) if lfm2 else None,
        )

    def _validated(self) -> ModelConfig:
        attention, delta, mlp = self.attention, self.gated_delta, self.mlp
        if attention.num_heads % attention.num_kv_heads:
            raise ValueError(f"{attention.num_heads} attention heads / {attention.num_kv_heads} kv heads")
        if delta.num_v_heads % delta.num_k_heads:
            raise ValueError(f"{delta.num_v_heads} DeltaNet value heads / {delta.num_k_heads} key heads")
        if mlp.num_experts and not 1 <= mlp.num_experts_per_tok <= mlp.num_experts:
            raise ValueError(f"config.json num_experts_per_tok {mlp.num_experts_per_tok} must be between 1 and "
                             f"num_experts {mlp.num_experts}")
        needs_dense = any(self.has_feed_forward(i) and not self.is_moe_layer(i) for i in range(self.num_hidden_layers))
        if needs_dense and not self.mlp.intermediate_size:
            raise ValueError("a dense MLP layer needs intermediate_size")
        return self

    @classmethod
    def from_model_dir(cls, path: str | Path) -> ModelConfig:
        """Read `<path>/config.json`. The ids generation stops on (`eos_token_ids`) are config.json's, then
        `generation_config.json`'s where it adds any (the engine adds the tokenizer's EOS token: vLLM stops on
        all of them). A generation_config.json that is not valid JSON, or whose eos_token_id is no token id, is a
        warning naming the file, and config.json's ids are used (vLLM falls back to the model config)."""
        path = Path(path)
        config_path = path / "config.json"
        if not config_path.is_file():
            raise ValueError(f"{config_path} does not exist")
        config = cls.from_dict(read_json_object(config_path))
        generation_path = path / "generation_config.json"
        generation_ids: tuple[int, ...] = ()
        if generation_path.is_file():
            try:
                generation_ids = token_ids(read_json_object(generation_path).get("eos_token_id"),
                                           f"{generation_path} eos_token_id")
            except ValueError as error:  # as vLLM's try_get_generation_config: fall back to config.json's
                _logger.warning("%s; stopping on config.json's EOS ids %s only", error, list(config.eos_token_ids))
        return replace(config, eos_token_ids=tuple(dict.fromkeys((*config.eos_token_ids, *generation_ids))))


def read_json_object(path: Path) -> dict[str, Any]:
    """The JSON object `path` holds; ValueError naming the file when it is not valid JSON or not an object."""
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path} is not valid JSON: {error}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, not {type(data).__name__}")
    return data


def token_ids(value: Any, field: str) -> tuple[int, ...]:
    """An `eos_token_id` as written (null, a token id or a list of them) as a tuple of ids; ValueError naming
    `field` (file and key) for anything else."""
    ids = [] if value is None else value if isinstance(value, list) else [value]
    if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids):
        raise ValueError(f"{field} {value!r} must be a token id or a list of token ids")
    return tuple(ids)


def boolean(value: Any, key: str, default: bool) -> bool:
    """A config.json boolean field: true or false, `default` for null or left out; anything else (the string
    "false", 0) is a ValueError naming config.json and the field, as transformers' strict configuration refuses."""
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ValueError(f"config.json {key} {value!r} must be true or false")
    return value


@dataclass(frozen=True)
class _Fields:
    """The text model's fields of config.json (`section`) read with transformers' `defaults` for those left out
    or null; a value of the wrong type or range is a ValueError naming config.json and the field."""

    section: Mapping[str, Any]
    defaults: Mapping[str, Any]

    def value(self, key: str) -> Any:
        value = self.section.get(key)
        return self.defaults.get(key) if value is None else value

    def integer(self, key: str, minimum: int = 1) -> int:
        value = self.value(key)
        if value is None:
            raise ValueError(f"config.json has no {key!r}")
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"config.json {key} {value!r} is not an integer")
        if value < minimum:
            raise ValueError(f"config.json {key} {value} must be at least {minimum}")
        return value

    def boolean(self, key: str, default: bool) -> bool:
        return boolean(self.section.get(key), key, default)

    def number(self, key: str) -> float:
        value = self.value(key)
        if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
            raise ValueError(f"config.json {key} {value!r} is not a number >= 0")
        return float(value)


def _check_one_rope_layout(text: Mapping) -> None:
    """A config with both `rope_parameters` (transformers 5's layout) and an older `rope_scaling` that says
    something else is refused: transformers lets `rope_scaling` replace `rope_parameters` whole (so its
    `rope_theta` falls back to the default), the layout here reads `rope_parameters`; either way one of them is
    silently dropped. Qwen's YaRN recipe for a config that has `rope_parameters` puts the keys there."""
    parameters, scaling = text.get("rope_parameters"), text.get("rope_scaling")
    if not isinstance(parameters, Mapping) or not parameters or not isinstance(scaling, Mapping) or not scaling:
        return
    differing = sorted(
        key for key, value in scaling.items()
        if value is not None and parameters.get("rope_type" if key == "type" else key) != value)
    if differing:
        raise ValueError(
            f"config.json has both rope_parameters and rope_scaling, and they differ in {differing}: put the "
            f"rotary settings (e.g. the YaRN keys rope_type, factor, original_max_position_embeddings) in "
            f"rope_parameters alone")


def _attention_config(fields: _Fields, *, use_rope: bool = True, scale: float | None = None) -> AttentionConfig:
    """The attention group of a text config (rotary settings in either layout, see the module docstring); `use_rope`
    False: no rotary embedding (Granite's "nope", Nemotron-H); `scale`: the softmax scale where config.json sets one
    (Granite's attention_multiplier)."""
    text = fields.section
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    if not isinstance(rope, Mapping):
        raise ValueError(f"config.json rope_parameters {rope!r} must be an object")
    _check_one_rope_layout(text)
    # rope_parameters' values win over the older top-level fields
    rotary = _Fields({**text, **{k: v for k, v in rope.items() if v is not None}}, fields.defaults)

    num_heads = fields.integer("num_attention_heads")
    section = tuple(int(n) for n in rope.get("mrope_section") or (11, 11, 10))
    if len(section) != 3:
        raise ValueError(f"mrope_section {list(section)} must name 3 axes (temporal, height, width)")
    # head_dim null (not left out): transformers' attention takes hidden_size / num_attention_heads
    head_dim = (fields.integer("hidden_size") // num_heads if "head_dim" in text and text["head_dim"] is None
                else fields.integer("head_dim"))
    rope_theta = rotary.number("rope_theta")
    if rope_theta <= 0:
        raise ValueError(f"config.json rope_theta {rope_theta} must be > 0 (the RoPE base)")
    partial_rotary_factor = rotary.number("partial_rotary_factor")
    if partial_rotary_factor > 1:
        raise ValueError(f"config.json partial_rotary_factor {partial_rotary_factor} must be between 0 and 1 (RoPE "
                         f"rotates at most the head_dim {head_dim} channels of a head)")
    return AttentionConfig(
        num_heads=num_heads,
        num_kv_heads=fields.integer("num_key_value_heads"),
        head_dim=head_dim,
        bias=fields.boolean("attention_bias", default=False),
        rope_theta=rope_theta,
        partial_rotary_factor=partial_rotary_factor,
        mrope_section=section,
        rope_scaling=_rope_scaling(fields, rope),
        max_position_embeddings=fields.integer("max_position_embeddings"),
        use_rope=use_rope,
        scale=scale,
    )


def _granite_rope(position_embedding_type: Any) -> bool:
    """Whether Granite's attention rotates: "rope" yes; "nope" or null no (transformers builds its rotary embedding
    for "rope" alone); anything else is refused."""
    if position_embedding_type not in (None, "nope", "rope"):
        raise ValueError(f"config.json position_embedding_type {position_embedding_type!r} is not supported "
                         "('rope', 'nope' or null)")
    return position_embedding_type == "rope"


def _rope_scaling(fields: _Fields, rope: Mapping[str, Any]) -> tuple[tuple[str, Any], ...]:
    """`AttentionConfig.rope_scaling` of config.json's rope parameters `rope` (see the module docstring)."""
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    if rope_type == "default":
        return ()
    if rope_type not in SCALED_ROPE_TYPES:
        why = _REFUSED_ROPE_TYPES.get(rope_type, "is unknown")
        raise ValueError(f"config.json rope_type {rope_type!r} {why}; supported: 'default', "
                         f"{', '.join(repr(name) for name in SCALED_ROPE_TYPES)}")
    scaling = {key: _frozen(value, key) for key, value in rope.items() if key not in _ROPE_BASE_KEYS}
    needed = SCALED_ROPE_TYPES[rope_type]
    if "original_max_position_embeddings" in needed:  # as transformers' standardize_rope_params: a top-level value
        original = fields.section.get("original_max_position_embeddings")  # wins, max_position_embeddings defaults
        if original is not None:
            scaling["original_max_position_embeddings"] = original
        scaling.setdefault("original_max_position_embeddings", fields.integer("max_position_embeddings"))
    for key in needed:
        value = scaling.get(key)
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise ValueError(f"config.json rope_parameters {key} {value!r} (rope_type {rope_type!r}) must be a "
                             "number > 0")
    return tuple(sorted({**scaling, "rope_type": rope_type}.items()))


def _frozen(value: Any, key: str) -> Any:
    """A rope parameter as an immutable value (lists as tuples); ValueError naming config.json for an object."""
    if isinstance(value, list):
        return tuple(_frozen(item, key) for item in value)
    if isinstance(value, Mapping):
        raise ValueError(f"config.json rope_parameters {key} {value!r} must not be an object")
    return value


def _gated_delta_config(fields: _Fields, allow_neg_eigval: bool = False) -> GatedDeltaConfig:
    return GatedDeltaConfig(
        num_k_heads=fields.integer("linear_num_key_heads"),
        num_v_heads=fields.integer("linear_num_value_heads"),
        k_head_dim=fields.integer("linear_key_head_dim"),
        v_head_dim=fields.integer("linear_value_head_dim"),
        conv_kernel_size=fields.integer("linear_conv_kernel_dim", minimum=2),  # (1: no conv state to keep)
        allow_neg_eigval=allow_neg_eigval,
    )


def _olmo_defaults(text: Mapping[str, Any]) -> dict[str, Any]:
    """`OlmoHybridConfig`'s defaults, with those it derives from other fields (where those are integers > 0):
    num_key_value_heads, linear_num_key_heads and linear_num_value_heads = num_attention_heads, head_dim =
    hidden_size / num_attention_heads (its attention's, `getattr(config, "head_dim", ...)`), linear_key_head_dim =
    int(0.75 * hidden_size / linear_num_key_heads), linear_value_head_dim = 2 * linear_key_head_dim."""
    defaults = dict(_DEFAULTS["olmo_hybrid"])
    heads, hidden = text.get("num_attention_heads"), text.get("hidden_size")
    if not (isinstance(heads, int) and isinstance(hidden, int) and heads > 0):
        return defaults
    key_heads = text.get("linear_num_key_heads") or heads
    key_dim = text.get("linear_key_head_dim")
    if key_dim is None and isinstance(key_heads, int) and key_heads > 0:
        key_dim = int(0.75 * hidden / key_heads)
    defaults.update(num_key_value_heads=heads, head_dim=hidden // heads, linear_num_key_heads=heads,
                    linear_num_value_heads=heads, linear_key_head_dim=key_dim,
                    linear_value_head_dim=2 * key_dim if isinstance(key_dim, int) else None)
    return defaults


def _olmo_layer_types(num_layers: int) -> list[str]:
    """`OlmoHybridConfig`'s layer_types when config.json leaves them out: every fourth layer attention, the last
    one too when there would be none."""
    kinds = ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(num_layers)]
    if "full_attention" not in kinds:
        kinds[-1] = "full_attention"
    return kinds


def _whole_head_rope_attention_config(fields: _Fields, family: str) -> AttentionConfig:
    """OLMo Hybrid's and LFM2's attention: RoPE on the whole head (their rotary embeddings read no
    partial_rotary_factor: another value is refused, naming `family`); OLMo Hybrid's none where `rope_theta` is
    written as null (in rope_parameters, or at the top level without rope_parameters), as transformers then builds no
    rotary embedding."""
    text = fields.section
    rope = text.get("rope_parameters")
    written = rope if isinstance(rope, Mapping) and "rope_theta" in rope else text
    use_rope = family == "LFM2" or "rope_theta" not in written or written["rope_theta"] is not None
    attention = _attention_config(fields, use_rope=use_rope)
    if attention.partial_rotary_factor != 1.0:
        raise ValueError(f"config.json partial_rotary_factor {attention.partial_rotary_factor} is not supported for "
                         f"{family} (its rotary embedding rotates the whole head)")
    return attention


def _lfm2_section(text: Mapping[str, Any], moe: bool) -> dict[str, Any]:
    """LFM2's config.json fields under the names read here, as `Lfm2Config` takes them: `block_ff_dim` wins over
    intermediate_size, `tie_embedding` over tie_word_embeddings, `norm_eps` is the norms' eps (rms_norm_eps is not
    read), and layer_types, left out, come from `full_attn_idxs` (left out too: every layer attends). LFM2-MoE
    (`moe`, `Lfm2MoeConfig`): tie_embedding alone, and layer_types must be written."""
    section = dict(text)
    aliases = {"tie_embedding": "tie_word_embeddings", **({} if moe else {"block_ff_dim": "intermediate_size"})}
    for old, new in aliases.items():
        if section.get(old) is not None:
            section[new] = section[old]
    section["rms_norm_eps"] = section.get("norm_eps")
    if moe and section.get("layer_types") is None:
        raise ValueError("config.json has no layer_types (LFM2-MoE names each layer's kind there: 'conv' or "
                         "'full_attention')")
    if section.get("layer_types") is None:
        layers, attending = section.get("num_hidden_layers"), section.get("full_attn_idxs")
        if isinstance(layers, int) and not isinstance(layers, bool):
            if attending is not None and (not isinstance(attending, list) or not all(
                    isinstance(i, int) and not isinstance(i, bool) for i in attending)):
                raise ValueError(f"config.json full_attn_idxs {attending!r} must be a list of layer indices")
            attending = range(layers) if attending is None else attending
            section["layer_types"] = ["full_attention" if i in attending else "conv" for i in range(layers)]
    return section


def _lfm2_moe_feed_forward_config(fields: _Fields) -> FeedForwardConfig:
    """LFM2-MoE's MLPs: dense (`intermediate_size`) in the first `num_dense_layers` layers, MoE blocks after them
    (`GroupedRouting` of one group: sigmoid scores + expert_bias pick, renormalised with + 1e-6)."""
    if not fields.boolean("use_expert_bias", default=True):
        raise ValueError("config.json use_expert_bias false is not supported for LFM2-MoE (the released models route "
                         "with their expert_bias)")
    num_experts = fields.integer("num_experts")
    return FeedForwardConfig(
        intermediate_size=fields.integer("intermediate_size"),
        num_experts=num_experts,
        num_experts_per_tok=fields.integer("num_experts_per_tok"),
        moe_intermediate_size=fields.integer("moe_intermediate_size"),
        shared_expert_intermediate_size=0,
        norm_topk_prob=fields.boolean("norm_topk_prob", default=True),
        decoder_sparse_step=1,
        mlp_only_layers=tuple(range(fields.integer("num_dense_layers", minimum=0))),
        grouped_routing=GroupedRouting(num_groups=1, topk_groups=1,
                                       scaling_factor=fields.number("routed_scaling_factor"), renorm_eps=1e-6),
    )


def _lfm2_mlp_width(fields: _Fields) -> int:
    """`Lfm2MLP`'s width: intermediate_size, or with `block_auto_adjust_ff_dim` (default true) int(2/3 of it) times
    `block_ffn_dim_multiplier`, rounded up to a multiple of `block_multiple_of` (LFM2-1.2B: block_ff_dim 12,288 ->
    8,192)."""
    width = fields.integer("intermediate_size")
    if not fields.boolean("block_auto_adjust_ff_dim", default=True):
        return width
    multiple = fields.integer("block_multiple_of")
    width = int(fields.number("block_ffn_dim_multiplier") * int(2 * width / 3))
    return multiple * -(-width // multiple)


def _feed_forward_config(fields: _Fields, model_type: str) -> FeedForwardConfig:
    text = fields.section
    is_qwen3_next = model_type == "qwen3_next"
    is_moe = model_type == "qwen3_5_moe_text" or (is_qwen3_next and fields.integer("num_experts", minimum=0) > 0)
    has_dense = fields.value("intermediate_size") is not None  # Qwen3.5-MoE has no dense MLP
    return FeedForwardConfig(
        intermediate_size=fields.integer("intermediate_size") if has_dense else None,
        num_experts=fields.integer("num_experts") if is_moe else 0,
        num_experts_per_tok=fields.integer("num_experts_per_tok") if is_moe else 0,
        moe_intermediate_size=fields.integer("moe_intermediate_size") if is_moe else 0,
        shared_expert_intermediate_size=(fields.integer("shared_expert_intermediate_size", minimum=0)
                                         if is_moe else 0),
        # Qwen3.5-MoE always renormalises the top-k weights and puts an MoE block in every layer.
        norm_topk_prob=fields.boolean("norm_topk_prob", default=True) if is_qwen3_next else True,
        decoder_sparse_step=fields.integer("decoder_sparse_step") if is_qwen3_next else 1,
        mlp_only_layers=tuple(int(i) for i in (text.get("mlp_only_layers") or ())) if is_qwen3_next else (),
    )


def _derived_defaults(model_type: str, text: Mapping[str, Any]) -> dict[str, Any]:
    """The defaults of `model_type` (`_DEFAULTS`), with those Granite's, Bamba's, Falcon-H1's, Jamba's, LFM2's and
    LFM2-MoE's configurations derive from other fields: head_dim = hidden_size / num_attention_heads (their
    attention's, where config.json writes none); num_key_value_heads = num_attention_heads (Granite's default; Bamba's
    and Falcon-H1's when written null, their default being 8; Jamba's JambaConfig refuses a null). OLMo Hybrid's:
    `_olmo_defaults`."""
    if model_type == "olmo_hybrid":
        return _olmo_defaults(text)
    defaults = dict(_DEFAULTS[model_type])
    heads, hidden = text.get("num_attention_heads"), text.get("hidden_size")
    if model_type not in ("granitemoehybrid", "bamba", "falcon_h1", "jamba", "lfm2", "lfm2_moe") or not (
            isinstance(heads, int) and isinstance(hidden, int) and heads > 0):
        return defaults
    defaults["head_dim"] = hidden // heads
    if model_type == "granitemoehybrid" or (model_type in ("bamba", "falcon_h1") and "num_key_value_heads" in text
                                            and text["num_key_value_heads"] is None):
        defaults["num_key_value_heads"] = heads
    return defaults


def _dense_feed_forward_config(fields: _Fields, family: str) -> FeedForwardConfig:
    """A dense SiLU-gated MLP of `intermediate_size` after every mixer (Bamba's `feed_forward`), without biases."""
    if fields.boolean("mlp_bias", default=False):
        raise ValueError(f"config.json mlp_bias true is not supported for {family} (its checkpoints have none)")
    return FeedForwardConfig.dense(fields.integer("intermediate_size"))


def _bamba_layer_types(text: Mapping[str, Any], num_layers: int) -> list[str]:
    """Bamba's layer kinds: "attention" at the `attn_layer_indices`, "mamba" elsewhere (none: every layer Mamba2, as
    transformers' `BambaConfig.layers_block_type`). A written `layers_block_type` / `layer_types` must agree."""
    indices = text.get("attn_layer_indices") or []
    if not isinstance(indices, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in indices) or (
            any(not 0 <= i < num_layers for i in indices)):
        raise ValueError(f"config.json attn_layer_indices {indices!r} must list layer indices in [0, {num_layers})")
    kinds = ["attention" if i in indices else "mamba" for i in range(num_layers)]
    written = text.get("layers_block_type") or text.get("layer_types")
    if written is not None and (not isinstance(written, list) or [_MAMBA_KINDS.get(t) for t in written] != [
            _MAMBA_KINDS[t] for t in kinds]):
        raise ValueError(f"config.json layers_block_type {written!r} disagrees with attn_layer_indices {indices!r}")
    return kinds


def _falcon_layer_types(text: Mapping[str, Any], num_layers: int) -> list[str]:
    """Falcon-H1's layer kinds: "hybrid" every layer (attention and Mamba2 side by side). `attn_layer_indices` (which
    transformers' FalconH1 does not read) must be null, and a written `layers_block_type` / `layer_types` all
    "hybrid"."""
    if text.get("attn_layer_indices") is not None:
        raise ValueError(f"config.json attn_layer_indices {text['attn_layer_indices']!r} is not supported for "
                         "Falcon-H1: every layer runs attention and Mamba2 side by side (null)")
    written = text.get("layers_block_type") or text.get("layer_types")
    if written is not None and written != ["hybrid"] * num_layers:
        raise ValueError(f"config.json layers_block_type {written!r} is not Falcon-H1's: 'hybrid', every layer")
    return ["hybrid"] * num_layers


def _numbers(fields: _Fields, key: str, count: int) -> tuple[float, ...]:
    """A config.json list of `count` numbers >= 0 (Falcon-H1's mlp_multipliers, ssm_multipliers)."""
    value = fields.value(key)
    if not isinstance(value, list | tuple) or len(value) != count or any(
            isinstance(v, bool) or not isinstance(v, int | float) or v < 0 for v in value):
        raise ValueError(f"config.json {key} {value!r} must be a list of {count} numbers >= 0")
    return tuple(float(v) for v in value)


def _falcon_mamba2_config(fields: _Fields) -> Mamba2Config:
    """Falcon-H1's Mamba2 fields: `mamba_d_ssm` channels (written null: mamba_expand * hidden_size) in mamba_n_heads
    heads of mamba_d_head ("auto": their quotient), Granite's other `mamba_*` fields; the gated norm only with
    `mamba_rms_norm` (default false), before the gate with `mamba_norm_before_gate` (default true); out_proj's bias
    `projectors_bias`; `ssm_multipliers` the scales of z, x, B, C, dt after in_proj."""
    text = fields.section
    if "mamba_d_ssm" in text and text["mamba_d_ssm"] is None:
        inner = (fields.integer("mamba_expand") * fields.integer("hidden_size"), "mamba_expand * hidden_size")
    else:
        inner = (fields.integer("mamba_d_ssm"), "mamba_d_ssm")
    return replace(_mamba2_config(fields, inner), rms_norm=fields.boolean("mamba_rms_norm", default=False),
                   norm_before_gate=fields.boolean("mamba_norm_before_gate", default=True),
                   out_proj_bias=fields.boolean("projectors_bias", default=False),
                   in_multipliers=_numbers(fields, "ssm_multipliers", 5))


def _falcon_multipliers(fields: _Fields) -> Multipliers:
    gate, down = _numbers(fields, "mlp_multipliers", 2)
    return Multipliers(embedding=fields.number("embedding_multiplier"), logits=fields.number("lm_head_multiplier"),
                       key=fields.number("key_multiplier"), attention_in=fields.number("attention_in_multiplier"),
                       attention_out=fields.number("attention_out_multiplier"),
                       ssm_in=fields.number("ssm_in_multiplier"), ssm_out=fields.number("ssm_out_multiplier"),
                       mlp_gate=gate, mlp_down=down)


def _check_falcon_h1(fields: _Fields, attention: AttentionConfig) -> None:
    """What Falcon-H1's config.json may say that transformers' FalconH1 does not run as written: `mamba_use_mlp`
    false (transformers builds the MLP whatever it says), a `partial_rotary_factor` other than 1 (its default RoPE
    rotates the whole head whatever it says; a scaled RoPE would read it)."""
    if not fields.boolean("mamba_use_mlp", default=True):
        raise ValueError("config.json mamba_use_mlp false is not supported for Falcon-H1 (transformers' FalconH1 runs "
                         "the MLP in every layer)")
    if attention.partial_rotary_factor != 1.0:
        raise ValueError(f"config.json partial_rotary_factor {attention.partial_rotary_factor} is not supported for "
                         "Falcon-H1 (its RoPE rotates the whole head: 1)")


def _check_bamba_rotary(text: Mapping[str, Any], attention: AttentionConfig) -> None:
    """Bamba's checkpoints name the rotated channels of a head twice: `attn_rotary_emb` (the original training code's
    count) and head_dim x partial_rotary_factor (transformers', 0.5 unless rope_parameters says otherwise); a config
    where they differ is ambiguous and refused."""
    written = text.get("attn_rotary_emb")
    if written is not None and written != attention.rotary_dim:
        raise ValueError(f"config.json attn_rotary_emb {written!r} is not head_dim {attention.head_dim} x "
                         f"partial_rotary_factor {attention.partial_rotary_factor} = {attention.rotary_dim}, the "
                         "channels transformers' Bamba rotates")


def _time_step_limit(value: Any) -> tuple[float, float]:
    """config.json's `time_step_limit`: null (no limit), or [low, high] with each bound a number, "Infinity" or
    transformers' {"__float__": "Infinity"}; 0 <= low <= high."""
    if value is None:
        return (0.0, float("inf"))

    def bound(item: Any) -> float:
        if isinstance(item, Mapping) and set(item) == {"__float__"}:
            item = item["__float__"]
        if isinstance(item, str) and item.lower() in ("infinity", "inf"):
            return float("inf")
        if isinstance(item, bool) or not isinstance(item, int | float):
            raise ValueError(f"config.json time_step_limit {value!r} must be a pair of numbers")
        return float(item)

    if not isinstance(value, list | tuple) or len(value) != 2:
        raise ValueError(f"config.json time_step_limit {value!r} must be a pair of numbers")
    low, high = bound(value[0]), bound(value[1])
    if not 0 <= low <= high:
        raise ValueError(f"config.json time_step_limit {value!r} must be 0 <= low <= high")
    return (low, high)


def _mamba2_config(fields: _Fields, inner: tuple[int, str] | None = None) -> Mamba2Config:
    """Granite-4.0-H's (and Bamba's) `mamba_*` fields, as transformers' `GraniteMoeHybridConfig` checks them; `inner`:
    the Mamba2 channels and the fields that say them (None: mamba_expand * hidden_size; Falcon-H1: mamba_d_ssm)."""
    heads = fields.integer("mamba_n_heads")
    inner, named = inner or (fields.integer("mamba_expand") * fields.integer("hidden_size"),
                             "mamba_expand * hidden_size")
    if fields.value("mamba_d_head") == "auto":
        if inner % heads:
            raise ValueError(f"config.json mamba_n_heads {heads} must divide {named} {inner}")
        head_dim = inner // heads
    else:
        head_dim = fields.integer("mamba_d_head")
    if head_dim * heads != inner:
        raise ValueError(f"config.json mamba_d_head {head_dim} x mamba_n_heads {heads} must be {named} {inner}")
    groups = fields.integer("mamba_n_groups")
    if heads % groups:
        raise ValueError(f"config.json mamba_n_groups {groups} must divide mamba_n_heads {heads}")
    return Mamba2Config(
        num_heads=heads,
        head_dim=head_dim,
        num_groups=groups,
        state_size=fields.integer("mamba_d_state"),
        conv_kernel_size=fields.integer("mamba_d_conv", minimum=2),  # (1: no conv state to keep)
        conv_bias=fields.boolean("mamba_conv_bias", default=True),
        proj_bias=fields.boolean("mamba_proj_bias", default=False),
        chunk_size=fields.integer("mamba_chunk_size"),
        time_step_limit=_time_step_limit(fields.section.get("time_step_limit")),
    )


def _granite_feed_forward_config(fields: _Fields) -> FeedForwardConfig:
    """Granite's `shared_mlp` (every layer) as the dense MLP, or beside `num_local_experts` routed experts as the
    shared expert (ungated: its output is added as it is)."""
    num_experts = fields.integer("num_local_experts", minimum=0)
    shared = fields.integer("shared_intermediate_size")
    if not num_experts:
        return FeedForwardConfig.dense(shared)
    return FeedForwardConfig(
        intermediate_size=None,
        num_experts=num_experts,
        num_experts_per_tok=fields.integer("num_experts_per_tok"),
        moe_intermediate_size=fields.integer("intermediate_size"),
        shared_expert_intermediate_size=shared,
        norm_topk_prob=True,  # softmax over the top-k logits: the top-k of the softmax, renormalised
        decoder_sparse_step=1,
        mlp_only_layers=(),
    )


def _multipliers(fields: _Fields) -> Multipliers:
    logits_scaling = fields.number("logits_scaling")
    if logits_scaling <= 0:
        raise ValueError(f"config.json logits_scaling {logits_scaling} must be > 0 (the logits are divided by it)")
    return Multipliers(embedding=fields.number("embedding_multiplier"), residual=fields.number("residual_multiplier"),
                       logits_scaling=logits_scaling)


# Nemotron-H's older config.json names and the names `NemotronHConfig` reads them into (the older name wins, as there)
_NEMOTRON_ALIASES = {"mamba_n_groups": "n_groups", "mamba_d_conv": "conv_kernel", "mamba_expand": "expand",
                     "mamba_dt_limit": "time_step_limit", "mamba_conv_bias": "use_conv_bias",
                     "mamba_chunk_size": "chunk_size"}


def _nemotron_section(text: Mapping[str, Any]) -> dict[str, Any]:
    """Nemotron-H's config.json fields under the names `NemotronHConfig` keeps (`_NEMOTRON_ALIASES` applied)."""
    section = dict(text)
    for old, new in _NEMOTRON_ALIASES.items():
        if old in section:
            section[new] = section.pop(old)
    return section


def _nemotron_layer_types(text: Mapping[str, Any]) -> list[str]:
    """Nemotron-H's layer kinds as written: `layers_block_type` (or `layer_types`), else `hybrid_override_pattern`
    one letter a layer (M Mamba2, * attention, - MLP, E MoE)."""
    written = text.get("layers_block_type") or text.get("layer_types")
    if written is not None:
        return written
    pattern = text.get("hybrid_override_pattern")
    if not isinstance(pattern, str) or not pattern or set(pattern) - set(_NEMOTRON_PATTERN):
        raise ValueError(f"config.json needs layers_block_type, or hybrid_override_pattern as a string of the letters "
                         f"{''.join(_NEMOTRON_PATTERN)} (one a layer), not {pattern!r}")
    return [_NEMOTRON_PATTERN[letter] for letter in pattern]


def _nemotron_activation(fields: _Fields) -> str:
    """Nemotron-H's MLP activation, "relu2" (relu(x)^2) only; its Mamba2 activation must be "silu"."""
    for key, supported in (("mlp_hidden_act", "relu2"), ("mamba_hidden_act", "silu")):
        if fields.value(key) != supported:
            raise ValueError(f"config.json {key} {fields.value(key)!r} is not supported (only {supported!r})")
    return "relu2"


def _nemotron_feed_forward_config(fields: _Fields, moe_layer_ids: tuple[int, ...]) -> FeedForwardConfig:
    """Nemotron-H's dense layers (up_proj -> relu^2 -> down_proj of `intermediate_size`) and MoE layers
    (`moe_layer_ids`), layers of their own."""
    if fields.boolean("mlp_bias", default=False):
        raise ValueError("config.json mlp_bias true is not supported for Nemotron-H (its checkpoints have none)")
    dense = FeedForwardConfig.dense(fields.integer("intermediate_size"), in_own_layers=True)
    if not moe_layer_ids:
        return dense
    num_experts, top_k = fields.integer("n_routed_experts"), fields.integer("num_experts_per_tok")
    groups, kept = fields.integer("n_group"), fields.integer("topk_group")
    if num_experts % groups or num_experts // groups < 2:
        raise ValueError(f"config.json n_group {groups} must divide n_routed_experts {num_experts} into groups of at "
                         "least 2 experts (a group ranks by its two best scores)")
    if kept > groups or top_k > kept * (num_experts // groups):
        raise ValueError(f"config.json topk_group {kept} must be at most n_group {groups}, and its groups must hold "
                         f"num_experts_per_tok {top_k} experts ({num_experts // groups} a group)")
    latent = fields.value("moe_latent_size")
    return replace(
        dense, num_experts=num_experts, num_experts_per_tok=top_k,
        moe_intermediate_size=fields.integer("moe_intermediate_size"),
        shared_expert_intermediate_size=fields.integer("moe_shared_expert_intermediate_size"),
        norm_topk_prob=fields.boolean("norm_topk_prob", default=True), moe_layer_ids=moe_layer_ids,
        grouped_routing=GroupedRouting(num_groups=groups, topk_groups=kept,
                                       scaling_factor=fields.number("routed_scaling_factor")),
        moe_latent_size=None if latent is None else fields.integer("moe_latent_size"))


def _nemotron_mamba2_config(fields: _Fields) -> Mamba2Config:
    """Nemotron-H's Mamba2 fields (`NemotronHConfig`'s names): heads mamba_num_heads x mamba_head_dim (`expand`
    sizes nothing there), n_groups, ssm_state_size, conv_kernel, use_conv_bias, use_bias (in_proj and out_proj)."""
    heads, groups = fields.integer("mamba_num_heads"), fields.integer("n_groups")
    if heads % groups:
        raise ValueError(f"config.json n_groups {groups} must divide mamba_num_heads {heads}")
    return Mamba2Config(
        num_heads=heads,
        head_dim=fields.integer("mamba_head_dim"),
        num_groups=groups,
        state_size=fields.integer("ssm_state_size"),
        conv_kernel_size=fields.integer("conv_kernel", minimum=2),  # (1: no conv state to keep)
        conv_bias=fields.boolean("use_conv_bias", default=True),
        proj_bias=fields.boolean("use_bias", default=False),
        chunk_size=fields.integer("chunk_size"),
        time_step_limit=_time_step_limit(fields.section.get("time_step_limit")),
    )


def _period_layers(fields: _Fields, name: str, num_layers: int) -> tuple[int, ...]:
    """The layers i with i % {name}_layer_period == {name}_layer_offset (offset < period, as transformers checks)."""
    period, offset = fields.integer(f"{name}_layer_period"), fields.integer(f"{name}_layer_offset", minimum=0)
    if offset >= period:
        raise ValueError(f"config.json {name}_layer_offset {offset} must be smaller than {name}_layer_period {period}")
    return tuple(i for i in range(num_layers) if i % period == offset)


# The Jamba fields read here that `JambaConfig` (transformers' strict dataclass) types without None: written null, it
# refuses the file (`num_local_experts`, its alias of num_experts, leaves no expert count), so they are refused here
# rather than read as their defaults.
_JAMBA_NOT_NULL = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
    "hidden_act", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings", "num_experts", "num_local_experts",
    "num_experts_per_tok", "expert_layer_period", "expert_layer_offset", "attn_layer_period", "attn_layer_offset",
    "mamba_d_state", "mamba_d_conv", "mamba_expand", "mamba_dt_rank", "mamba_conv_bias", "mamba_proj_bias",
)


def _jamba_section(text: Mapping[str, Any]) -> dict[str, Any]:
    """Jamba's config.json fields under the names `JambaConfig` keeps: `num_local_experts` (its attribute_map's alias)
    is `num_experts`; both written and different is refused (transformers would keep one of them silently). A field
    of `_JAMBA_NOT_NULL` written null is refused, naming it (leaving it out takes JambaConfig's default)."""
    nulls = [key for key in _JAMBA_NOT_NULL if key in text and text[key] is None]
    if nulls:
        raise ValueError(f"config.json {', '.join(nulls)} {'is' if len(nulls) == 1 else 'are'} null: transformers' "
                         "JambaConfig requires a value (leave a field out for its default)")
    section = dict(text)
    if "num_local_experts" in section:
        alias = section.pop("num_local_experts")
        if "num_experts" in section and section["num_experts"] != alias:
            raise ValueError(f"config.json num_local_experts {alias!r} and num_experts {section['num_experts']!r} "
                             "disagree (JambaConfig reads num_local_experts as num_experts): write one of them")
        section["num_experts"] = alias
    return section


def _jamba_layout(fields: _Fields) -> tuple[list[str], tuple[int, ...]]:
    """Jamba's layer kinds ("attention" where i % attn_layer_period == attn_layer_offset, else "mamba") and its MoE
    layers (i % expert_layer_period == expert_layer_offset, when num_experts > 1), as `JambaConfig` derives them. A
    `layers_block_type` written in config.json (transformers ignores it: its property is derived) must agree."""
    num_layers = fields.integer("num_hidden_layers")
    attention = _period_layers(fields, "attn", num_layers)
    layer_types = ["attention" if i in attention else "mamba" for i in range(num_layers)]
    written = fields.section.get("layers_block_type")
    if written is not None and written != layer_types:
        raise ValueError(f"config.json layers_block_type {written!r} disagrees with attn_layer_period / "
                         f"attn_layer_offset, which give {layer_types} (transformers reads those)")
    experts = _period_layers(fields, "expert", num_layers)
    return layer_types, experts if fields.integer("num_experts") > 1 else ()


def _jamba_feed_forward_config(fields: _Fields, moe_layer_ids: tuple[int, ...]) -> FeedForwardConfig:
    """Jamba's feed-forward block after every mixer: a SiLU-gated MLP of `intermediate_size`, or in `moe_layer_ids`
    `num_experts` routed experts of that width (top `num_experts_per_tok` of the softmax, not renormalised), no
    shared expert."""
    moe = bool(moe_layer_ids)
    return FeedForwardConfig(
        intermediate_size=fields.integer("intermediate_size"),
        num_experts=fields.integer("num_experts") if moe else 0,
        num_experts_per_tok=fields.integer("num_experts_per_tok") if moe else 0,
        moe_intermediate_size=fields.integer("intermediate_size") if moe else 0,
        shared_expert_intermediate_size=0,
        norm_topk_prob=False,  # (transformers' JambaTopKRouter keeps the softmax's top-k weights as they are)
        decoder_sparse_step=1,
        mlp_only_layers=(),
        moe_layer_ids=moe_layer_ids,
    )


def _mamba1_config(fields: _Fields) -> Mamba1Config:
    """Jamba's `mamba_*` fields (`mamba_dt_rank` "auto": ceil(hidden_size / 16)); `mamba_inner_layernorms` (older
    configs) must not be false: transformers' Jamba always has the dt / B / C norms."""
    if fields.section.get("mamba_inner_layernorms") is False:
        raise ValueError("config.json mamba_inner_layernorms false is not supported (transformers' Jamba always "
                         "normalises dt, B and C)")
    hidden = fields.integer("hidden_size")
    rank = -(-hidden // 16) if fields.value("mamba_dt_rank") == "auto" else fields.integer("mamba_dt_rank")
    return Mamba1Config(
        intermediate_size=fields.integer("mamba_expand") * hidden,
        state_size=fields.integer("mamba_d_state"),
        dt_rank=rank,
        conv_kernel_size=fields.integer("mamba_d_conv", minimum=2),  # (1: no conv state to keep)
        conv_bias=fields.boolean("mamba_conv_bias", default=True),
        proj_bias=fields.boolean("mamba_proj_bias", default=False),
    )


# Kimi Linear's config.json spellings (the released checkpoints') and the names `KimiLinearConfig` keeps
_KIMI_ALIASES = {"num_experts": "num_local_experts", "num_experts_per_token": "num_experts_per_tok",
                 "num_shared_experts": "n_shared_experts", "moe_renormalize": "norm_topk_prob",
                 "num_expert_group": "n_group", "model_max_length": "max_position_embeddings"}


def _kimi_section(text: Mapping[str, Any]) -> dict[str, Any]:
    """Kimi Linear's fields under transformers' names (`_KIMI_ALIASES`; the checkpoints' spelling wins where both
    are written), with `linear_attn_config`'s head_dim, num_heads and short_conv_kernel_size as linear_head_dim,
    linear_num_heads and linear_conv_kernel_dim (as `KimiLinearConfig` reads them)."""
    section = dict(text)
    for written, kept in _KIMI_ALIASES.items():
        if section.get(written) is not None:
            section[kept] = section.pop(written)
    linear = section.get("linear_attn_config") or {}
    if not isinstance(linear, Mapping):
        raise ValueError(f"config.json linear_attn_config {linear!r} must be an object")
    for written, kept in (("head_dim", "linear_head_dim"), ("num_heads", "linear_num_heads"),
                          ("short_conv_kernel_size", "linear_conv_kernel_dim")):
        if linear.get(written) is not None:
            section[kept] = linear[written]
    return section


def _kimi_layer_types(text: Mapping[str, Any], num_layers: int) -> tuple[LayerKind, ...]:
    """`layer_types` as written, else linear_attn_config's 1-based `kda_layers` / `full_attn_layers` (every layer
    named once), else every fourth layer from layer 4 on attends (`KimiLinearConfig`'s default)."""
    written = text.get("layer_types")
    linear = text.get("linear_attn_config") or {}
    if written is None and "kda_layers" in linear and "full_attn_layers" in linear:
        kda, full = linear["kda_layers"], linear["full_attn_layers"]
        ids = [*kda, *full] if isinstance(kda, list) and isinstance(full, list) else None
        if ids is None or sorted(ids) != list(range(1, num_layers + 1)):
            raise ValueError(f"config.json linear_attn_config kda_layers {kda!r} and full_attn_layers {full!r} must "
                             f"name each of the {num_layers} layers (1-based) once")
        written = ["full_attention" if i + 1 in full else "linear_attention" for i in range(num_layers)]
    if written is None:
        written = ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(num_layers)]
    if not isinstance(written, list) or len(written) != num_layers or set(written) - set(_QWEN_KINDS):
        raise ValueError(f"config.json layer_types {written!r} do not describe {num_layers} layers of "
                         f"{sorted(_QWEN_KINDS)}")
    return tuple(_QWEN_KINDS[t] for t in written)


def _kimi_moe_layer_ids(fields: _Fields, num_layers: int) -> tuple[int, ...]:
    """The layers with an MoE block: `mlp_layer_types` ("dense" / "sparse" a layer; what transformers'
    `save_pretrained` writes) where given, else every layer from `first_k_dense_replace` on (as
    `KimiLinearConfig` reads them)."""
    written = fields.section.get("mlp_layer_types")
    if written is None:
        return tuple(range(fields.integer("first_k_dense_replace", minimum=0), num_layers))
    if not isinstance(written, list) or len(written) != num_layers or set(written) - {"dense", "sparse"}:
        raise ValueError(f"config.json mlp_layer_types {written!r} must list 'dense' or 'sparse' for each of the "
                         f"{num_layers} layers")
    return tuple(i for i, kind in enumerate(written) if kind == "sparse")


def _kimi_check(fields: _Fields) -> None:
    """Refuse what Kimi Linear's implementation here (and transformers') does not run."""
    text = fields.section
    checks = (
        (text.get("mla_use_nope", True) is not True, "mla_use_nope false (MLA with rotary embedding) is not "
         "supported: transformers' Kimi Linear applies none"),
        ((text.get("num_nextn_predict_layers") or 0) != 0, "num_nextn_predict_layers > 0: Kimi Linear's MTP layers "
         "are not supported"),
        (text.get("moe_router_activation_func", "sigmoid") != "sigmoid", "moe_router_activation_func "
         f"{text.get('moe_router_activation_func')!r} is not supported (only 'sigmoid')"),
        ((text.get("moe_layer_freq") or 1) != 1, f"moe_layer_freq {text.get('moe_layer_freq')!r} is not supported "
         "(only 1: transformers' Kimi Linear reads none)"),
        (fields.boolean("attention_bias", default=False), "attention_bias true is not supported for Kimi Linear"),
        (text.get("hidden_act", "silu") != "silu", f"hidden_act {text.get('hidden_act')!r} is not supported "
         "(only 'silu')"),
        (any(text.get(key) for key in ("mla_use_output_gate", "mhc")) or (text.get("linear_attn_config") or {}).get(
            "use_full_rank_gate"), "mla_use_output_gate / mhc / use_full_rank_gate (later Kimi models) are not "
         "supported"),
    )
    for refused, reason in checks:
        if refused:
            raise ValueError(f"config.json {reason}")


def _kimi_linear_config(raw: Mapping[str, Any], text: Mapping[str, Any], architecture: str) -> ModelConfig:
    """Kimi Linear (`kimi_linear`): KDA layers ("linear_attention", `gated_delta` with as many key as value heads,
    `linear_num_heads` of `linear_head_dim`), MLA layers ("full_attention", `mla`; `attention` holds its paged KV's
    shape: num_attention_heads heads of `MLAConfig.cache_head_dim`, no rotary embedding, scale
    qk_head_dim^-1/2), a dense SiLU MLP of `intermediate_size` in the "dense" layers of `mlp_layer_types` (else the
    first `first_k_dense_replace` layers) and MoE blocks in the others (`num_local_experts` SiLU experts of
    `moe_intermediate_size`, top `num_experts_per_tok`, routed by `GroupedRouting`, `n_shared_experts` x
    moe_intermediate_size of shared expert)."""
    defaults = dict(_DEFAULTS["kimi_linear"])
    section = _kimi_section(text)
    if isinstance(section.get("num_attention_heads"), int):
        defaults["num_key_value_heads"] = section["num_attention_heads"]
    fields = _Fields(section, defaults)
    _kimi_check(fields)
    num_layers = fields.integer("num_hidden_layers")
    layer_types = _kimi_layer_types(section, num_layers)
    num_heads = fields.integer("num_attention_heads")
    if fields.integer("num_key_value_heads") != num_heads:
        raise ValueError(f"config.json num_key_value_heads {fields.value('num_key_value_heads')} must equal "
                         f"num_attention_heads {num_heads} (MLA expands its latent into every head)")
    q_lora = section.get("q_lora_rank")
    mla = MLAConfig(q_lora_rank=None if q_lora is None else fields.integer("q_lora_rank"),
                    kv_lora_rank=fields.integer("kv_lora_rank"),
                    qk_nope_head_dim=fields.integer("qk_nope_head_dim", minimum=0),
                    qk_rope_head_dim=fields.integer("qk_rope_head_dim", minimum=0),
                    v_head_dim=fields.integer("v_head_dim"))
    if mla.qk_head_dim < 1:
        raise ValueError("config.json qk_nope_head_dim + qk_rope_head_dim must be at least 1")
    attention = AttentionConfig(num_heads=num_heads, num_kv_heads=num_heads, head_dim=mla.cache_head_dim, bias=False,
                                rope_theta=10000.0, partial_rotary_factor=0.0,
                                max_position_embeddings=fields.integer("max_position_embeddings"), use_rope=False,
                                scale=mla.qk_head_dim**-0.5)
    heads, head_dim = fields.integer("linear_num_heads"), fields.integer("linear_head_dim")
    delta = GatedDeltaConfig(num_k_heads=heads, num_v_heads=heads, k_head_dim=head_dim, v_head_dim=head_dim,
                             conv_kernel_size=fields.integer("linear_conv_kernel_dim", minimum=2))
    moe_layer_ids = _kimi_moe_layer_ids(fields, num_layers)
    num_experts, top_k = fields.integer("num_local_experts"), fields.integer("num_experts_per_tok")
    groups, kept = fields.integer("n_group"), fields.integer("topk_group")
    if moe_layer_ids and (num_experts % groups or num_experts // groups < 2):
        raise ValueError(f"config.json num_expert_group {groups} must divide num_experts {num_experts} into groups of "
                         "at least 2 experts (a group ranks by its two best scores)")
    if moe_layer_ids and (kept > groups or top_k > kept * (num_experts // groups)):
        raise ValueError(f"config.json topk_group {kept} must be at most num_expert_group {groups}, and its groups "
                         f"must hold num_experts_per_token {top_k} experts ({num_experts // groups} a group)")
    mlp = FeedForwardConfig.dense(fields.integer("intermediate_size"))
    if moe_layer_ids:
        mlp = replace(mlp, num_experts=num_experts, num_experts_per_tok=top_k,
                      moe_intermediate_size=fields.integer("moe_intermediate_size"),
                      shared_expert_intermediate_size=fields.integer("moe_intermediate_size")
                      * fields.integer("n_shared_experts", minimum=0),
                      norm_topk_prob=fields.boolean("norm_topk_prob", default=True), moe_layer_ids=moe_layer_ids,
                      grouped_routing=GroupedRouting(num_groups=groups, topk_groups=kept,
                                                     scaling_factor=fields.number("routed_scaling_factor")))
    eos = raw.get("eos_token_id") if raw.get("eos_token_id") is not None else text.get("eos_token_id", 163586)
    return ModelConfig(
        architecture=architecture, model_type="kimi_linear", vocab_size=fields.integer("vocab_size"),
        hidden_size=fields.integer("hidden_size"), num_hidden_layers=num_layers, layer_types=layer_types,
        max_position_embeddings=fields.integer("max_position_embeddings"),
        eos_token_ids=token_ids(eos, "config.json eos_token_id"),
        tie_word_embeddings=boolean(raw.get("tie_word_embeddings"), "tie_word_embeddings", default=False),
        torch_dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "bfloat16"),
        rms_norm_eps=fields.number("rms_norm_eps"), hidden_act="silu", attention=attention, gated_delta=delta,
        mlp=mlp, mamba_ssm_dtype=None, mla=mla,
    )
