"""What the Mamba hybrids (Granite-4.0-H: `granite.py`, Nemotron-H: `nemotron_h.py`, Bamba: `bamba.py`, Falcon-H1:
`falcon_h1.py`, Jamba: `jamba.py`) share: the Mamba2 mixer built from `ModelConfig.mamba2`, and a model base that runs
on one rank (a ValueError says so: `single_rank_reason`), without FP8 unless a model declares it (`supports_fp8`:
Granite-4.0-H, Nemotron-H). (Their RMSNorm, centred on 1 as transformers' for all of them: `layers.norm.RMSNorm`.)"""

from __future__ import annotations

from torch import nn

from hybridcache.layers.mamba2 import Mamba2Mixer
from hybridcache.layers.norm import RMSNorm
from hybridcache.models.config import ModelConfig
from hybridcache.models.hybrid_lm import HybridCausalLM


def mamba2_mixer(config: ModelConfig) -> Mamba2Mixer:
    """A Mamba2 layer of `config` (its `mamba2` group; the gated norm's eps is the model's)."""
    m = config.mamba2
    assert m is not None
    return Mamba2Mixer(config.hidden_size, num_heads=m.num_heads, head_dim=m.head_dim, num_groups=m.num_groups,
                       state_size=m.state_size, conv_kernel_size=m.conv_kernel_size, conv_bias=m.conv_bias,
                       proj_bias=m.proj_bias, eps=config.rms_norm_eps, time_step_limit=m.time_step_limit,
                       rms_norm=m.rms_norm, norm_before_gate=m.norm_before_gate, out_proj_bias=m.out_proj_bias,
                       in_multipliers=m.in_multipliers)


class MambaHybridLM(HybridCausalLM):
    """A hybrid of Mamba layers (Mamba2 or Jamba's Mamba1): one rank only (its Mamba layers are not split across
    ranks), no FP8 unless the model class sets `supports_fp8`."""

    supports_fp8 = False
    single_rank_reason = "its Mamba layers are not split across ranks"

    def _norm(self, dim: int) -> nn.Module:
        """The final norm: `layers.norm.RMSNorm` (centred on 1)."""
        return RMSNorm(dim, self.config.rms_norm_eps)
