"""LFM2 (`lfm2`): short-convolution ("conv", `LayerKind.SHORT_CONV`) and attention ("full_attention") layers, from
`layer_types` or else `full_attn_idxs` (both left out: every layer attends, as transformers); `Lfm2Config`'s names:
`norm_eps` (not rms_norm_eps, which transformers does not read), `block_ff_dim` (wins over intermediate_size) and
`tie_embedding` (wins over tie_word_embeddings, default true) as transformers' aliases, `conv_L_cache` (the conv's
kernel size) and `conv_bias` (the short conv's in_proj, conv and out_proj) in the `ShortConvConfig` group; the MLP
width as `Lfm2MLP` adjusts it (`block_auto_adjust_ff_dim`: 2/3 of it, times `block_ffn_dim_multiplier`, rounded up
to a multiple of `block_multiple_of`); RoPE on the whole head (`partial_rotary_factor` other than 1 and
`attention_bias` true are refused; transformers reads neither); `conv_dim` / `conv_dim_out` are not read (transformers'
short conv is hidden_size wide).
LFM2-MoE (`lfm2_moe`): LFM2's layers (`layer_types` required, as transformers' Lfm2MoeConfig; no block_ff_dim alias and
no width adjustment: `Lfm2MoeMLP` is intermediate_size wide) whose first `num_dense_layers` MLPs are dense and the rest
MoE blocks: `num_experts` SiLU-gated experts of `moe_intermediate_size`, top `num_experts_per_tok` of sigmoid scores
plus `expert_bias` (`use_expert_bias`; false is refused), their scores renormalised (+ 1e-6) when `norm_topk_prob`,
times `routed_scaling_factor`; no shared expert (`GroupedRouting` with one group)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridcache.models.config.common import feed_forward_config
from hybridcache.models.config.fields import Fields
from hybridcache.models.config.groups import FeedForwardConfig, GroupedRouting


def lfm2_section(text: Mapping[str, Any], moe: bool) -> dict[str, Any]:
    """LFM2's config.json fields under the names read here, as `Lfm2Config` takes them: `block_ff_dim` wins over
    intermediate_size, `tie_embedding` over tie_word_embeddings, `norm_eps` is the norms' eps (rms_norm_eps is not
    read), and layer_types, left out, come from `full_attn_idxs` (left out too: every layer attends). LFM2-MoE
    (`moe`, `Lfm2MoeConfig`): tie_embedding alone, and layer_types must be written."""
    section = dict(text)
    aliases = {"tie_embedding": "tie_word_embeddings", **({} if moe else {"block_ff_dim": "intermediate_size"})}
    for old, new in aliases.items():
        if section.get(old) is not None:
            section[new] = section[old]
    section["rms_norm_eps"] = section.get("norm_eps")
    if moe and section.get("layer_types") is None:
        raise ValueError("config.json has no layer_types (LFM2-MoE names each layer's kind there: 'conv' or "
                         "'full_attention')")
    if section.get("layer_types") is None:
        layers, attending = section.get("num_hidden_layers"), section.get("full_attn_idxs")
        if isinstance(layers, int) and not isinstance(layers, bool):
            if attending is not None and (not isinstance(attending, list) or not all(
                    isinstance(i, int) and not isinstance(i, bool) for i in attending)):
                raise ValueError(f"config.json full_attn_idxs {attending!r} must be a list of layer indices")
            attending = range(layers) if attending is None else attending
            section["layer_types"] = ["full_attention" if i in attending else "conv" for i in range(layers)]
    return section


def lfm2_moe_feed_forward_config(fields: Fields) -> FeedForwardConfig:
    """LFM2-MoE's MLPs: dense (`intermediate_size`) in the first `num_dense_layers` layers, MoE blocks after them
    (`GroupedRouting` of one group: sigmoid scores + expert_bias pick, renormalised with + 1e-6)."""
    if not fields.boolean("use_expert_bias", default=True):
        raise ValueError("config.json use_expert_bias false is not supported for LFM2-MoE (the released models route "
                         "with their expert_bias)")
    num_experts = fields.integer("num_experts")
    return FeedForwardConfig(
        intermediate_size=fields.integer("intermediate_size"),
        num_experts=num_experts,
        num_experts_per_tok=fields.integer("num_experts_per_tok"),
        moe_intermediate_size=fields.integer("moe_intermediate_size"),
        shared_expert_intermediate_size=0,
        norm_topk_prob=fields.boolean("norm_topk_prob", default=True),
        decoder_sparse_step=1,
        mlp_only_layers=tuple(range(fields.integer("num_dense_layers", minimum=0))),
        grouped_routing=GroupedRouting(num_groups=1, topk_groups=1,
                                       scaling_factor=fields.number("routed_scaling_factor"), renorm_eps=1e-6),
    )


def _lfm2_mlp_width(fields: Fields) -> int:
    """`Lfm2MLP`'s width: intermediate_size, or with `block_auto_adjust_ff_dim` (default true) int(2/3 of it) times
    `block_ffn_dim_multiplier`, rounded up to a multiple of `block_multiple_of` (LFM2-1.2B: block_ff_dim 12,288 ->
    8,192)."""
    width = fields.integer("intermediate_size")
    if not fields.boolean("block_auto_adjust_ff_dim", default=True):
        return width
    multiple = fields.integer("block_multiple_of")
    width = int(fields.number("block_ffn_dim_multiplier") * int(2 * width / 3))
    return multiple * -(-width // multiple)


def lfm2_feed_forward_config(fields: Fields) -> FeedForwardConfig:
    """LFM2's dense MLP: Qwen's feed-forward fields (`common.feed_forward_config`) at `Lfm2MLP`'s width."""
    section = {**fields.section, "intermediate_size": _lfm2_mlp_width(fields)}
    return feed_forward_config(Fields(section, fields.defaults), "lfm2")
