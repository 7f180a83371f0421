"""OLMo Hybrid (`olmo_hybrid`): gated DeltaNet ("linear_attention") and attention ("full_attention") layers, at least
one of each (as transformers checks; left out, every fourth layer attends); the DeltaNet group's fields as Qwen's
(`linear_*`; left out: as many key and value heads as attention heads, key head dim 0.75 * hidden_size / key heads,
value head dim twice that), `linear_allow_neg_eigval` (default true: beta = 2 sigmoid(b),
`GatedDeltaConfig.beta_scale`); the attention's head_dim hidden_size / num_attention_heads unless written, RoPE on the
whole head only where `rope_theta` is not written as null (the released checkpoints write `rope_parameters:
{"rope_theta": null}`: no rotary embedding; `rope_parameters: null` is transformers' default RoPE, theta 10,000);
`partial_rotary_factor` other than 1 is refused (transformers' OLMo rotary rotates the whole head)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridcache.models.config.defaults import DEFAULTS


def olmo_defaults(text: Mapping[str, Any]) -> dict[str, Any]:
    """`OlmoHybridConfig`'s defaults, with those it derives from other fields (where those are integers > 0):
    num_key_value_heads, linear_num_key_heads and linear_num_value_heads = num_attention_heads, head_dim =
    hidden_size / num_attention_heads (its attention's, `getattr(config, "head_dim", ...)`), linear_key_head_dim =
    int(0.75 * hidden_size / linear_num_key_heads), linear_value_head_dim = 2 * linear_key_head_dim."""
    defaults = dict(DEFAULTS["olmo_hybrid"])
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


def olmo_layer_types(num_layers: int) -> list[str]:
    """`OlmoHybridConfig`'s layer_types when config.json leaves them out: every fourth layer attention, the last
    one too when there would be none."""
    kinds = ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(num_layers)]
    if "full_attention" not in kinds:
        kinds[-1] = "full_attention"
    return kinds
