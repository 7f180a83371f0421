"""Moonshot Kimi Linear (`KimiLinearForCausalLM`, model_type `kimi_linear`; Kimi-Linear-48B-A3B-Base / -Instruct):
Kimi Delta Attention (KDA) layers and multi-head latent attention (MLA) layers, a dense SwiGLU MLP in the "dense"
layers of `mlp_layer_types` (else the first `first_k_dense_replace` layers) and a sparse MoE block in the others;
pre-norm RMSNorm layers.

Module tree (names equal the released checkpoints' tensor names; transformers' in-memory KDA gate names
`self_attn.forget_gate.*` load too, `loader.RENAMED_SUFFIXES`; the checkpoints' `q_conv1d`, `k_conv1d`, `v_conv1d`
are concatenated into `conv1d`, `loader.CONCATENATED_SUFFIXES`)::

    model.embed_tokens                          [vocab, hidden]
    model.layers.{i}.input_layernorm            RMSNorm
    model.layers.{i}.self_attn                  KimiDeltaAttention (layer_types[i] "linear_attention"):
        q_proj, k_proj, v_proj [H*K, hidden]; conv1d [3*H*K, 1, W] (no bias); f_a_proj [K, hidden],
        f_b_proj [H*K, K], dt_bias [H*K] (fp32), A_log [1, 1, H, 1]; b_proj [H, hidden]; g_a_proj [K, hidden],
        g_b_proj [H*K, K]; o_norm [K]; o_proj [hidden, H*K]
                                                KimiMLA (layer_types[i] "full_attention"):
        q_proj [H*Dqk, hidden] (or q_a_proj, q_a_layernorm, q_b_proj with q_lora_rank); kv_a_proj_with_mqa
        [R + Dr, hidden]; kv_a_layernorm [R]; kv_b_proj [H*(Dn + Dv), R]; o_proj [hidden, H*Dv]
        (the latent norms q_a_layernorm, kv_a_layernorm at eps 1e-6, as transformers', not rms_norm_eps)
    model.layers.{i}.post_attention_layernorm   RMSNorm
    model.layers.{i}.mlp                        gate_proj, up_proj, down_proj (a dense layer)
    model.layers.{i}.block_sparse_moe           gate.weight [E, hidden], gate.e_score_correction_bias [E] (fp32),
                                                experts.{e}.w1 / w3 [I, hidden] (gate / up), w2 [hidden, I];
                                                shared_experts.gate_proj / up_proj / down_proj (none with
                                                num_shared_experts 0: transformers' zero-width ones are dropped)
    model.norm, lm_head

KDA (per token; H heads of K channels, keys and values both K wide):
    q|k|v = silu(causal depthwise conv(q_proj(x) | k_proj(x) | v_proj(x)))     conv state [3*H*K, W-1]
    g = -exp(A_log) * softplus(f_b_proj(f_a_proj(x)) + dt_bias)   [H, K] fp32: a log decay per key channel
    beta = sigmoid(b_proj(x))
    o = gated delta rule(q, k, v, g, beta)       S = diag(exp(g)) S; S += k (beta (v - S^T k))^T; o = S^T q / sqrt(K)
                                                 (q, k l2-normalised), state S [H, K, K] (the state dtype)
    out = o_proj(RMSNorm(o) * sigmoid(g_b_proj(g_a_proj(x))))   (norm over K per head, fp32, weight in fp32)
The rule is the backend's `gated_delta_rule` with g [T, H, K] (the DeltaNet op's per-head g generalised).

MLA without rotary embedding (`mla_use_nope`; transformers' Kimi Linear applies none): a head's query [Dqk],
key [k_nope_h | k_shared] (Dqk = Dn + Dr; k_shared, Dr wide, is the same for every head), value [Dv]; softmax
scale Dqk^-1/2. The paged KV holds each token's latent row [c | k_shared] (E = R + Dr: c = kv_a_layernorm of the
latent, R = kv_lora_rank), not the heads' expanded keys and values. The backend's `mla_attention` attends with
`kv_b_proj`'s two halves absorbed (DeepSeek-V2's MLA inference form; `kernels/attention/latent.py` has the layout
and the maths):

    W_UK, W_UV = kv_b_proj.weight viewed [H, Dn + Dv, R], split [H, Dn, R], [H, Dv, R]
    qa_h   = [W_UK_h^T q_nope_h | q_shared_h]                       [T, H, E]   (the absorbed query)
    lat_h  = sum_j softmax_j(scale * qa_h . row_j) c_j              [T, H, R]
    out_h  = W_UV_h lat_h                                           [T, H, Dv]  -> o_proj

qa_h . row_j = q_nope_h . (W_UK_h c_j) + q_shared_h . k_shared_j is the expanded key's score, and W_UV_h lat_h the
weighted sum of the expanded values, so the results are the expanded attention's up to rounding; on CUDA a prefill
step instead up-projects its contexts (in windows of keys past 32,768 tokens) and runs the expanded attention
(`kernels/attention/mla_prefill.py`), a third of the arithmetic. A token and layer
take E values (1,152 B in bf16 for the released models, R = 512, Dr = 64) against the expanded 2 x H x 192
(24 KiB).

Tensor parallel (`tp`): KDA and MLA split by head (a KDA head's q / k / v rows, conv channels, decay and gate rows,
A_log and b_proj rows; an MLA head's query and kv_b_proj rows), o_proj by its input columns, all-reduced; the
low-rank f_a / g_a projections, the norms, MLA's kv_a_proj_with_mqa and latent norm are replicated, so every rank
writes the same latent rows into its own paged KV. Every MLP and expert splits its intermediate dim, the router is
replicated, and the MoE block all-reduces routed and shared partial sums once (`layers/mlp.py`).

Not supported (a ValueError says so): FP8 weights or KV, MTP, MLA with rotary embedding, images.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import ClassVar

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from hybridcache.layers.linear import module_linear
from hybridcache.layers.mlp import MLP, gated_mlp_shards
from hybridcache.layers.norm import RMSNorm
from hybridcache.layers.parallel import UNSHARDED, Shard, TensorParallel, columns, rows
from hybridcache.layers.step import StepContext
from hybridcache.models.config import LayerKind, MLAConfig, ModelConfig
from hybridcache.models.hybrid_lm import DecoderLayer, HybridCausalLM
from hybridcache.models.nemotron_h import GroupedTopKRouter
from hybridcache.state_spec import AttentionSpec, RecurrentSpec, conv_ssm_spec

# The epsilon of MLA's latent norms (q_a_layernorm, kv_a_layernorm): transformers builds them at its RMSNorm's
# default, not at the config's rms_norm_eps (1e-5 in the released config), which the other norms use
MLA_LATENT_NORM_EPS = 1e-6


class SigmoidGatedRMSNorm(nn.Module):
    """x, gate [..., D] -> round(w * x / rms(x) * sigmoid(gate)), in fp32 with the weight in fp32 (transformers'
    KimiLinearRMSNormGated)."""

    centred_on_one: ClassVar[bool] = True  # its weight scales as it is (random weights draw it around 1)

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()
        return (normed * torch.sigmoid(gate.float())).to(x.dtype)


class KimiDeltaAttention(nn.Module):
    """The KDA layer (module docstring): hidden [T, hidden] -> [T, hidden]; state `conv` [slots, 3*H*K, W-1] (model
    dtype) and `ssm` [slots, H, K, K] (state dtype), sequence i in row batch.state_slots[i], updated in place."""

    def __init__(self, hidden_size: int, *, num_heads: int, head_dim: int, conv_kernel_size: int, eps: float,
                 tp: TensorParallel = UNSHARDED) -> None:
        super().__init__()
        self.tp = tp
        self.head_range = tp.split(num_heads, "Kimi Delta Attention heads (linear_attn_config's num_heads)")
        self.total_width = num_heads * head_dim
        num_heads = self.head_range[1] - self.head_range[0]
        self.num_heads, self.head_dim = num_heads, head_dim
        width = num_heads * head_dim
        self.q_proj = nn.Linear(hidden_size, width, bias=False)
        self.k_proj = nn.Linear(hidden_size, width, bias=False)
        self.v_proj = nn.Linear(hidden_size, width, bias=False)
        self.conv1d = nn.Conv1d(3 * width, 3 * width, conv_kernel_size, groups=3 * width, bias=False,
                                padding=conv_kernel_size - 1)
        self.f_a_proj = nn.Linear(hidden_size, head_dim, bias=False)
        self.f_b_proj = nn.Linear(head_dim, width, bias=False)
        self.dt_bias = nn.Parameter(torch.zeros(width))
        self.A_log = nn.Parameter(torch.zeros(1, 1, num_heads, 1))
        self.b_proj = nn.Linear(hidden_size, num_heads, bias=False)
        self.g_a_proj = nn.Linear(hidden_size, head_dim, bias=False)
        self.g_b_proj = nn.Linear(head_dim, width, bias=False)
        self.o_norm = SigmoidGatedRMSNorm(head_dim, eps)
        self.o_proj = nn.Linear(width, hidden_size, bias=False)

    @property
    def input_projection(self) -> nn.Linear:
        return self.q_proj

    def shards(self) -> dict[str, Shard]:
        """Parameter name -> this rank's part of the full parameter ({} unsharded): its heads' rows, A_log's heads
        (dim 2), o_proj's columns."""
        if self.tp.size == 1:
            return {}
        start, stop = self.head_range
        k, total = self.head_dim, self.total_width
        channels = rows((k * start, k * stop))
        out = {f"{name}.weight": channels for name in ("q_proj", "k_proj", "v_proj", "f_b_proj", "g_b_proj")}
        out.update({"conv1d.weight": rows(*((part * total + k * start, part * total + k * stop)
                                            for part in range(3))),
                    "dt_bias": channels, "A_log": Shard(2, ((start, stop),)), "b_proj.weight": rows((start, stop)),
                    "o_proj.weight": columns((k * start, k * stop))})
        return out

    def state_spec(self, dtype: torch.dtype, state_dtype: torch.dtype) -> RecurrentSpec:
        """conv: the last W-1 pre-convolution inputs [3*H*K, W-1] (model dtype); ssm: S [H, K, K] (state dtype)."""
        return conv_ssm_spec(self.conv1d, (self.num_heads, self.head_dim, self.head_dim), dtype, state_dtype)

    def forget_gate(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> g [T, H, K] fp32 = -exp(A_log) * softplus(f_b_proj(f_a_proj(x)) + dt_bias)."""
        raw = module_linear(self.f_b_proj, module_linear(self.f_a_proj, x)).float() + self.dt_bias.float()
        raw = raw.view(x.shape[0], self.num_heads, self.head_dim)
        return -self.A_log.float().view(self.num_heads, 1).exp() * F.softplus(raw)

    def forward(self, hidden: torch.Tensor, step: StepContext, state: Mapping[str, torch.Tensor]) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        mixed = torch.cat([module_linear(p, hidden) for p in (self.q_proj, self.k_proj, self.v_proj)], dim=-1)
        g = self.forget_gate(hidden)
        beta = torch.sigmoid(module_linear(self.b_proj, hidden))
        core = step.core(functools.partial(self._recur, state), mixed, g, beta)
        gate = module_linear(self.g_b_proj, module_linear(self.g_a_proj, hidden))
        out = self.o_norm(core, gate.view(num_tokens, self.num_heads, self.head_dim))
        return self.tp.all_reduce(module_linear(self.o_proj, out.reshape(num_tokens, -1)))

    def _recur(self, state: Mapping[str, torch.Tensor], step: StepContext, mixed: torch.Tensor, g: torch.Tensor,
               beta: torch.Tensor) -> torch.Tensor:
        """The layer's core: the conv and the per-channel gated delta rule, each sequence from its state row."""
        backend = step.backend
        conv_out = backend.causal_conv1d(mixed, self.conv1d.weight.squeeze(1), None, state["conv"], step.batch)
        heads = (self.num_heads, self.head_dim)
        q, k, v = (t.unflatten(-1, heads) for t in conv_out.chunk(3, dim=-1))
        return backend.gated_delta_rule(q, k, v, g, beta, state["ssm"], step.batch)


class KimiMLA(nn.Module):
    """Multi-head latent attention without rotary embedding over a paged KV of latent rows, `kv_b_proj` absorbed
    (module docstring); its latent norms at `MLA_LATENT_NORM_EPS`."""

    def __init__(self, hidden_size: int, num_heads: int, mla: MLAConfig, tp: TensorParallel = UNSHARDED) -> None:
        super().__init__()
        self.tp = tp
        self.head_range = tp.split(num_heads, "attention heads (num_attention_heads)")
        num_heads = self.head_range[1] - self.head_range[0]
        self.num_heads, self.mla = num_heads, mla
        qk = mla.qk_head_dim
        if mla.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden_size, num_heads * qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden_size, mla.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, MLA_LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(mla.q_lora_rank, num_heads * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden_size, mla.latent_width, bias=False)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, MLA_LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(mla.kv_lora_rank, num_heads * (mla.qk_nope_head_dim + mla.v_head_dim), bias=False)
        self.o_proj = nn.Linear(num_heads * mla.v_head_dim, hidden_size, bias=False)
        self.kv_dtype: torch.dtype | None = None  # (FP8 KV is refused: KimiLinearForCausalLM.supports_fp8)
        self.k_scale = self.v_scale = 1.0

    @property
    def input_projection(self) -> nn.Linear:
        return self.kv_a_proj_with_mqa

    def shards(self) -> dict[str, Shard]:
        """Parameter name -> this rank's part of the full parameter ({} unsharded): its heads' query and kv_b_proj
        rows, o_proj's columns; the latent projection and norms are replicated."""
        if self.tp.size == 1:
            return {}
        (start, stop), m = self.head_range, self.mla
        query = rows((m.qk_head_dim * start, m.qk_head_dim * stop))
        up = m.qk_nope_head_dim + m.v_head_dim
        return {("q_proj.weight" if m.q_lora_rank is None else "q_b_proj.weight"): query,
                "kv_b_proj.weight": rows((up * start, up * stop)),
                "o_proj.weight": columns((m.v_head_dim * start, m.v_head_dim * stop))}

    def state_spec(self, dtype: torch.dtype, state_dtype: torch.dtype) -> AttentionSpec:
        """One kv head of `mla.cache_head_dim` lanes: a latent row's halves in its keys and values."""
        del state_dtype
        return AttentionSpec(num_kv_heads=1, head_dim=self.mla.cache_head_dim, dtype=dtype)

    def _up_projections(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [H, Dn, R] and W_UV [H, Dv, R]: views of kv_b_proj's weight."""
        m = self.mla
        weight = self.kv_b_proj.weight.view(self.num_heads, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)
        return weight[:, : m.qk_nope_head_dim], weight[:, m.qk_nope_head_dim:]

    def forward(self, hidden: torch.Tensor, step: StepContext, kv_layer: torch.Tensor) -> torch.Tensor:
        n, m, heads = hidden.shape[0], self.mla, self.num_heads
        if m.q_lora_rank is None:
            query = module_linear(self.q_proj, hidden)
        else:
            query = module_linear(self.q_b_proj, self.q_a_layernorm(module_linear(self.q_a_proj, hidden), step.backend))
        q_nope, q_shared = query.view(n, heads, m.qk_head_dim).split([m.qk_nope_head_dim, m.qk_rope_head_dim], -1)
        latent, k_shared = module_linear(self.kv_a_proj_with_mqa, hidden).split([m.kv_lora_rank, m.qk_rope_head_dim],
                                                                                dim=-1)
        latent_rows = torch.cat([self.kv_a_layernorm(latent, step.backend), k_shared], dim=-1)  # [T, E]
        attn = step.core(functools.partial(self._attend, kv_layer), q_nope, q_shared, latent_rows)  # [T, H, Dv]
        return self.tp.all_reduce(module_linear(self.o_proj, attn.reshape(n, -1)))

    def _attend(self, kv_layer: torch.Tensor, step: StepContext, q_nope: torch.Tensor, q_shared: torch.Tensor,
                latent_rows: torch.Tensor) -> torch.Tensor:
        return step.backend.mla_attention(q_nope, q_shared, latent_rows, *self._up_projections(), kv_layer,
                                          step.batch, scale=self.mla.qk_head_dim**-0.5)


class KimiExpert(nn.Module):
    """One routed expert under the checkpoints' names w1 (gate), w3 (up), w2 (down); `gate_proj`, `up_proj` and
    `down_proj` name them as `backend.moe` reads an expert."""

    def __init__(self, hidden_size: int, intermediate_size: int, tp: TensorParallel = UNSHARDED) -> None:
        super().__init__()
        self.tp = tp
        self.span = tp.split(intermediate_size, "the expert width (config.json's moe_intermediate_size)")
        intermediate_size = self.span[1] - self.span[0]
        self.w1 = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.w3 = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.w2 = nn.Linear(intermediate_size, hidden_size, bias=False)

    @property
    def gate_proj(self) -> nn.Linear:
        return self.w1

    @property
    def up_proj(self) -> nn.Linear:
        return self.w3

    @property
    def down_proj(self) -> nn.Linear:
        return self.w2

    def shards(self) -> dict[str, Shard]:
        """Parameter name -> this rank's part ({} unsharded): w1 / w3 rows and w2 columns of its intermediate."""
        return gated_mlp_shards(self.tp, self.span, "w1", "w3", "w2")


class KimiMoE(nn.Module):
    """x [N, hidden] -> sum_j w_j expert_j(x) + shared_experts(x): SiLU-gated experts routed by `GroupedTopKRouter`
    (sigmoid scores + correction bias, groups, fp32), a SiLU-gated shared expert of n_shared_experts x
    moe_intermediate_size."""

    def __init__(self, config: ModelConfig, tp: TensorParallel = UNSHARDED) -> None:
        super().__init__()
        c, mlp = config, config.mlp
        self.tp = tp
        assert mlp.grouped_routing is not None
        self.gate = GroupedTopKRouter(c.hidden_size, mlp.num_experts, mlp.num_experts_per_tok, mlp.grouped_routing,
                                      mlp.norm_topk_prob)
        self.experts = nn.ModuleList(KimiExpert(c.hidden_size, mlp.moe_intermediate_size, tp)
                                     for _ in range(mlp.num_experts))
        self.shared_experts = (MLP(c.hidden_size, mlp.shared_expert_intermediate_size, tp, reduce=False,
                                   field="moe_intermediate_size x num_shared_experts")
                               if mlp.shared_expert_intermediate_size else None)

    def forward(self, x: torch.Tensor, step: StepContext) -> torch.Tensor:
        """Under tensor parallelism the routed and shared partial sums are all-reduced once."""
        top_weights, top_ids = self.gate(x, step.backend)  # float32 weights
        routed = step.backend.moe(x, top_weights, top_ids, self.experts)
        return self.tp.all_reduce(routed if self.shared_experts is None else routed + self.shared_experts(x, step))


class KimiLinearForCausalLM(HybridCausalLM):
    supported_model_types = ("kimi_linear",)
    supports_fp8 = False

    def _layer(self, layer_id: int) -> nn.Module:
        c = self.config
        if c.layer_types[layer_id] is LayerKind.LINEAR_ATTENTION:
            d = c.gated_delta
            mixer: nn.Module = KimiDeltaAttention(c.hidden_size, num_heads=d.num_v_heads, head_dim=d.k_head_dim,
                                                  conv_kernel_size=d.conv_kernel_size, eps=c.rms_norm_eps, tp=self.tp)
        else:
            assert c.mla is not None
            mixer = KimiMLA(c.hidden_size, c.attention.num_heads, c.mla, self.tp)
        moe = c.is_moe_layer(layer_id)
        mlp = KimiMoE(c, self.tp) if moe else MLP(c.hidden_size, c.mlp.intermediate_size, self.tp)
        return DecoderLayer("self_attn", mixer, mlp, c.hidden_size, c.rms_norm_eps, norm=RMSNorm,
                            mlp_name="block_sparse_moe" if moe else "mlp")

    def _norm(self, dim: int) -> nn.Module:
        return RMSNorm(dim, self.config.rms_norm_eps)

    def drops_checkpoint_tensor(self, name: str, shape: tuple[int, ...]) -> bool:
        """With num_shared_experts 0 the MoE blocks have no shared expert; transformers' `save_pretrained` writes
        one of width 0 (its output: zeros), whose empty tensors are dropped."""
        return self.config.mlp.shared_expert_intermediate_size == 0 and ".shared_experts." in name and 0 in shape
