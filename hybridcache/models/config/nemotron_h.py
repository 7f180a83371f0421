"""Nemotron-H (`nemotron_h`): each layer one block, its kind from `layers_block_type` ("mamba" / "linear_attention",
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
[1, n_group], more picks than the kept groups hold)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from hybridcache.models.config.fields import Fields, time_step_limit
from hybridcache.models.config.groups import FeedForwardConfig, GroupedRouting, Mamba2Config

# `hybrid_override_pattern`'s letters and the layer types they stand for
_NEMOTRON_PATTERN = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}


# Nemotron-H's older config.json names and the names `NemotronHConfig` reads them into (the older name wins, as there)
_NEMOTRON_ALIASES = {"mamba_n_groups": "n_groups", "mamba_d_conv": "conv_kernel", "mamba_expand": "expand",
                     "mamba_dt_limit": "time_step_limit", "mamba_conv_bias": "use_conv_bias",
                     "mamba_chunk_size": "chunk_size"}


def nemotron_section(text: Mapping[str, Any]) -> dict[str, Any]:
    """Nemotron-H's config.json fields under the names `NemotronHConfig` keeps (`_NEMOTRON_ALIASES` applied)."""
    section = dict(text)
    for old, new in _NEMOTRON_ALIASES.items():
        if old in section:
            section[new] = section.pop(old)
    return section


def nemotron_layer_types(text: Mapping[str, Any]) -> list[str]:
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


def nemotron_activation(fields: Fields) -> str:
    """Nemotron-H's MLP activation, "relu2" (relu(x)^2) only; its Mamba2 activation must be "silu"."""
    for key, supported in (("mlp_hidden_act", "relu2"), ("mamba_hidden_act", "silu")):
        if fields.value(key) != supported:
            raise ValueError(f"config.json {key} {fields.value(key)!r} is not supported (only {supported!r})")
    return "relu2"


def nemotron_feed_forward_config(fields: Fields, moe_layer_ids: tuple[int, ...]) -> FeedForwardConfig:
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


def nemotron_mamba2_config(fields: Fields) -> Mamba2Config:
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
        time_step_limit=time_step_limit(fields.section.get("time_step_limit")),
    )
