"""Bamba (`bamba`): Granite's `mamba_*` fields; attention layers at `attn_layer_indices` (the others Mamba2); RoPE on
head_dim x partial_rotary_factor channels, the factor 0.5 unless `rope_parameters` names one (transformers' BambaConfig
sets 0.5 over a top-level value), `attn_rotary_emb` where written equal to that count; a dense MLP of
`intermediate_size`. Refused: `mlp_bias` true, `attn_layer_indices` naming no layer, a `layers_block_type` that
disagrees with them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridcache.models.config.groups import AttentionConfig
from hybridcache.models.config.kinds import MAMBA_KINDS


def bamba_layer_types(text: Mapping[str, Any], num_layers: int) -> list[str]:
    """Bamba's layer kinds: "attention" at the `attn_layer_indices`, "mamba" elsewhere (none: every layer Mamba2, as
    transformers' `BambaConfig.layers_block_type`). A written `layers_block_type` / `layer_types` must agree."""
    indices = text.get("attn_layer_indices") or []
    if not isinstance(indices, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in indices) or (
            any(not 0 <= i < num_layers for i in indices)):
        raise ValueError(f"config.json attn_layer_indices {indices!r} must list layer indices in [0, {num_layers})")
    kinds = ["attention" if i in indices else "mamba" for i in range(num_layers)]
    written = text.get("layers_block_type") or text.get("layer_types")
    if written is not None and (not isinstance(written, list) or [MAMBA_KINDS.get(t) for t in written] != [
            MAMBA_KINDS[t] for t in kinds]):
        raise ValueError(f"config.json layers_block_type {written!r} disagrees with attn_layer_indices {indices!r}")
    return kinds


def check_bamba_rotary(text: Mapping[str, Any], attention: AttentionConfig) -> None:
    """Bamba's checkpoints name the rotated channels of a head twice: `attn_rotary_emb` (the original training code's
    count) and head_dim x partial_rotary_factor (transformers', 0.5 unless rope_parameters says otherwise); a config
    where they differ is ambiguous and refused."""
    written = text.get("attn_rotary_emb")
    if written is not None and written != attention.rotary_dim:
        raise ValueError(f"config.json attn_rotary_emb {written!r} is not head_dim {attention.head_dim} x "
                         f"partial_rotary_factor {attention.partial_rotary_factor} = {attention.rotary_dim}, the "
                         "channels transformers' Bamba rotates")
