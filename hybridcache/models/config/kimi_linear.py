"""Kimi Linear (`kimi_linear`): KDA ("linear_attention", the `gated_delta` group with as many key as value heads:
`linear_attn_config`'s `num_heads` of `head_dim`, `short_conv_kernel_size`) and MLA ("full_attention", the `mla`
group: `q_lora_rank`, `kv_lora_rank`, `qk_nope_head_dim`, `qk_rope_head_dim`, `v_head_dim`; `attention` holds its
paged KV's shape, no rotary embedding) layers from `layer_types`, else `linear_attn_config`'s 1-based `kda_layers` /
`full_attn_layers`; the checkpoints' spellings (`num_experts`, `num_experts_per_token`, `num_shared_experts`,
`moe_renormalize`, `num_expert_group`, `model_max_length`) read as `KimiLinearConfig`'s names (`_KIMI_ALIASES`);
dense SiLU MLPs in the "dense" layers of `mlp_layer_types` (else the first `first_k_dense_replace`), MoE blocks in the
others (SiLU experts of `moe_intermediate_size`, group-limited sigmoid routing with `e_score_correction_bias`, a shared
expert of `n_shared_experts` x moe_intermediate_size). Refused: `mla_use_nope` false, MTP layers, another router
activation or `hidden_act`, `moe_layer_freq` other than 1, `attention_bias` true, num_key_value_heads other than
num_attention_heads, the later models' `mla_use_output_gate` / `mhc` / `use_full_rank_gate`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from hybridcache.models.config.defaults import DEFAULTS
from hybridcache.models.config.fields import Fields, boolean, token_ids
from hybridcache.models.config.groups import (
    AttentionConfig,
    FeedForwardConfig,
    GatedDeltaConfig,
    GroupedRouting,
    MLAConfig,
)
from hybridcache.models.config.kinds import QWEN_KINDS, LayerKind
from hybridcache.models.config.model import ModelConfig

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
    if not isinstance(written, list) or len(written) != num_layers or set(written) - set(QWEN_KINDS):
        raise ValueError(f"config.json layer_types {written!r} do not describe {num_layers} layers of "
                         f"{sorted(QWEN_KINDS)}")
    return tuple(QWEN_KINDS[t] for t in written)


def _kimi_moe_layer_ids(fields: Fields, num_layers: int) -> tuple[int, ...]:
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


def _kimi_check(fields: Fields) -> None:
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


def kimi_linear_config(raw: Mapping[str, Any], text: Mapping[str, Any], architecture: str) -> ModelConfig:
    """Kimi Linear (`kimi_linear`): KDA layers ("linear_attention", `gated_delta` with as many key as value heads,
    `linear_num_heads` of `linear_head_dim`), MLA layers ("full_attention", `mla`; `attention` holds its paged KV's
    shape: one kv head of `MLAConfig.cache_head_dim` lanes holding the latent rows, num_attention_heads query heads,
    no rotary embedding, scale qk_head_dim^-1/2), a dense SiLU MLP of `intermediate_size` in the "dense" layers
    of `mlp_layer_types` (else the first `first_k_dense_replace` layers) and MoE blocks in the others
    (`num_local_experts` SiLU experts of `moe_intermediate_size`, top `num_experts_per_tok`, routed by
    `GroupedRouting`, `n_shared_experts` x moe_intermediate_size of shared expert)."""
    defaults = dict(DEFAULTS["kimi_linear"])
    section = _kimi_section(text)
    if isinstance(section.get("num_attention_heads"), int):
        defaults["num_key_value_heads"] = section["num_attention_heads"]
    fields = Fields(section, defaults)
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
    attention = AttentionConfig(num_heads=num_heads, num_kv_heads=1, head_dim=mla.cache_head_dim, bias=False,
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
