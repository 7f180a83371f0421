"""Falcon-H1 (`falcon_h1`): every layer `LayerKind.HYBRID` (attention and Mamba2 side by side); Mamba2 channels
`mamba_d_ssm` (null: mamba_expand * hidden_size) in `mamba_n_heads` heads, Granite's other `mamba_*` fields plus
`mamba_rms_norm`, `mamba_norm_before_gate`, `projectors_bias` (out_proj's bias) and `ssm_multipliers` (five: z, x,
B, C, dt); the muP scalars `embedding_multiplier`, `lm_head_multiplier`, `key_multiplier`, `attention_in_multiplier`,
`attention_out_multiplier`, `ssm_in_multiplier`, `ssm_out_multiplier`, `mlp_multipliers` (gate, down) into
`multipliers`; RoPE on the whole head. Refused: `mamba_use_mlp` false, `attn_layer_indices` set, a layer type other
than "hybrid", `partial_rotary_factor` other than 1, `mlp_bias` true."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from hybridcache.models.config.common import mamba2_config
from hybridcache.models.config.fields import Fields
from hybridcache.models.config.groups import AttentionConfig, Mamba2Config, Multipliers


def falcon_layer_types(text: Mapping[str, Any], num_layers: int) -> list[str]:
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


def _numbers(fields: Fields, key: str, count: int) -> tuple[float, ...]:
    """A config.json list of `count` numbers >= 0 (Falcon-H1's mlp_multipliers, ssm_multipliers)."""
    value = fields.value(key)
    if not isinstance(value, list | tuple) or len(value) != count or any(
            isinstance(v, bool) or not isinstance(v, int | float) or v < 0 for v in value):
        raise ValueError(f"config.json {key} {value!r} must be a list of {count} numbers >= 0")
    return tuple(float(v) for v in value)


def falcon_mamba2_config(fields: Fields) -> Mamba2Config:
    """Falcon-H1's Mamba2 fields: `mamba_d_ssm` channels (written null: mamba_expand * hidden_size) in mamba_n_heads
    heads of mamba_d_head ("auto": their quotient), Granite's other `mamba_*` fields; the gated norm only with
    `mamba_rms_norm` (default false), before the gate with `mamba_norm_before_gate` (default true); out_proj's bias
    `projectors_bias`; `ssm_multipliers` the scales of z, x, B, C, dt after in_proj."""
    text = fields.section
    if "mamba_d_ssm" in text and text["mamba_d_ssm"] is None:
        inner = (fields.integer("mamba_expand") * fields.integer("hidden_size"), "mamba_expand * hidden_size")
    else:
        inner = (fields.integer("mamba_d_ssm"), "mamba_d_ssm")
    return replace(mamba2_config(fields, inner), rms_norm=fields.boolean("mamba_rms_norm", default=False),
                   norm_before_gate=fields.boolean("mamba_norm_before_gate", default=True),
                   out_proj_bias=fields.boolean("projectors_bias", default=False),
                   in_multipliers=_numbers(fields, "ssm_multipliers", 5))


def falcon_multipliers(fields: Fields) -> Multipliers:
    gate, down = _numbers(fields, "mlp_multipliers", 2)
    return Multipliers(embedding=fields.number("embedding_multiplier"), logits=fields.number("lm_head_multiplier"),
                       key=fields.number("key_multiplier"), attention_in=fields.number("attention_in_multiplier"),
                       attention_out=fields.number("attention_out_multiplier"),
                       ssm_in=fields.number("ssm_in_multiplier"), ssm_out=fields.number("ssm_out_multiplier"),
                       mlp_gate=gate, mlp_down=down)


def check_falcon_h1(fields: Fields, attention: AttentionConfig) -> None:
    """What Falcon-H1's config.json may say that transformers' FalconH1 does not run as written: `mamba_use_mlp`
    false (transformers builds the MLP whatever it says), a `partial_rotary_factor` other than 1 (its default RoPE
    rotates the whole head whatever it says; a scaled RoPE would read it)."""
    if not fields.boolean("mamba_use_mlp", default=True):
        raise ValueError("config.json mamba_use_mlp false is not supported for Falcon-H1 (transformers' FalconH1 runs "
                         "the MLP in every layer)")
    if attention.partial_rotary_factor != 1.0:
        raise ValueError(f"config.json partial_rotary_factor {attention.partial_rotary_factor} is not supported for "
                         "Falcon-H1 (its RoPE rotates the whole head: 1)")
