"""NVIDIA Nemotron-H (`NemotronHForCausalLM`, model_type `nemotron_h`): Mamba2, attention and MLP layers, each layer
one block (norm -> mixer -> residual add), the kind from `layers_block_type` (or `hybrid_override_pattern`: M, *, -).

Module tree (checkpoints write `backbone.` for `model.`, `embeddings` for `embed_tokens` and `norm_f` for `norm`:
the loader renames them, `loader.RENAMED_PREFIXES` / `RENAMED_NAMES`)::

    model.embed_tokens                    [vocab, hidden]
    model.layers.{i}.norm                 RMSNorm (y = round(w * x / rms(x)), in fp32, rounded once)
    model.layers.{i}.mixer                Mamba2Mixer   (layer_types[i] "mamba" / "linear_attention", "M")
                                          attention     ("attention" / "full_attention", "*"): GQA, no RoPE, no gate
                                          ReluSquaredMLP ("mlp", "-"): down_proj(relu(up_proj(x))^2)
                                          NemotronHMoE  ("moe", "E"), below
    model.norm                            RMSNorm
    lm_head                               [vocab, hidden] (the embedding itself when tied)

An MoE layer's mixer (checkpoint names; transformers' in-memory stacked `experts.up_proj` [E, I, L] and
`experts.down_proj` [E, L, I] load too, `loader._STACKED_EXPERTS`)::

    mixer.gate.weight [E, hidden], .e_score_correction_bias [E]        the router, float32 whatever the dtype
    mixer.fc1_latent_proj [L, hidden], .fc2_latent_proj [hidden, L]   only with moe_latent_size L (else L = hidden)
    mixer.experts.{e}.up_proj [I, L], .down_proj [L, I]               ungated relu^2 experts
    mixer.shared_experts.up_proj [S, hidden], .down_proj [hidden, S]  the shared expert, relu^2, ungated

    out = fc2(sum_j w_j * down_j(relu(up_j(fc1(x)))^2)) + shared_experts(x)
    (w, j) = the router's weights and picks (`config.GroupedRouting`), computed in float32 from x

A layer: h = h + mixer(norm(h)). MLP and MoE layers have no state: their spec is a `RecurrentSpec` of no tensors,
which the pools hold as an empty mapping (no slot bytes, no copies), so the engine and the prefix cache need no
change.

The residual stream stays in the model dtype (`residual_in_fp32` is read by neither transformers' NemotronH nor
here). FP8: NVIDIA ModelOpt checkpoints (per-tensor weight scales, read per channel; the selective recipe's dense
attention, Mamba and router layers stay dense, as the checkpoint holds them), compressed-tensors and fine-grained
ones, `--quantization fp8`; FP8 KV with the checkpoint's `mixer.k_proj.k_scale` / `v_proj.v_scale`. On CUDA FP8
MoE layers' relu^2 experts run on the FP8 grouped expert GEMM's relu^2 epilogue (`moe(..., activation="relu2")`),
the shared expert on two dense FP8 linears. Not supported (a ValueError says so): tensor parallelism, MTP
(`num_nextn_predict_layers`: its `mtp.` tensors are not loaded), images.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

import hybridcache.kernels.backend as kernel_backend
from hybridcache.kernels.backend import KernelBackend
from hybridcache.layers.linear import module_linear
from hybridcache.layers.norm import RMSNorm
from hybridcache.layers.step import StepContext
from hybridcache.models.config import GroupedRouting, LayerKind, ModelConfig
from hybridcache.models.granite import GraniteAttention
from hybridcache.models.mamba_hybrid import MambaHybridLM, mamba2_mixer
from hybridcache.state_spec import LayerState, RecurrentSpec


class ReluSquaredMLP(nn.Module):
    """x [N, hidden] -> down_proj(relu(up_proj(x))^2) (non-gated, `mlp_hidden_act` "relu2"); a layer's whole mixer,
    without state."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    @property
    def input_projection(self) -> nn.Linear:
        return self.up_proj

    def state_spec(self, dtype: torch.dtype, state_dtype: torch.dtype) -> RecurrentSpec:
        """No state: a spec of no tensors (the pools give the layer an empty mapping)."""
        del dtype, state_dtype
        return RecurrentSpec(tensors=())

    def forward(self, x: torch.Tensor, step: StepContext, state: LayerState) -> torch.Tensor:
        del state
        return self.mlp(x, step.backend)

    def mlp(self, x: torch.Tensor, backend: KernelBackend) -> torch.Tensor:
        """down_proj(relu(up_proj(x))^2), the activation one backend op (one launch on CUDA)."""
        return module_linear(self.down_proj, backend.relu_square(module_linear(self.up_proj, x)))


class GroupedTopKRouter(nn.Module):
    """x [N, hidden] -> (weights [N, k] float32, ids [N, k] int64), transformers' NemotronHTopkRouter
    (`config.GroupedRouting` says the rule; one group: LFM2-MoE's router, `models/lfm2.py`): the logits in fp32,
    then the backend's `route_sigmoid` (`moe/reference.route_sigmoid`, its worked example; on CUDA one Triton launch
    for one group). `weight` [E, hidden] and `e_score_correction_bias` [E] stay float32 whatever dtype the model is
    cast to (as transformers keeps them: a bf16 bias would change the picks)."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, routing: GroupedRouting,
                 norm_topk_prob: bool) -> None:
        super().__init__()
        self.top_k, self.routing, self.norm_topk_prob = top_k, routing, norm_topk_prob
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts))

    def forward(self, x: torch.Tensor, backend: KernelBackend) -> tuple[torch.Tensor, torch.Tensor]:
        r = self.routing
        logits = F.linear(x.float(), self.weight.float())
        return backend.route_sigmoid(logits, self.e_score_correction_bias.float(), self.top_k, self.norm_topk_prob,
                                     r.renorm_eps, r.scaling_factor, r.num_groups, r.topk_groups)

    def _apply(self, fn, recurse: bool = True) -> GroupedTopKRouter:  # noqa: ANN001 (nn.Module's signature)
        """Device moves and `to_empty` apply; dtype casts do not (both tensors stay float32)."""
        del recurse
        for name, param in list(self.named_parameters(recurse=False)):
            moved = fn(param.data)
            if moved.dtype != torch.float32:
                moved = moved.float() if moved.is_meta else param.data.to(device=moved.device, dtype=torch.float32)
            setattr(self, name, nn.Parameter(moved, requires_grad=param.requires_grad))
        return self


class NemotronHMoE(nn.Module):
    """An MoE layer's mixer (module docstring): x [N, hidden] -> routed relu^2 experts (inside the latent
    projections when there are any) + the shared expert; no state."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        c, mlp = config, config.mlp
        assert mlp.grouped_routing is not None
        self.gate = GroupedTopKRouter(c.hidden_size, mlp.num_experts, mlp.num_experts_per_tok, mlp.grouped_routing,
                                      mlp.norm_topk_prob)
        width = mlp.moe_latent_size or c.hidden_size
        self.experts = nn.ModuleList(ReluSquaredMLP(width, mlp.moe_intermediate_size) for _ in range(mlp.num_experts))
        self.shared_experts = ReluSquaredMLP(c.hidden_size, mlp.shared_expert_intermediate_size)
        latent = mlp.moe_latent_size is not None
        self.fc1_latent_proj = nn.Linear(c.hidden_size, width, bias=False) if latent else None
        self.fc2_latent_proj = nn.Linear(width, c.hidden_size, bias=False) if latent else None

    def state_spec(self, dtype: torch.dtype, state_dtype: torch.dtype) -> RecurrentSpec:
        """No state: a spec of no tensors (the pools give the layer an empty mapping)."""
        del dtype, state_dtype
        return RecurrentSpec(tensors=())

    def forward(self, x: torch.Tensor, step: StepContext, state: LayerState) -> torch.Tensor:
        del state
        if self.fc1_latent_proj is not None:  # the routed sum leaves through fc2: the shared output is added after it
            top_weights, top_ids = self.gate(x, step.backend)
            latent = module_linear(self.fc1_latent_proj, x)
            routed = step.backend.moe(latent, top_weights, top_ids, self.experts, activation="relu2")
            return module_linear(self.fc2_latent_proj, routed) + self.shared_experts.mlp(x, step.backend)
        # the shared expert on the side stream (CUDA) beside the routing and the routed experts, as Granite's shared
        # MLP; `moe` joins it and its combine adds it (`routed + shared`, each rounded as torch's add rounds). The
        # router's fp32 GEMM is cuBLAS, none of the dense linears' shared scratch (`kernels/streams.py`).
        shared = kernel_backend.fork(step.backend.side_stream(x.device), self.shared_experts.mlp, x, step.backend)
        top_weights, top_ids = self.gate(x, step.backend)  # float32 weights: each expert output x its weight in fp32
        return step.backend.moe(x, top_weights, top_ids, self.experts, (None, shared), activation="relu2")


class NemotronHBlock(nn.Module):
    """h + mixer(norm(h)); `forward_split` as `hybrid_lm.DecoderLayer`'s (the residual add left to the next norm)."""

    def __init__(self, mixer: nn.Module, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.norm = RMSNorm(hidden_size, eps, weight_in_fp32=True)
        self.mixer = mixer

    def forward_split(self, hidden: torch.Tensor, pending: torch.Tensor | None, step: StepContext,
                      state: LayerState) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer on hidden + pending, returned as (residual, out) whose sum is its output."""
        if pending is None:
            normed = self.norm(hidden, step.backend)
        else:
            hidden, normed = self.norm.add(hidden, pending, step.backend)
        return hidden, self.mixer(normed, step, state)


class NemotronHForCausalLM(MambaHybridLM):
    supported_model_types = ("nemotron_h",)
    supports_fp8 = True

    def _layer(self, layer_id: int) -> nn.Module:
        return NemotronHBlock(self._block_mixer(layer_id), self.config.hidden_size, self.config.rms_norm_eps)

    def _norm(self, dim: int) -> nn.Module:
        return RMSNorm(dim, self.config.rms_norm_eps, weight_in_fp32=True)

    def _block_mixer(self, layer_id: int) -> nn.Module:
        c = self.config
        kind = c.layer_types[layer_id]
        if kind is LayerKind.MAMBA2:
            return mamba2_mixer(c)
        if c.is_moe_layer(layer_id):
            return NemotronHMoE(c)
        if kind is LayerKind.MLP:
            return ReluSquaredMLP(c.hidden_size, c.mlp.intermediate_size)
        return GraniteAttention.from_config(c, bias=False, use_rope=False)
