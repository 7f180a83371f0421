"""`parse_model_config`: a config.json dict as a `ModelConfig`, by the text model's type. Qwen3.5 and Qwen3-Next
(gated DeltaNet and attention layers, from `layer_types` or else every `full_attention_interval`-th layer
attending) are read here, every other family with its module's readers.

Accepted layouts of config.json:

- a text model (`Qwen3_5ForCausalLM`, `Qwen3_5MoeForCausalLM`, `Qwen3NextForCausalLM`,
  `GraniteMoeHybridForCausalLM`, `NemotronHForCausalLM`, `BambaForCausalLM`, `FalconH1ForCausalLM`,
  `JambaForCausalLM`, `OlmoHybridForCausalLM`, `Lfm2ForCausalLM`, `Lfm2MoeForCausalLM`, `KimiLinearForCausalLM`):
  every field at the top level;
- a multimodal wrapper (`Qwen3_5ForConditionalGeneration`, `Qwen3_5MoeForConditionalGeneration`): the
  language model's fields live in `text_config`; `architectures`, `tie_word_embeddings` and `eos_token_id`
  are read from the top level when present there, otherwise from `text_config`;
- rotary settings in either layout (`rope`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

from hybridcache.models.config.bamba import bamba_layer_types, check_bamba_rotary
from hybridcache.models.config.common import (
    dense_feed_forward_config,
    feed_forward_config,
    gated_delta_config,
    mamba2_config,
)
from hybridcache.models.config.defaults import COMMON_DEFAULTS, derived_defaults
from hybridcache.models.config.falcon_h1 import (
    check_falcon_h1,
    falcon_layer_types,
    falcon_mamba2_config,
    falcon_multipliers,
)
from hybridcache.models.config.fields import Fields, boolean, token_ids
from hybridcache.models.config.granite import granite_feed_forward_config, granite_multipliers, granite_rope
from hybridcache.models.config.groups import Multipliers, ShortConvConfig
from hybridcache.models.config.jamba import jamba_feed_forward_config, jamba_layout, jamba_section, mamba1_config
from hybridcache.models.config.kimi_linear import kimi_linear_config
from hybridcache.models.config.kinds import (
    FALCON_KINDS,
    JAMBA_KINDS,
    LFM2_KINDS,
    MAMBA_KINDS,
    NEMOTRON_KINDS,
    QWEN_KINDS,
    LayerKind,
)
from hybridcache.models.config.lfm2 import lfm2_feed_forward_config, lfm2_moe_feed_forward_config, lfm2_section
from hybridcache.models.config.model import ModelConfig
from hybridcache.models.config.nemotron_h import (
    nemotron_activation,
    nemotron_feed_forward_config,
    nemotron_layer_types,
    nemotron_mamba2_config,
    nemotron_section,
)
from hybridcache.models.config.olmo_hybrid import olmo_defaults, olmo_layer_types
from hybridcache.models.config.rope import attention_config, whole_head_rope_attention_config

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


# Each text model type's config.json fields under the names read here (any other type's: as written)
_SECTIONS: dict[str, Callable[[Mapping[str, Any]], dict[str, Any]]] = {
    "nemotron_h": nemotron_section,
    "jamba": jamba_section,
    "lfm2": functools.partial(lfm2_section, moe=False),
    "lfm2_moe": functools.partial(lfm2_section, moe=True),
    # (BambaConfig sets partial_rotary_factor 0.5 over the top-level one; rope_parameters' wins)
    "bamba": lambda text: {**text, "partial_rotary_factor": None},
}

# The config.json spellings of each text model type's layer kinds (any other type's: Qwen's)
_KINDS = {"nemotron_h": NEMOTRON_KINDS, "granitemoehybrid": MAMBA_KINDS, "bamba": MAMBA_KINDS,
          "falcon_h1": FALCON_KINDS, "jamba": JAMBA_KINDS, "lfm2": LFM2_KINDS, "lfm2_moe": LFM2_KINDS}

# Each text model type's (feed-forward, Mamba2, Mamba1) groups from its fields and MoE layers (any other type's,
# Qwen3.5's, Qwen3-Next's and OLMo Hybrid's: Qwen's feed-forward fields, no Mamba group)
_GROUPS = {
    "nemotron_h": lambda fields, moe: (nemotron_feed_forward_config(fields, moe), nemotron_mamba2_config(fields), None),
    "granitemoehybrid": lambda fields, _: (granite_feed_forward_config(fields), mamba2_config(fields), None),
    "bamba": lambda fields, _: (dense_feed_forward_config(fields, "Bamba"), mamba2_config(fields), None),
    "falcon_h1": lambda fields, _: (dense_feed_forward_config(fields, "Falcon-H1"), falcon_mamba2_config(fields), None),
    "jamba": lambda fields, moe: (jamba_feed_forward_config(fields, moe), None, mamba1_config(fields)),
    "lfm2": lambda fields, _: (lfm2_feed_forward_config(fields), None, None),
    "lfm2_moe": lambda fields, _: (lfm2_moe_feed_forward_config(fields), None, None),
}


def parse_model_config(raw: Mapping[str, Any]) -> ModelConfig:
    """The `ModelConfig` config.json's dict `raw` describes, unvalidated (`ModelConfig.from_dict` validates it
    and turns a TypeError, KeyError, ... of a field of an unchecked shape into a ValueError)."""
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
        return kimi_linear_config(raw, text, architectures[0])
    granite, nemotron, jamba = model_type == "granitemoehybrid", model_type == "nemotron_h", model_type == "jamba"
    bamba, falcon = model_type == "bamba", model_type == "falcon_h1"
    olmo, lfm2 = model_type == "olmo_hybrid", model_type in ("lfm2", "lfm2_moe")
    if model_type in _SECTIONS:
        text = _SECTIONS[model_type](text)
    fields = Fields(text, olmo_defaults(text) if olmo else derived_defaults(model_type, text))

    def pick(key: str, default: Any = None) -> Any:
        """A wrapper-level setting wins over the text config's (they are the same in practice)."""
        if key in raw and raw[key] is not None:
            return raw[key]
        return text.get(key, default)

    moe_layer_ids: tuple[int, ...] = ()
    if nemotron:
        layer_types = nemotron_layer_types(text)
    elif jamba:
        layer_types, moe_layer_ids = jamba_layout(fields)
    else:
        layer_types = text.get("layer_types")
    num_layers = len(layer_types) if nemotron and text.get("num_hidden_layers") is None else (
        fields.integer("num_hidden_layers"))
    if bamba or falcon:
        layer_types = bamba_layer_types(text, num_layers) if bamba else falcon_layer_types(text, num_layers)
    if layer_types is None and granite:  # the older key; neither: every layer Mamba2 (as transformers)
        layer_types = text.get("layers_block_type") or ["mamba"] * num_layers
    if layer_types is None and olmo:
        layer_types = olmo_layer_types(num_layers)
    if layer_types is None:
        interval = fields.integer("full_attention_interval")
        layer_types = [
            LayerKind.LINEAR_ATTENTION if (i + 1) % interval else LayerKind.FULL_ATTENTION
            for i in range(num_layers)
        ]
    if not isinstance(layer_types, list) or not all(isinstance(t, str) for t in layer_types):
        raise ValueError(f"config.json layer_types {layer_types!r} must be a list of layer type names")
    kinds = _KINDS.get(model_type, QWEN_KINDS)
    if len(layer_types) != num_layers or set(layer_types) - set(kinds):
        raise ValueError(f"layer_types {tuple(layer_types)} do not describe {num_layers} supported layers "
                         f"(layer types of {written!r}: {sorted(kinds)})")
    if nemotron:
        moe_layer_ids = tuple(i for i, t in enumerate(layer_types) if t == "moe")
    layer_types = tuple(kinds[t] for t in layer_types)
    if olmo and len(set(layer_types)) < 2:  # (transformers' OlmoHybridConfig.validate_architecture)
        raise ValueError(f"config.json layer_types {[str(t) for t in layer_types]}: OLMo Hybrid needs at least "
                         "one 'linear_attention' and one 'full_attention' layer")

    hidden_act = nemotron_activation(fields) if nemotron else text.get("hidden_act", "silu")
    if hidden_act != "silu" and not nemotron:
        raise ValueError(f"hidden_act {hidden_act!r} is not supported (only 'silu')")
    if granite:
        attention = attention_config(fields, use_rope=granite_rope(text.get("position_embedding_type")),
                                     scale=fields.number("attention_multiplier"))
    elif olmo or lfm2:
        attention = whole_head_rope_attention_config(fields, "OLMo Hybrid" if olmo else "LFM2")
    else:
        attention = attention_config(fields, use_rope=not (nemotron or jamba))
    if (nemotron or jamba or lfm2) and attention.bias:
        family = "LFM2" if lfm2 else architectures[0]
        raise ValueError(f"config.json attention_bias true is not supported for {family} (transformers' "
                         "attention of this model has no biases)")
    if bamba:
        check_bamba_rotary(text, attention)
    if falcon:
        check_falcon_h1(fields, attention)
    if model_type in _GROUPS:
        mlp, mamba2, mamba1 = _GROUPS[model_type](fields, moe_layer_ids)
    else:
        mlp, mamba2, mamba1 = feed_forward_config(fields, model_type), None, None
    ssm_dtype = fields.value("mamba_ssm_cache_dtype") if nemotron else pick("mamba_ssm_dtype")

    return ModelConfig(
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
        gated_delta=gated_delta_config(fields if mamba2 is None and mamba1 is None and not lfm2
                                       else Fields({}, COMMON_DEFAULTS),
                                       allow_neg_eigval=olmo and fields.boolean("linear_allow_neg_eigval", True)),
        mlp=mlp,
        mamba_ssm_dtype=None if ssm_dtype is None else str(ssm_dtype),
        mamba2=mamba2,
        multipliers=granite_multipliers(fields) if granite else falcon_multipliers(fields) if falcon else Multipliers(),
        mamba1=mamba1,
        short_conv=ShortConvConfig(conv_kernel_size=fields.integer("conv_L_cache", minimum=2),  # (1: no state)
                                   bias=fields.boolean("conv_bias", default=False)) if lfm2 else None,
    )
