"""`ModelConfig`: the hyper-parameters of one hybrid model, with the layer ids derived from them; `from_dict` and
`from_model_dir` parse a config.json (`parse`)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from hybridcache.models.config.fields import read_json_object, token_ids
from hybridcache.models.config.groups import (
    AttentionConfig,
    FeedForwardConfig,
    GatedDeltaConfig,
    Mamba1Config,
    Mamba2Config,
    MLAConfig,
    Multipliers,
    ShortConvConfig,
)
from hybridcache.models.config.kinds import RECURRENT_KINDS, LayerKind

_logger = logging.getLogger(__name__)


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
        from hybridcache.models.config.parse import parse_model_config  # (here: the parsers import this module)

        try:
            return parse_model_config(raw)._validated()
        except (TypeError, KeyError, AttributeError, ZeroDivisionError) as error:  # a field of a shape not checked
            raise ValueError(f"config.json is malformed: {type(error).__name__}: {error}") from None


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
