"""IBM Granite-4.0-H (`GraniteMoeHybridForCausalLM`, model_type `granitemoehybrid`): Mamba2 and attention layers,
dense or MoE.

Module tree (names equal the checkpoint tensor names; the loader renames three MoE tensors, `loader.RENAMED_SUFFIXES`)::

    model.embed_tokens                                 [vocab, hidden], times embedding_multiplier
    model.layers.{i}.input_layernorm                   RMSNorm (y = w * x / rms(x), not zero-centred)
    model.layers.{i}.mamba                             Mamba2Mixer        (layer_types[i] "mamba")
    model.layers.{i}.self_attn                         GraniteAttention   (layer_types[i] "attention")
    model.layers.{i}.post_attention_layernorm
    model.layers.{i}.shared_mlp.input_linear           [2 Is, hidden]  gate rows, then up rows
    model.layers.{i}.shared_mlp.output_linear          [hidden, Is]
    model.layers.{i}.block_sparse_moe.router           [E, hidden]     (checkpoint: router.layer.weight)
    model.layers.{i}.block_sparse_moe.experts.{e}.*    gate_proj / up_proj / down_proj (checkpoint: input_linear
                                                       [E, 2I, hidden] and output_linear [E, hidden, I], stacked)
    model.norm, lm_head                                (logits divided by logits_scaling)

A layer: h = h + m * mixer(norm(h)); h = h + m * ffn(norm(h)) with m = residual_multiplier and
ffn = shared_mlp (+ the routed experts, top-k softmax over the top-k router logits, when num_local_experts > 0).
The attention is plain GQA (no gate, no q/k norm) with softmax scale attention_multiplier, rotary only when
position_embedding_type is "rope" (Granite-4.0-H: "nope").

The RMSNorms are the backend's (`layers.norm.RMSNorm`: transformers' rounding, normalised in fp32, rounded to the
input dtype, then times the weight), and each residual add is the next norm's, m * out rounded before the add as
transformers' `residual + out * residual_multiplier` rounds it (`add_rms_norm`'s `scale`: one launch on CUDA).
FP8: compressed-tensors FP8_DYNAMIC checkpoints as llm-compressor's Granite-4.0-H recipe writes them (the stacked
experts' `input_linear.weight_scale` [E, 2I, 1] split per expert by the loader; the router dense), the other FP8
layouts the loader reads, `--quantization fp8`, FP8 KV (`GraniteAttention.kv_dtype`).
Not supported (a ValueError says so): tensor parallelism, MTP, images.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

import hybridcache.kernels.backend as kernel_backend
from hybridcache.forward_batch import ForwardBatch
from hybridcache.kernels.backend import KernelBackend
from hybridcache.layers.attention import kv_for_cache
from hybridcache.layers.fused import FusedProjection
from hybridcache.layers.linear import module_linear, module_swiglu_linear
from hybridcache.layers.mlp import MLP
from hybridcache.layers.norm import RMSNorm
from hybridcache.layers.step import Splitter, StepContext
from hybridcache.models.config import LayerKind, ModelConfig
from hybridcache.models.mamba_hybrid import MambaHybridLM, mamba2_mixer
from hybridcache.state_spec import AttentionSpec, DevicePools, LayerState


class GraniteAttention(nn.Module):
    """Causal GQA over the paged KV pool: q, k, v projections, RoPE when `use_rope` (on the channels of the step's cos /
    sin: the whole head for Granite and Falcon-H1, half of it for Bamba), softmax scale `scale`, o_proj. FP8 KV as
    `layers.attention.GatedAttention`'s (`kv_dtype`, `k_scale`, `v_scale`, set by the loader: `kv_for_cache`)."""

    def __init__(self, hidden_size: int, *, num_heads: int, num_kv_heads: int, head_dim: int, bias: bool,
                 scale: float, use_rope: bool) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.use_rope = use_rope
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=bias)
        self.qkv = FusedProjection(self.q_proj, self.k_proj, self.v_proj)
        self.kv_dtype: torch.dtype | None = None  # None: the model dtype; float8_e4m3fn: FP8 KV
        self.k_scale = 1.0
        self.v_scale = 1.0

    @classmethod
    def from_config(cls, config: ModelConfig, *, bias: bool, use_rope: bool) -> GraniteAttention:
        """The attention of `config` (`config.attention`'s heads, head size and softmax scale), with the family's
        `bias` and `use_rope` (what its config states or implies)."""
        a = config.attention
        return cls(config.hidden_size, num_heads=a.num_heads, num_kv_heads=a.num_kv_heads, head_dim=a.head_dim,
                   bias=bias, scale=a.softmax_scale, use_rope=use_rope)

    @property
    def input_projection(self) -> FusedProjection:
        return self.qkv

    def state_spec(self, dtype: torch.dtype, state_dtype: torch.dtype) -> AttentionSpec:
        """Paged KV in the model dtype, or `kv_dtype` when set (`state_dtype` is for recurrent state)."""
        del state_dtype
        return AttentionSpec(num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, dtype=self.kv_dtype or dtype)

    def forward(self, hidden: torch.Tensor, step: StepContext, kv_layer: torch.Tensor) -> torch.Tensor:
        """hidden [T, hidden] -> [T, hidden]; kv_layer [2, num_pages, kernel_block_size, Hkv, D] (updated in place)."""
        num_tokens = hidden.shape[0]
        query, key, value = self._project(hidden, step.backend)
        query = query.reshape(num_tokens, self.num_heads, self.head_dim)
        key = key.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        value = value.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        if self.use_rope:
            query, key = step.backend.rotary(query, key, *step.rope)
        key, value = kv_for_cache(key, value, self)
        attn = step.core(functools.partial(self._attend, kv_layer), query, key, value)
        return module_linear(self.o_proj, attn.reshape(num_tokens, -1))

    def _project(self, hidden: torch.Tensor, backend: KernelBackend) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """hidden [T, hidden] -> query [T, Hq * D], key, value [T, Hkv * D] (a subclass may normalise them here, with
        `backend`'s norms: OLMo Hybrid's and LFM2's q_norm / k_norm)."""
        return self.qkv(hidden)

    def _attend(self, kv_layer: torch.Tensor, step: StepContext, query: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor) -> torch.Tensor:
        """The layer's core (`StepContext.core`): key and value written to the pool, then the attention."""
        step.backend.write_kv(kv_layer, key, value, step.batch)
        return step.backend.attention(query, kv_layer, step.batch, scale=self.scale,
                                      kv_scales=(self.k_scale, self.v_scale))


class SharedMLP(nn.Module):
    """x [N, hidden] -> output_linear(silu(gate) * up) with gate | up = input_linear(x) (the checkpoint's layout)."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.input_linear = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.output_linear = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor, step: StepContext) -> torch.Tensor:
        return self.down(*module_linear(self.input_linear, x).chunk(2, dim=-1), step)

    def down(self, gate: torch.Tensor, up: torch.Tensor, step: StepContext) -> torch.Tensor:
        """output_linear(silu(gate) * up): the MLP after its input GEMM."""
        return module_swiglu_linear(self.output_linear, gate, up, step.backend)


class GraniteMoE(nn.Module):
    """The routed experts (no shared expert: the layer adds `shared_mlp`): probs = softmax over the top-k router
    logits (= the top-k of the softmax, renormalised: `backend.route`), out = sum_k w_k expert_k(x)."""

    def __init__(self, hidden_size: int, *, num_experts: int, top_k: int, intermediate_size: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts = nn.ModuleList(MLP(hidden_size, intermediate_size, reduce=False) for _ in range(num_experts))

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor, shared: torch.Tensor | kernel_backend.Pending,
                step: StepContext) -> torch.Tensor:
        """router(x) given (the layer's fused input GEMM computed it), the shared MLP's output (pending on the side
        stream, or computed) added to the routed experts' in their combine. transformers' gating (fp32 logits, the
        top-k's softmax, the weights in x's dtype): `route` softmaxes x's dtype's logits in fp32 and rounds the
        weights to it, the same bits as casting before and after."""
        top_weights, top_ids = step.backend.route(router_logits, self.top_k, True)
        return step.backend.moe(x, top_weights, top_ids, self.experts, (None, shared))


class GraniteDecoderLayer(nn.Module):
    """h + m * mixer(input_layernorm(h)), then h + m * (shared_mlp + block_sparse_moe)(post_attention_layernorm(h))
    (m: residual_multiplier); `forward_split` as `hybrid_lm.DecoderLayer`'s, except that its pending output is not yet
    times m: the norm that adds it scales it (the next layer's, or the model's `forward_layers` after the last)."""

    def __init__(self, mixer_name: str, mixer: nn.Module, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        c, mlp = config, config.mlp
        self.mixer_name = mixer_name
        self.add_module(mixer_name, mixer)
        self.residual_multiplier = c.multipliers.residual
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        moe = c.is_moe_layer(layer_id)
        width = mlp.shared_expert_intermediate_size if moe else mlp.intermediate_size
        self.shared_mlp = SharedMLP(c.hidden_size, width)
        self.block_sparse_moe = GraniteMoE(c.hidden_size, num_experts=mlp.num_experts, top_k=mlp.num_experts_per_tok,
                                           intermediate_size=mlp.moe_intermediate_size) if moe else None
        # an MoE layer's two projections of its input in one GEMM (FP8 beside the dense router: two)
        self.inputs = FusedProjection(self.shared_mlp.input_linear, self.block_sparse_moe.router) if moe else None

    @property
    def mixer(self) -> nn.Module:
        return getattr(self, self.mixer_name)

    def forward_split(self, hidden: torch.Tensor, pending: torch.Tensor | None, step: StepContext,
                      state: LayerState) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer on hidden + m * pending, returned as (residual, out) whose residual + m * out is its output."""
        m = self.residual_multiplier
        if pending is None:
            normed = self.input_layernorm(hidden, step.backend)
        else:
            hidden, normed = self.input_layernorm.add(hidden, pending, step.backend, scale=m)
        out = self.mixer(normed, step, state)
        hidden, normed = self.post_attention_layernorm.add(hidden, out, step.backend, scale=m)
        if self.block_sparse_moe is None:
            return hidden, self.shared_mlp(normed, step)
        # the shared MLP on the side stream (CUDA) beside the routing and the routed experts, as Qwen's shared expert
        # (`layers/mlp.py`); `moe` joins it before the combine that adds it
        gate_up, router_logits = self.inputs(normed)
        shared = kernel_backend.fork(step.backend.side_stream(normed.device), self.shared_mlp.down,
                                     *gate_up.chunk(2, dim=-1), step)
        return hidden, self.block_sparse_moe(normed, router_logits, shared, step)


class GraniteMoeHybridForCausalLM(MambaHybridLM):
    supported_model_types = ("granitemoehybrid",)
    supports_fp8 = True

    def _layer(self, layer_id: int) -> nn.Module:
        return GraniteDecoderLayer(*self._mixer(layer_id), self.config, layer_id)

    def forward_layers(self, batch: ForwardBatch, pools: DevicePools, backend: KernelBackend,
                       splitter: Splitter | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`HybridCausalLM.forward_layers`, the last layer's pending output times m (each layer's own is scaled by
        the norm after it: `GraniteDecoderLayer`)."""
        hidden, pending = super().forward_layers(batch, pools, backend, splitter)
        m = self.config.multipliers.residual
        return hidden, pending if pending is None or m == 1.0 else pending * m

    def _mixer(self, layer_id: int) -> tuple[str, nn.Module]:
        c = self.config
        if c.layer_types[layer_id] is LayerKind.MAMBA2:
            return "mamba", mamba2_mixer(c)
        return "self_attn", GraniteAttention.from_config(c, bias=c.attention.bias, use_rope=c.attention.use_rope)
