"""`LayerKind`, the token mixer of a decoder layer, and the config.json spellings of the layer kinds of each model
type."""

from __future__ import annotations

from enum import Enum


class LayerKind(str, Enum):
    """The token mixer of a decoder layer, spelled as in config.json's `layer_types` (a str; `str()` and
    formatting give the value, as Python 3.11's StrEnum, which 3.10 lacks)."""

    __str__ = str.__str__
    __format__ = str.__format__

    LINEAR_ATTENTION = "linear_attention"  # gated DeltaNet
    FULL_ATTENTION = "full_attention"  # (gated) attention over the paged KV cache
    MAMBA2 = "mamba"  # Mamba2 (Granite-4.0-H's spelling; transformers 5 writes "linear_attention" there)
    MLP = "mlp"  # a feed-forward block as a layer of its own, no token mixer, no state (Nemotron-H's "-" and, with
    # `is_moe_layer` true, its MoE layers "E")
    HYBRID = "hybrid"  # attention and Mamba2 side by side on the same input, then an MLP (Falcon-H1's every layer):
    # the layer holds paged KV and a Mamba2 state, so it is both an attention layer and a Mamba2 layer
    MAMBA1 = "mamba1"  # Mamba1 with Jamba's inner norms (Jamba writes "mamba", which for Granite means Mamba2)
    SHORT_CONV = "conv"  # LFM2's gated short convolution: a conv state only


# The layer kinds with a fixed-size state (Falcon-H1's hybrid layers hold one beside their KV)
RECURRENT_KINDS = frozenset({LayerKind.LINEAR_ATTENTION, LayerKind.MAMBA2, LayerKind.HYBRID, LayerKind.MAMBA1,
                             LayerKind.SHORT_CONV})


# The layer kinds of each text model type, by their config.json spellings.
QWEN_KINDS = {"linear_attention": LayerKind.LINEAR_ATTENTION, "full_attention": LayerKind.FULL_ATTENTION}
MAMBA_KINDS = {"mamba": LayerKind.MAMBA2, "linear_attention": LayerKind.MAMBA2, "attention": LayerKind.FULL_ATTENTION,
               "full_attention": LayerKind.FULL_ATTENTION}
# Nemotron-H: transformers 5's names and the older ones it remaps
NEMOTRON_KINDS = {**MAMBA_KINDS, "mlp": LayerKind.MLP, "moe": LayerKind.MLP}  # (MoE: `is_moe_layer` says it)
FALCON_KINDS = {"hybrid": LayerKind.HYBRID}  # (transformers' FalconH1Config.layers_block_type: "hybrid" every layer)
JAMBA_KINDS = {"mamba": LayerKind.MAMBA1, "attention": LayerKind.FULL_ATTENTION}
LFM2_KINDS = {"conv": LayerKind.SHORT_CONV, "full_attention": LayerKind.FULL_ATTENTION}
