"""Qwen3.5 text models: dense `Qwen3_5ForCausalLM` (model_type `qwen3_5_text`) and
`Qwen3_5MoeForCausalLM` (model_type `qwen3_5_moe_text`, a sparse MoE block with shared expert in every
layer). Both use separate DeltaNet input projections (`in_proj_qkv`, `in_proj_z`, `in_proj_b`,
`in_proj_a`). The multimodal wrappers (`Qwen3_5ForConditionalGeneration`, ...) load into these classes;
their vision tower is not built (see `hybridcache.models.loader`).
"""

from __future__ import annotations

from hybridcache.layers.gated_deltanet import GatedDeltaNet
from hybridcache.models.hybrid_lm import HybridCausalLM


class Qwen3_5ForCausalLM(HybridCausalLM):
    deltanet_cls = GatedDeltaNet
    supported_model_types = ("qwen3_5_text",)


class Qwen3_5MoeForCausalLM(HybridCausalLM):
    deltanet_cls = GatedDeltaNet
    supported_model_types = ("qwen3_5_moe_text",)
