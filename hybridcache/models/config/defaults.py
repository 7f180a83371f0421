"""transformers' defaults of each text model type (its configuration class's) for the fields config.json leaves out
or sets to null, with those derived from other fields."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# transformers' defaults (its configuration classes of each text model type) for the fields config.json may leave
# out; `tests/models/test_config.py` checks them against the installed transformers.
COMMON_DEFAULTS: dict[str, Any] = {
    "head_dim": 256, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "full_attention_interval": 4,
    "partial_rotary_factor": 0.25, "rope_theta": 10000.0, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
    "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
}
_MOE_DEFAULTS: dict[str, Any] = {"moe_intermediate_size": 512, "shared_expert_intermediate_size": 512}
DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen3_5_text": {**COMMON_DEFAULTS, "num_key_value_heads": 4, "intermediate_size": 12288},
    "qwen3_5_moe_text": {**COMMON_DEFAULTS, **_MOE_DEFAULTS, "num_key_value_heads": 2, "num_experts": 256,
                         "num_experts_per_tok": 8},
    "qwen3_next": {**COMMON_DEFAULTS, **_MOE_DEFAULTS, "num_key_value_heads": 2, "intermediate_size": 5632,
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
    # (`OlmoHybridConfig`; the head counts and dims it derives from other fields: `olmo_hybrid.olmo_defaults`)
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
    # (`KimiLinearConfig`, under the names transformers keeps: `kimi_linear._KIMI_ALIASES` maps the checkpoints'
    # spellings; num_key_value_heads: num_attention_heads, set when parsed)
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


def derived_defaults(model_type: str, text: Mapping[str, Any]) -> dict[str, Any]:
    """The defaults of `model_type` (`DEFAULTS`), with those Granite's, Bamba's, Falcon-H1's, Jamba's, LFM2's and
    LFM2-MoE's configurations derive from other fields: head_dim = hidden_size / num_attention_heads (their
    attention's, where config.json writes none); num_key_value_heads = num_attention_heads (Granite's default; Bamba's
    and Falcon-H1's when written null, their default being 8; Jamba's JambaConfig refuses a null). (OLMo Hybrid's:
    `olmo_hybrid.olmo_defaults`, which the parse takes instead.)"""
    defaults = dict(DEFAULTS[model_type])
    heads, hidden = text.get("num_attention_heads"), text.get("hidden_size")
    if model_type not in ("granitemoehybrid", "bamba", "falcon_h1", "jamba", "lfm2", "lfm2_moe") or not (
            isinstance(heads, int) and isinstance(hidden, int) and heads > 0):
        return defaults
    defaults["head_dim"] = hidden // heads
    if model_type == "granitemoehybrid" or (model_type in ("bamba", "falcon_h1") and "num_key_value_heads" in text
                                            and text["num_key_value_heads"] is None):
        defaults["num_key_value_heads"] = heads
    return defaults
