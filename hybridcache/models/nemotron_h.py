"""NVIDIA Nemotron-H (`NemotronHForCausalLM`, model_type `nemotron_h`): Mamba2, attention and MLP layers, each layer
one block (norm -> mixer -> residual add), the kind from `layers_block_type` (or `hybrid_override_pattern`: M, *, -).

Module tree (checkpoints write `backbone.` for `model.`, `embeddings` for `embed_tokens` and `norm_f` for `norm`:
the loader renames them, `loader.RENAMED_PREFIXES` / `RENAMED_NAMES`)::

    model.embed_tokens                    [vocab, hidden]
    model.layers.{i}.norm                 RMSNorm (y = round(w * x / rms(x)), in fp32, rounded once)
    model.layers.{i}.mixer                Mamba2Mixer   (layer_types[i] "mamba" / "linear_attention", "M")
                                          attention     ("attention" / "full_attention", "*"): GQA, no RoPE, no gate
                                          ReluSquaredMLP ("mlp", "-"): down_proj(relu(up_proj(x))^2)
    model.norm                            RMSNorm
    lm_head                               [vocab, hidden] (the embedding itself when tied)

A layer: h = h + mixer(norm(h)). An MLP layer has no state: its spec is a `RecurrentSpec` of no tensors, which the
pools hold as an empty mapping (no slot bytes, no copies), so the engine and the prefix cache need no change.

The residual stream stays in the model dtype (`residual_in_fp32` is read by neither transformers' NemotronH nor
here). Not supported (a ValueError says so): tensor parallelism, FP8 weights or KV, the MoE layers ("moe", "E"),
MTP (`num_nextn_predict_layers`: its `mtp.` tensors are not loaded).
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from hybridcache.kernels.backend import KernelBackend
from hybridcache.layers.linear import module_linear
from hybridcache.layers.mamba2 import Mamba2Mixer
from hybridcache.layers.parallel import UNSHARDED, TensorParallel
from hybridcache.layers.step import StepContext
from hybridcache.models.config import LayerKind, ModelConfig
from hybridcache.models.granite import GraniteAttention
from hybridcache.models.hybrid_lm import HybridCausalLM
from hybridcache.state_spec import LayerState, RecurrentSpec


class RMSNorm(nn.Module):
    """x [..., dim] -> round(weight * x / rms(x)) [..., dim], weight and product in fp32 (transformers'
    NemotronHRMSNorm: unlike Granite's, the normalised x is not rounded before the weight); `weight` starts at 1."""

    centred_on_one: ClassVar[bool] = True  # its weight scales as it is (random weights draw it around 1)

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, backend: KernelBackend | None = None) -> torch.Tensor:
        wide = x.float()
        return (self.weight.float() * wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)

    def add(self, x: torch.Tensor, residual: torch.Tensor, backend: KernelBackend | None = None,
            fp8: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + residual, this norm of it)."""
        del fp8  # (FP8 is refused for Nemotron-H)
        total = x + residual
        return total, self.forward(total)


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
        del step, state
        return module_linear(self.down_proj, torch.square(F.relu(module_linear(self.up_proj, x))))


class NemotronHBlock(nn.Module):
    """h + mixer(norm(h)); `forward_split` as `hybrid_lm.DecoderLayer`'s (the residual add left to the next norm)."""

    def __init__(self, mixer: nn.Module, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.norm = RMSNorm(hidden_size, eps)
        self.mixer = mixer

    def forward_split(self, hidden: torch.Tensor, pending: torch.Tensor | None, step: StepContext,
                      state: LayerState) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer on hidden + pending, returned as (residual, out) whose sum is its output."""
        if pending is None:
            normed = self.norm(hidden)
        else:
            hidden, normed = self.norm.add(hidden, pending)
        return hidden, self.mixer(normed, step, state)


class NemotronHForCausalLM(HybridCausalLM):
    supported_model_types = ("nemotron_h",)
    supports_fp8 = False

    def __init__(self, config: ModelConfig, tp: TensorParallel = UNSHARDED) -> None:
        if tp.size > 1:
            raise ValueError(f"{config.architecture} does not run under tensor parallelism yet (tensor_parallel_size "
                             f"{tp.size}): its Mamba2 layers are not split across ranks")
        super().__init__(config, tp)

    def _layer(self, layer_id: int) -> nn.Module:
        return NemotronHBlock(self._block_mixer(layer_id), self.config.hidden_size, self.config.rms_norm_eps)

    def _norm(self, dim: int) -> nn.Module:
        return RMSNorm(dim, self.config.rms_norm_eps)

    def _block_mixer(self, layer_id: int) -> nn.Module:
        c = self.config
        kind = c.layer_types[layer_id]
        if kind is LayerKind.MAMBA2:
            m = c.mamba2
            return Mamba2Mixer(
                c.hidden_size, num_heads=m.num_heads, head_dim=m.head_dim, num_groups=m.num_groups,
                state_size=m.state_size, conv_kernel_size=m.conv_kernel_size, conv_bias=m.conv_bias,
                proj_bias=m.proj_bias, eps=c.rms_norm_eps, time_step_limit=m.time_step_limit)
        if kind is LayerKind.MLP:
            return ReluSquaredMLP(c.hidden_size, c.mlp.intermediate_size)
        a = c.attention
        return GraniteAttention(c.hidden_size, num_heads=a.num_heads, num_kv_heads=a.num_kv_heads, head_dim=a.head_dim,
                                bias=False, scale=a.softmax_scale, use_rope=False)
