"""The hyper-parameter groups of `ModelConfig`, one frozen dataclass each: a layer family's (`AttentionConfig`,
`GatedDeltaConfig`, `MLAConfig`, `Mamba2Config`, `Mamba1Config`, `ShortConvConfig`), the muP scalings
(`Multipliers`) and the feed-forward block (`FeedForwardConfig`, its router `GroupedRouting`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class AttentionConfig:
    """Gated full attention: `num_heads` query heads (each with an output gate), `num_kv_heads` key/value
    heads of `head_dim`, RoPE on the first `rotary_dim` channels of each head.

    `rope_scaling`: () for plain RoPE, else the sorted (key, value) items of a scaled RoPE, `rope_type` among them
    (e.g. (("factor", 4.0), ("original_max_position_embeddings", 262144), ("rope_type", "yarn"))), lists as
    tuples; `max_position_embeddings`: the model's, which YaRN may read (`layers.rotary.scaled_inv_freq`).
    `use_rope` False: no rotary embedding at all (Granite-4.0-H's "nope"); `scale`: see `softmax_scale`."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    bias: bool
    rope_theta: float
    partial_rotary_factor: float
    mrope_section: tuple[int, int, int] = (11, 11, 10)
    rope_scaling: tuple[tuple[str, Any], ...] = ()
    max_position_embeddings: int = 32768
    use_rope: bool = True
    scale: float | None = None

    @property
    def softmax_scale(self) -> float:
        """The attention's scale of q.k: `scale` when config.json sets one (Granite's attention_multiplier), else
        1 / sqrt(head_dim)."""
        return self.head_dim**-0.5 if self.scale is None else self.scale

    @property
    def rotary_dim(self) -> int:
        """Leading channels of each attention head that RoPE rotates (the rest pass through)."""
        return int(self.head_dim * self.partial_rotary_factor)


@dataclass(frozen=True)
class GatedDeltaConfig:
    """Gated DeltaNet: `num_k_heads` query/key heads of `k_head_dim`, `num_v_heads` value heads of
    `v_head_dim`, a depthwise causal convolution of `conv_kernel_size` over q | k | v. `allow_neg_eigval` (OLMo
    Hybrid's `linear_allow_neg_eigval`): beta = 2 sigmoid(b), in (0, 2), so the state's transition I - beta k k^T
    may have a negative eigenvalue."""

    num_k_heads: int
    num_v_heads: int
    k_head_dim: int
    v_head_dim: int
    conv_kernel_size: int
    allow_neg_eigval: bool = False

    @property
    def beta_scale(self) -> float:
        """What sigmoid(b) is multiplied by to give beta: 2 with `allow_neg_eigval`, else 1."""
        return 2.0 if self.allow_neg_eigval else 1.0

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
class MLAConfig:
    """Kimi Linear's multi-head latent attention (DeepSeek-V2's MLA without rotary embedding, `mla_use_nope`): q
    from `q_proj` (or `q_a_proj` -> norm -> `q_b_proj` of rank `q_lora_rank`), a latent of `kv_lora_rank` and a
    key part of `qk_rope_head_dim` shared by every head from `kv_a_proj_with_mqa`, the latent expanded per head
    into a key part of `qk_nope_head_dim` and a value of `v_head_dim` by `kv_b_proj`. A head's key is
    [k_nope | k_shared] (`qk_head_dim` wide), the softmax scale qk_head_dim^-1/2. The paged KV holds each token's
    latent row [latent | k_shared] (`latent_width`), half in the keys and half in the values of one kv head of
    `cache_head_dim` lanes (`ModelConfig.attention`; `kernels/attention/latent.py` draws the layout)."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_width(self) -> int:
        """E, a cached latent row's lanes: the latent and the shared key part (512 + 64 for the released models)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def cache_head_dim(self) -> int:
        """The paged KV's head dim: ceil(E / 2), a row's halves in the keys and the values of one kv head (288 for
        the released models)."""
        return -(-self.latent_width // 2)


@dataclass(frozen=True)
class Mamba2Config:
    """Mamba2: `num_heads` heads of `head_dim` channels, `num_groups` groups of B and C with `state_size` each, a
    depthwise causal convolution of `conv_kernel_size` over x | B | C; dt clamped to `time_step_limit` after its
    softplus; `chunk_size`: the checkpoint's scan chunk (kept for reference; results do not depend on it)."""

    num_heads: int
    head_dim: int
    num_groups: int
    state_size: int
    conv_kernel_size: int
    conv_bias: bool
    proj_bias: bool
    chunk_size: int
    time_step_limit: tuple[float, float] = (0.0, float("inf"))
    # Falcon-H1's variations (the others keep these defaults): no gated norm (`rms_norm` False: y * silu(z)), the norm
    # before the gate, out_proj's bias apart from in_proj's (None: `proj_bias`), and the scales of z, x, B, C, dt after
    # in_proj (its muP vector, `ssm_multipliers`)
    rms_norm: bool = True
    norm_before_gate: bool = False
    out_proj_bias: bool | None = None
    in_multipliers: tuple[float, float, float, float, float] = (1.0, 1.0, 1.0, 1.0, 1.0)

    @property
    def intermediate_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the short convolution: x | B | C."""
        return self.intermediate_size + 2 * self.num_groups * self.state_size

    @property
    def conv_width(self) -> int:
        """Past pre-convolution inputs kept per channel: kernel size - 1."""
        return self.conv_kernel_size - 1


@dataclass(frozen=True)
class Mamba1Config:
    """Mamba1 (Jamba's): `intermediate_size` channels (mamba_expand * hidden_size), each with `state_size` state
    entries of their own decay; dt of rank `dt_rank` before dt_proj; a depthwise causal convolution of
    `conv_kernel_size` over the channels; `conv_bias` on it, `proj_bias` on in_proj and out_proj."""

    intermediate_size: int
    state_size: int
    dt_rank: int
    conv_kernel_size: int
    conv_bias: bool
    proj_bias: bool

    @property
    def conv_dim(self) -> int:
        """Channels of the short convolution: x."""
        return self.intermediate_size

    @property
    def conv_width(self) -> int:
        """Past pre-convolution inputs kept per channel: kernel size - 1."""
        return self.conv_kernel_size - 1


@dataclass(frozen=True)
class ShortConvConfig:
    """LFM2's gated short convolution over the hidden_size channels: B | C | x = in_proj(h), y = C * conv(B * x)
    (depthwise, causal, `conv_kernel_size` taps, no activation), out_proj(y); `bias` on in_proj, the conv and
    out_proj (`conv_bias`)."""

    conv_kernel_size: int
    bias: bool

    @property
    def conv_width(self) -> int:
        """Past pre-convolution inputs kept per channel: kernel size - 1."""
        return self.conv_kernel_size - 1


@dataclass(frozen=True)
class Multipliers:
    """The muP scalings, all 1 but where config.json sets them. Granite's: the embedding times `embedding`, each
    block's output times `residual` before its residual add, the logits divided by `logits_scaling`. Falcon-H1's:
    the embedding times `embedding`, the logits times `logits` (its lm_head_multiplier), the keys times `key` (before
    RoPE), the attention's input and output times `attention_in` / `attention_out`, the Mamba2 mixer's times `ssm_in`
    / `ssm_out`, the MLP's gate projection times `mlp_gate` (before its SiLU) and its output times `mlp_down`."""

    embedding: float = 1.0
    residual: float = 1.0
    logits_scaling: float = 1.0
    logits: float = 1.0
    key: float = 1.0
    attention_in: float = 1.0
    attention_out: float = 1.0
    ssm_in: float = 1.0
    ssm_out: float = 1.0
    mlp_gate: float = 1.0
    mlp_down: float = 1.0


@dataclass(frozen=True)
class GroupedRouting:
    """Nemotron-H's router (DeepSeek-V3's "noaux_tc"), in fp32: scores = sigmoid(logits); the choice reads
    scores + e_score_correction_bias (a per-expert tensor of the checkpoint), in which each of `num_groups` groups
    of E / num_groups experts ranks by the sum of its two best, the `topk_groups` best groups are kept and the top
    k experts of those picked; the weights are the picks' uncorrected scores, divided by their sum (+ `renorm_eps`)
    when `norm_topk_prob`, times `scaling_factor` (`routed_scaling_factor`). LFM2-MoE's router is the one-group case
    with its `expert_bias` as the correction bias and a renorm_eps of 1e-6."""

    num_groups: int
    topk_groups: int
    scaling_factor: float
    renorm_eps: float = 1e-20


@dataclass(frozen=True)
class FeedForwardConfig:
    """The feed-forward block after each mixer: a dense SiLU-gated MLP of `intermediate_size`, or a sparse
    MoE block (`num_experts` routed experts, top `num_experts_per_tok`, plus a gated shared expert) where
    `is_moe_layer`. `num_experts == 0` means dense everywhere. `in_own_layers` (Nemotron-H): no block after the
    mixers; the dense blocks (non-gated, `ModelConfig.hidden_act` "relu2") are the layers of kind `LayerKind.MLP`,
    and so are its MoE layers, `moe_layer_ids` (ungated relu^2 experts and shared expert, routed by
    `grouped_routing`, the experts inside `moe_latent_size` projections when set)."""

    intermediate_size: int | None
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    norm_topk_prob: bool
    decoder_sparse_step: int
    mlp_only_layers: tuple[int, ...]
    in_own_layers: bool = False
    moe_layer_ids: tuple[int, ...] = ()
    grouped_routing: GroupedRouting | None = None
    moe_latent_size: int | None = None

    @classmethod
    def dense(cls, intermediate_size: int, in_own_layers: bool = False) -> FeedForwardConfig:
        """A dense SiLU-gated MLP of `intermediate_size` (no experts) after every mixer, or in layers of its own."""
        return cls(intermediate_size=intermediate_size, num_experts=0, num_experts_per_tok=0, moe_intermediate_size=0,
                   shared_expert_intermediate_size=0, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=(),
                   in_own_layers=in_own_layers)

    def is_moe_layer(self, layer_id: int) -> bool:
        """True where layer `layer_id` has a sparse MoE block (the transformers rule; where the feed-forward blocks
        are layers of their own, `in_own_layers`, or where `moe_layer_ids` lists them (Jamba), those layers)."""
        if self.in_own_layers or self.moe_layer_ids:
            return layer_id in self.moe_layer_ids
        return (
            layer_id not in self.mlp_only_layers
            and self.num_experts > 0
            and (layer_id + 1) % self.decoder_sparse_step == 0
        )
