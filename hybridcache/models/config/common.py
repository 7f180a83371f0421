"""The group readers more than one family uses: Qwen's gated DeltaNet fields (OLMo Hybrid's too; every other family
gets the Qwen defaults, unread), Qwen's feed-forward fields (LFM2's dense MLP too), the dense MLP without biases
(Bamba, Falcon-H1) and Granite's `mamba_*` Mamba2 fields (Bamba, Falcon-H1)."""

from __future__ import annotations

from hybridcache.models.config.fields import Fields, time_step_limit
from hybridcache.models.config.groups import FeedForwardConfig, GatedDeltaConfig, Mamba2Config


def gated_delta_config(fields: Fields, allow_neg_eigval: bool = False) -> GatedDeltaConfig:
    return GatedDeltaConfig(
        num_k_heads=fields.integer("linear_num_key_heads"),
        num_v_heads=fields.integer("linear_num_value_heads"),
        k_head_dim=fields.integer("linear_key_head_dim"),
        v_head_dim=fields.integer("linear_value_head_dim"),
        conv_kernel_size=fields.integer("linear_conv_kernel_dim", minimum=2),  # (1: no conv state to keep)
        allow_neg_eigval=allow_neg_eigval,
    )


def feed_forward_config(fields: Fields, model_type: str) -> FeedForwardConfig:
    text = fields.section
    is_qwen3_next = model_type == "qwen3_next"
    is_moe = model_type == "qwen3_5_moe_text" or (is_qwen3_next and fields.integer("num_experts", minimum=0) > 0)
    has_dense = fields.value("intermediate_size") is not None  # Qwen3.5-MoE has no dense MLP
    return FeedForwardConfig(
        intermediate_size=fields.integer("intermediate_size") if has_dense else None,
        num_experts=fields.integer("num_experts") if is_moe else 0,
        num_experts_per_tok=fields.integer("num_experts_per_tok") if is_moe else 0,
        moe_intermediate_size=fields.integer("moe_intermediate_size") if is_moe else 0,
        shared_expert_intermediate_size=(fields.integer("shared_expert_intermediate_size", minimum=0)
                                         if is_moe else 0),
        # Qwen3.5-MoE always renormalises the top-k weights and puts an MoE block in every layer.
        norm_topk_prob=fields.boolean("norm_topk_prob", default=True) if is_qwen3_next else True,
        decoder_sparse_step=fields.integer("decoder_sparse_step") if is_qwen3_next else 1,
        mlp_only_layers=tuple(int(i) for i in (text.get("mlp_only_layers") or ())) if is_qwen3_next else (),
    )


def dense_feed_forward_config(fields: Fields, family: str) -> FeedForwardConfig:
    """A dense SiLU-gated MLP of `intermediate_size` after every mixer (Bamba's `feed_forward`), without biases."""
    if fields.boolean("mlp_bias", default=False):
        raise ValueError(f"config.json mlp_bias true is not supported for {family} (its checkpoints have none)")
    return FeedForwardConfig.dense(fields.integer("intermediate_size"))


def mamba2_config(fields: Fields, inner: tuple[int, str] | None = None) -> Mamba2Config:
    """Granite-4.0-H's (and Bamba's) `mamba_*` fields, as transformers' `GraniteMoeHybridConfig` checks them; `inner`:
    the Mamba2 channels and the fields that say them (None: mamba_expand * hidden_size; Falcon-H1: mamba_d_ssm)."""
    heads = fields.integer("mamba_n_heads")
    inner, named = inner or (fields.integer("mamba_expand") * fields.integer("hidden_size"),
                             "mamba_expand * hidden_size")
    if fields.value("mamba_d_head") == "auto":
        if inner % heads:
            raise ValueError(f"config.json mamba_n_heads {heads} must divide {named} {inner}")
        head_dim = inner // heads
    else:
        head_dim = fields.integer("mamba_d_head")
    if head_dim * heads != inner:
        raise ValueError(f"config.json mamba_d_head {head_dim} x mamba_n_heads {heads} must be {named} {inner}")
    groups = fields.integer("mamba_n_groups")
    if heads % groups:
        raise ValueError(f"config.json mamba_n_groups {groups} must divide mamba_n_heads {heads}")
    return Mamba2Config(
        num_heads=heads,
        head_dim=head_dim,
        num_groups=groups,
        state_size=fields.integer("mamba_d_state"),
        conv_kernel_size=fields.integer("mamba_d_conv", minimum=2),  # (1: no conv state to keep)
        conv_bias=fields.boolean("mamba_conv_bias", default=True),
        proj_bias=fields.boolean("mamba_proj_bias", default=False),
        chunk_size=fields.integer("mamba_chunk_size"),
        time_step_limit=time_step_limit(fields.section.get("time_step_limit")),
    )
