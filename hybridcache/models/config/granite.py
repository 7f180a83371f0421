"""Granite-4.0-H (`granitemoehybrid`): Mamba2 and attention layers, named in `layer_types` (or the older
`layers_block_type`) as "mamba" / "attention" or transformers 5's "linear_attention" / "full_attention" (there, a
"linear_attention" layer is Mamba2); the `mamba_*` fields make the `Mamba2Config` group (`mamba_d_head` "auto":
mamba_expand * hidden_size / mamba_n_heads; `time_step_limit` a pair, its bound written as a number, "Infinity" or
transformers' {"__float__": "Infinity"}); `embedding_multiplier`, `residual_multiplier`, `logits_scaling` and
`attention_multiplier` (the attention's softmax scale) are read into `multipliers` and `AttentionConfig.scale`;
`position_embedding_type` "rope" rotates the whole head, anything else ("nope", null) gives attention without RoPE;
the feed-forward block is `shared_mlp` (width `shared_intermediate_size`) plus, when `num_local_experts` > 0, routed
experts of width `intermediate_size` (top `num_experts_per_tok`, softmax over the top-k logits)."""

from __future__ import annotations

from typing import Any

from hybridcache.models.config.fields import Fields
from hybridcache.models.config.groups import FeedForwardConfig, Multipliers


def granite_rope(position_embedding_type: Any) -> bool:
    """Whether Granite's attention rotates: "rope" yes; "nope" or null no (transformers builds its rotary embedding
    for "rope" alone); anything else is refused."""
    if position_embedding_type not in (None, "nope", "rope"):
        raise ValueError(f"config.json position_embedding_type {position_embedding_type!r} is not supported "
                         "('rope', 'nope' or null)")
    return position_embedding_type == "rope"


def granite_feed_forward_config(fields: Fields) -> FeedForwardConfig:
    """Granite's `shared_mlp` (every layer) as the dense MLP, or beside `num_local_experts` routed experts as the
    shared expert (ungated: its output is added as it is)."""
    num_experts = fields.integer("num_local_experts", minimum=0)
    shared = fields.integer("shared_intermediate_size")
    if not num_experts:
        return FeedForwardConfig.dense(shared)
    return FeedForwardConfig(
        intermediate_size=None,
        num_experts=num_experts,
        num_experts_per_tok=fields.integer("num_experts_per_tok"),
        moe_intermediate_size=fields.integer("intermediate_size"),
        shared_expert_intermediate_size=shared,
        norm_topk_prob=True,  # softmax over the top-k logits: the top-k of the softmax, renormalised
        decoder_sparse_step=1,
        mlp_only_layers=(),
    )


def granite_multipliers(fields: Fields) -> Multipliers:
    logits_scaling = fields.number("logits_scaling")
    if logits_scaling <= 0:
        raise ValueError(f"config.json logits_scaling {logits_scaling} must be > 0 (the logits are divided by it)")
    return Multipliers(embedding=fields.number("embedding_multiplier"), residual=fields.number("residual_multiplier"),
                       logits_scaling=logits_scaling)
