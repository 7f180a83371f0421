"""What the Mamba2 hybrids (Granite-4.0-H: `granite.py`, Nemotron-H: `nemotron_h.py`) share: their RMSNorm (centred on
1, as transformers' for both), their Mamba2 mixer built from `ModelConfig.mamba2`, and a model base that runs on one
rank (a ValueError says so), without FP8 unless a model declares it (`supports_fp8`: Granite-4.0-H, Nemotron-H)."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from hybridcache.kernels.backend import KernelBackend
from hybridcache.layers.mamba2 import Mamba2Mixer
from hybridcache.layers.parallel import UNSHARDED, TensorParallel
from hybridcache.models.config import ModelConfig
from hybridcache.models.hybrid_lm import HybridCausalLM


class RMSNorm(nn.Module):
    """x [..., dim] -> weight * x / rms(x) [..., dim] in x's dtype, normalised in fp32 (`weight` starts at 1). Where it
    rounds is transformers' of each model: Granite's rounds x / rms(x) to x's dtype, then multiplies by the weight;
    Nemotron-H's (`weight_in_fp32`) multiplies in fp32, then rounds."""

    centred_on_one: ClassVar[bool] = True  # its weight scales as it is (random weights draw it around 1)

    def __init__(self, dim: int, eps: float, weight_in_fp32: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.weight_in_fp32 = weight_in_fp32
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, backend: KernelBackend | None = None) -> torch.Tensor:
        wide = x.float()
        normed = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.weight_in_fp32:
            return (self.weight.float() * normed).to(x.dtype)
        return self.weight * normed.to(x.dtype)

    def add(self, x: torch.Tensor, residual: torch.Tensor, backend: KernelBackend | None = None,
            fp8: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + residual, this norm of it)."""
        del fp8  # (not asked here: an FP8 linear after this norm quantises its own input)
        total = x + residual
        return total, self.forward(total)


def mamba2_mixer(config: ModelConfig) -> Mamba2Mixer:
    """A Mamba2 layer of `config` (its `mamba2` group; the gated norm's eps is the model's)."""
    m = config.mamba2
    assert m is not None
    return Mamba2Mixer(config.hidden_size, num_heads=m.num_heads, head_dim=m.head_dim, num_groups=m.num_groups,
                       state_size=m.state_size, conv_kernel_size=m.conv_kernel_size, conv_bias=m.conv_bias,
                       proj_bias=m.proj_bias, eps=config.rms_norm_eps, time_step_limit=m.time_step_limit,
                       rms_norm=m.rms_norm, norm_before_gate=m.norm_before_gate, out_proj_bias=m.out_proj_bias,
                       in_multipliers=m.in_multipliers)


class Mamba2HybridLM(HybridCausalLM):
    """A hybrid of Mamba2 layers: one rank only (its Mamba2 layers are not split across ranks), no FP8 unless the
    model class sets `supports_fp8`."""

    supports_fp8 = False

    def __init__(self, config: ModelConfig, tp: TensorParallel = UNSHARDED) -> None:
        if tp.size > 1:
            raise ValueError(f"{config.architecture} does not run under tensor parallelism yet (tensor_parallel_size "
                             f"{tp.size}): its Mamba2 layers are not split across ranks")
        super().__init__(config, tp)
