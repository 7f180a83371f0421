"""`ModelConfig`: the hyper-parameters of a supported hybrid model, parsed from a Hugging Face config.json.

This module imports no torch: the cache simulator sizes caches from it.

Accepted layouts of config.json:

- a text model (`Qwen3_5ForCausalLM`, `Qwen3_5MoeForCausalLM`, `Qwen3NextForCausalLM`): every field at the
  top level;
- a multimodal wrapper (`Qwen3_5ForConditionalGeneration`, `Qwen3_5MoeForConditionalGeneration`): the
  language model's fields live in `text_config`; `architectures`, `tie_word_embeddings` and `eos_token_id`
  are read from the top level when present there, otherwise from `text_config`;
- rotary settings either in transformers-5 style (`rope_parameters: {rope_type, rope_theta,
  partial_rotary_factor, ...}`) or in the older style (`rope_theta`, `partial_rotary_factor`,
  `rope_scaling` at the top level). Only `rope_type == "default"` is supported. `mrope_section` (default
  (11, 11, 10), as transformers) lays out Qwen3.5's interleaved M-RoPE for image tokens; text-only input has
  equal position ids on the three axes, where M-RoPE is plain RoPE.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from enum import StrEnum
from pathlib import Path
from typing import Any


class LayerKind(StrEnum):
    """The token mixer of a decoder layer, spelled as in config.json's `layer_types`."""

    LINEAR_ATTENTION = "linear_attention"  # gated DeltaNet
    FULL_ATTENTION = "full_attention"  # gated attention over the paged KV cache


# model_type of the text model each supported model_type stands for.
_TEXT_MODEL_TYPES = {
    "qwen3_5": "qwen3_5_text",
    "qwen3_5_text": "qwen3_5_text",
    "qwen3_5_moe": "qwen3_5_moe_text",
    "qwen3_5_moe_text": "qwen3_5_moe_text",
    "qwen3_next": "qwen3_next",
}


@dataclass(frozen=True)
class AttentionConfig:
    """Gated full attention: `num_heads` query heads (each with an output gate), `num_kv_heads` key/value
    heads of `head_dim`, RoPE on the first `rotary_dim` channels of each head."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    bias: bool
    rope_theta: float
    partial_rotary_factor: float
    mrope_section: tuple[int, int, int] = (11, 11, 10)

    @property
    def rotary_dim(self) -> int:
        """Leading channels of each attention head that RoPE rotates (the rest pass through)."""
        return int(self.head_dim * self.partial_rotary_factor)


@dataclass(frozen=True)
class GatedDeltaConfig:
    """Gated DeltaNet: `num_k_heads` query/key heads of `k_head_dim`, `num_v_heads` value heads of
    `v_head_dim`, a depthwise causal convolution of `conv_kernel_size` over q | k | v."""

    num_k_heads: int
    num_v_heads: int
    k_head_dim: int
    v_head_dim: int
    conv_kernel_size: int

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
class FeedForwardConfig:
    """The feed-forward block after each mixer: a dense SiLU-gated MLP of `intermediate_size`, or a sparse
    MoE block (`num_experts` routed experts, top `num_experts_per_tok`, plus a gated shared expert) where
    `is_moe_layer`. `num_experts == 0` means dense everywhere."""

    intermediate_size: int | None
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    norm_topk_prob: bool
    decoder_sparse_step: int
    mlp_only_layers: tuple[int, ...]

    def is_moe_layer(self, layer_id: int) -> bool:
        """True where layer `layer_id` has a sparse MoE block (the transformers rule)."""
        return (
            layer_id not in self.mlp_only_layers
            and self.num_experts > 0
            and (layer_id + 1) % self.decoder_sparse_step == 0
        )


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of one hybrid decoder-only model: the model-wide fields, then one group per layer
    family (`attention`, `gated_delta`) and the feed-forward group (`mlp`). A new family (say Mamba2) is a
    new group, a new `LayerKind` and a new mixer.

    `model_type` is the text model's type (`qwen3_5_text`, `qwen3_5_moe_text` or `qwen3_next`) even when
    config.json describes a multimodal wrapper; `architecture` is the config.json entry as written.
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

    # ---- derived quantities -------------------------------------------------------------------------
    @property
    def linear_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t is LayerKind.LINEAR_ATTENTION)

    @property
    def attention_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t is LayerKind.FULL_ATTENTION)

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
        """Parse a config.json dict. Raises `ValueError` for unsupported or inconsistent settings."""
        architectures = raw.get("architectures") or []
        if not architectures:
            raise ValueError("config.json has no 'architectures' entry")
        text = raw.get("text_config") or raw
        model_type = _TEXT_MODEL_TYPES.get(text.get("model_type") or raw.get("model_type", ""))
        if model_type is None:
            raise ValueError(
                f"unsupported model_type {raw.get('model_type')!r}; supported: {sorted(_TEXT_MODEL_TYPES)}"
            )

        def pick(key: str, default: Any = None) -> Any:
            """A wrapper-level setting wins over the text config's (they are the same in practice)."""
            if key in raw and raw[key] is not None:
                return raw[key]
            return text.get(key, default)

        num_layers = int(text["num_hidden_layers"])
        layer_types = text.get("layer_types")
        if layer_types is None:
            interval = int(text.get("full_attention_interval", 4))
            layer_types = [
                LayerKind.LINEAR_ATTENTION if (i + 1) % interval else LayerKind.FULL_ATTENTION
                for i in range(num_layers)
            ]
        known = {kind.value for kind in LayerKind}
        if len(layer_types) != num_layers or set(layer_types) - known:
            raise ValueError(f"layer_types {tuple(layer_types)} do not describe {num_layers} supported layers")
        layer_types = tuple(LayerKind(t) for t in layer_types)

        hidden_act = text.get("hidden_act", "silu")
        if hidden_act != "silu":
            raise ValueError(f"hidden_act {hidden_act!r} is not supported (only 'silu')")

        eos = pick("eos_token_id")
        eos_ids = () if eos is None else (int(eos),) if isinstance(eos, int) else tuple(int(e) for e in eos)

        return cls(
            architecture=str(architectures[0]),
            model_type=model_type,
            vocab_size=int(text["vocab_size"]),
            hidden_size=int(text["hidden_size"]),
            num_hidden_layers=num_layers,
            layer_types=layer_types,
            max_position_embeddings=int(text.get("max_position_embeddings", 32768)),
            eos_token_ids=eos_ids,
            tie_word_embeddings=bool(pick("tie_word_embeddings", False)),
            torch_dtype=str(pick("dtype") or pick("torch_dtype") or "bfloat16"),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            hidden_act=hidden_act,
            attention=_attention_config(text),
            gated_delta=_gated_delta_config(text),
            mlp=_feed_forward_config(text, model_type),
            mamba_ssm_dtype=None if pick("mamba_ssm_dtype") is None else str(pick("mamba_ssm_dtype")),
        )._validated()

    def _validated(self) -> ModelConfig:
        attention, delta = self.attention, self.gated_delta
        if attention.num_heads % attention.num_kv_heads:
            raise ValueError(f"{attention.num_heads} attention heads / {attention.num_kv_heads} kv heads")
        if delta.num_v_heads % delta.num_k_heads:
            raise ValueError(f"{delta.num_v_heads} DeltaNet value heads / {delta.num_k_heads} key heads")
        needs_dense = any(not self.is_moe_layer(i) for i in range(self.num_hidden_layers))
        if needs_dense and not self.mlp.intermediate_size:
            raise ValueError("a dense MLP layer needs intermediate_size")
        return self

    @classmethod
    def from_model_dir(cls, path: str | Path) -> ModelConfig:
        """Read `<path>/config.json`; eos ids from `generation_config.json` are added if present."""
        path = Path(path)
        config_path = path / "config.json"
        if not config_path.is_file():
            raise ValueError(f"{config_path} does not exist")
        config = cls.from_dict(json.loads(config_path.read_text()))
        generation_path = path / "generation_config.json"
        if generation_path.is_file():
            eos = json.loads(generation_path.read_text()).get("eos_token_id")
            extra = () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)
            merged = config.eos_token_ids + tuple(int(e) for e in extra if int(e) not in config.eos_token_ids)
            config = replace(config, eos_token_ids=merged)
        return config


def _attention_config(text: dict[str, Any]) -> AttentionConfig:
    """The attention group of a text config (rotary settings in either layout, see the module docstring)."""
    rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"rope_type {rope_type!r} is not supported (only 'default')")
    rope_theta = float(rope.get("rope_theta", text.get("rope_theta", 10000.0)))
    partial = float(rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25)))

    num_heads = int(text["num_attention_heads"])
    section = tuple(int(n) for n in rope.get("mrope_section") or (11, 11, 10))
    if len(section) != 3:
        raise ValueError(f"mrope_section {list(section)} must name 3 axes (temporal, height, width)")
    return AttentionConfig(
        num_heads=num_heads,
        num_kv_heads=int(text.get("num_key_value_heads", num_heads)),
        head_dim=int(text.get("head_dim") or text["hidden_size"] // num_heads),
        bias=bool(text.get("attention_bias", False)),
        rope_theta=rope_theta,
        partial_rotary_factor=partial,
        mrope_section=section,
    )


def _gated_delta_config(text: dict[str, Any]) -> GatedDeltaConfig:
    return GatedDeltaConfig(
        num_k_heads=int(text.get("linear_num_key_heads", 16)),
        num_v_heads=int(text.get("linear_num_value_heads", 32)),
        k_head_dim=int(text.get("linear_key_head_dim", 128)),
        v_head_dim=int(text.get("linear_value_head_dim", 128)),
        conv_kernel_size=int(text.get("linear_conv_kernel_dim", 4)),
    )


def _feed_forward_config(text: dict[str, Any], model_type: str) -> FeedForwardConfig:
    is_qwen3_next = model_type == "qwen3_next"
    is_moe = model_type == "qwen3_5_moe_text" or (is_qwen3_next and int(text.get("num_experts", 512)) > 0)
    return FeedForwardConfig(
        intermediate_size=int(text["intermediate_size"]) if text.get("intermediate_size") else None,
        num_experts=int(text.get("num_experts", 0)) if is_moe else 0,
        num_experts_per_tok=int(text.get("num_experts_per_tok", 0)) if is_moe else 0,
        moe_intermediate_size=int(text.get("moe_intermediate_size", 0)) if is_moe else 0,
        shared_expert_intermediate_size=int(text.get("shared_expert_intermediate_size", 0)) if is_moe else 0,
        # Qwen3.5-MoE always renormalises the top-k weights and puts an MoE block in every layer.
        norm_topk_prob=bool(text.get("norm_topk_prob", True)) if is_qwen3_next else True,
        decoder_sparse_step=int(text.get("decoder_sparse_step", 1)) if is_qwen3_next else 1,
        mlp_only_layers=tuple(int(i) for i in (text.get("mlp_only_layers") or ())) if is_qwen3_next else (),
    )
