"""The attention group (`AttentionConfig`) of a text config: its heads and rotary settings.

Rotary settings are read either in transformers-5 style (`rope_parameters: {rope_type, rope_theta,
partial_rotary_factor, ...}`) or in the older style (`rope_theta`, `partial_rotary_factor`, `rope_scaling` at the top
level, its type under `rope_type` or `type`). `rope_type` is "default" or a scaled RoPE whose frequencies transformers
computes once (`SCALED_ROPE_TYPES`: "linear", "yarn", "llama3"; its keys, e.g. `factor`,
`original_max_position_embeddings`, kept as written in `AttentionConfig.rope_scaling`); "dynamic" and "longrope",
which rescale with the sequence length at run time, are refused, as is "proportional" (it rotates the whole head).
`mrope_section` (default (11, 11, 10), as transformers) lays out Qwen3.5's interleaved M-RoPE for image tokens;
text-only input has equal position ids on the three axes, where M-RoPE is plain RoPE. OLMo Hybrid's and LFM2's
attention rotates the whole head (`whole_head_rope_attention_config`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridcache.models.config.fields import Fields
from hybridcache.models.config.groups import AttentionConfig

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


def attention_config(fields: Fields, *, use_rope: bool = True, scale: float | None = None) -> AttentionConfig:
    """The attention group of a text config (rotary settings in either layout, see the module docstring); `use_rope`
    False: no rotary embedding (Granite's "nope", Nemotron-H); `scale`: the softmax scale where config.json sets one
    (Granite's attention_multiplier)."""
    text = fields.section
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    if not isinstance(rope, Mapping):
        raise ValueError(f"config.json rope_parameters {rope!r} must be an object")
    _check_one_rope_layout(text)
    # rope_parameters' values win over the older top-level fields
    rotary = Fields({**text, **{k: v for k, v in rope.items() if v is not None}}, fields.defaults)

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


def _rope_scaling(fields: Fields, rope: Mapping[str, Any]) -> tuple[tuple[str, Any], ...]:
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


def whole_head_rope_attention_config(fields: Fields, family: str) -> AttentionConfig:
    """OLMo Hybrid's and LFM2's attention: RoPE on the whole head (their rotary embeddings read no
    partial_rotary_factor: another value is refused, naming `family`); OLMo Hybrid's none where `rope_theta` is
    written as null (in rope_parameters, or at the top level without rope_parameters), as transformers then builds no
    rotary embedding."""
    text = fields.section
    rope = text.get("rope_parameters")
    written = rope if isinstance(rope, Mapping) and "rope_theta" in rope else text
    use_rope = family == "LFM2" or "rope_theta" not in written or written["rope_theta"] is not None
    attention = attention_config(fields, use_rope=use_rope)
    if attention.partial_rotary_factor != 1.0:
        raise ValueError(f"config.json partial_rotary_factor {attention.partial_rotary_factor} is not supported for "
                         f"{family} (its rotary embedding rotates the whole head)")
    return attention
