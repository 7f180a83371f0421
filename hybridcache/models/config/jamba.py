"""Jamba (`jamba`): Mamba1 layers (`LayerKind.MAMBA1`, the `Mamba1Config` group: `mamba_expand` * hidden_size channels,
`mamba_d_state`, `mamba_dt_rank` ("auto": ceil(hidden_size / 16)), `mamba_d_conv`, `mamba_conv_bias`,
`mamba_proj_bias`) and attention layers without RoPE where i % attn_layer_period == attn_layer_offset (a written
`layers_block_type`, which transformers ignores, must agree); a SiLU-gated MLP of `intermediate_size` after every
mixer, or, where i % expert_layer_period == expert_layer_offset and `num_experts` > 1, `num_experts` (or its alias
`num_local_experts`, as JambaConfig maps it) routed experts of that width (top `num_experts_per_tok` of the softmax,
not renormalised); `head_dim` read where written, else hidden_size / num_attention_heads. Refused: an offset not below
its period, `attention_bias` true, `mamba_inner_layernorms` false, another activation, `num_local_experts` and
`num_experts` both written and different, a null where JambaConfig requires a value (`num_key_value_heads`,
`rms_norm_eps`, ...: `JAMBA_NOT_NULL`); `use_mamba_kernels` and `sliding_window` (transformers' Jamba reads neither)
are not read."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridcache.models.config.fields import Fields
from hybridcache.models.config.groups import FeedForwardConfig, Mamba1Config


def _period_layers(fields: Fields, name: str, num_layers: int) -> tuple[int, ...]:
    """The layers i with i % {name}_layer_period == {name}_layer_offset (offset < period, as transformers checks)."""
    period, offset = fields.integer(f"{name}_layer_period"), fields.integer(f"{name}_layer_offset", minimum=0)
    if offset >= period:
        raise ValueError(f"config.json {name}_layer_offset {offset} must be smaller than {name}_layer_period {period}")
    return tuple(i for i in range(num_layers) if i % period == offset)


# The Jamba fields read here that `JambaConfig` (transformers' strict dataclass) types without None: written null, it
# refuses the file (`num_local_experts`, its alias of num_experts, leaves no expert count), so they are refused here
# rather than read as their defaults.
JAMBA_NOT_NULL = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
    "hidden_act", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings", "num_experts", "num_local_experts",
    "num_experts_per_tok", "expert_layer_period", "expert_layer_offset", "attn_layer_period", "attn_layer_offset",
    "mamba_d_state", "mamba_d_conv", "mamba_expand", "mamba_dt_rank", "mamba_conv_bias", "mamba_proj_bias",
)


def jamba_section(text: Mapping[str, Any]) -> dict[str, Any]:
    """Jamba's config.json fields under the names `JambaConfig` keeps: `num_local_experts` (its attribute_map's alias)
    is `num_experts`; both written and different is refused (transformers would keep one of them silently). A field
    of `JAMBA_NOT_NULL` written null is refused, naming it (leaving it out takes JambaConfig's default)."""
    nulls = [key for key in JAMBA_NOT_NULL if key in text and text[key] is None]
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


def jamba_layout(fields: Fields) -> tuple[list[str], tuple[int, ...]]:
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


def jamba_feed_forward_config(fields: Fields, moe_layer_ids: tuple[int, ...]) -> FeedForwardConfig:
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


def mamba1_config(fields: Fields) -> Mamba1Config:
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
