"""Qwen3-Next (`Qwen3NextForCausalLM`, model_type `qwen3_next`): packed DeltaNet input projections
(`in_proj_qkvz`, `in_proj_ba`), sparse MoE with shared expert on layers where
`(i + 1) % decoder_sparse_step == 0` and `i not in mlp_only_layers`, dense MLP elsewhere.
"""

from __future__ import annotations

from hybridcache.layers.gated_deltanet import PackedGatedDeltaNet
from hybridcache.models.hybrid_lm import HybridCausalLM


class Qwen3NextForCausalLM(HybridCausalLM):
    deltanet_cls = PackedGatedDeltaNet
    supported_model_types = ("qwen3_next",)
