"""Mamba2 token mixer (the SSD layer of Granite-4.0-H, Bamba, Nemotron-H, Falcon-H1).

Over the whole batch (T new tokens, hidden [T, hidden]; the backend runs each sequence from its own state), with
I = Hm * Pm channels (Hm heads of Pm), G groups and state size N::

    z [T, I] | xBC [T, C] | dt [T, Hm]  = in_proj(hidden)           C = I + 2 G N
    xBC = silu(causal depthwise conv(xBC) + conv bias)              conv state: last K-1 inputs per channel
    x [T, Hm, Pm] | B [T, G, N] | C [T, G, N] = xBC
    y = ssd_scan(x, dt, B, C, A_log, dt_bias, D)                    recurrent state [Hm, Pm, N] (the state dtype)
        (dt = clamp(softplus(dt + dt_bias), time_step_limit), A = -exp(A_log), y = S C + D x: `kernels/mamba2`)
    out = out_proj(weight * group_rms_norm(y * silu(z)))             the gate before the norm, G norm groups

Falcon-H1's variant (its `FalconH1Mixer`), by constructor arguments: `in_multipliers` scale z | x | B | C | dt after
in_proj (its muP vector, `ssm_multipliers`), folded into in_proj's rows at load (`fold_multipliers_`);
`norm_before_gate` takes the norm first, weight * group_rms_norm(y) * silu(z); `rms_norm` False has no norm at all,
out = out_proj(y * silu(z)); `out_proj_bias` (its `projectors_bias`) differs from in_proj's.

State (`state_spec`): `conv` [num_slots, C, K-1] in the model dtype and `ssm` [num_slots, Hm, Pm, N] in the state
dtype (transformers' and mamba_ssm's layout of both); sequence i uses row batch.state_slots[i]. A sequence with
context_len == query_len starts from zero state whatever the row holds; every sequence's final states are written
back to its row.

The time_step_limit clamp applies to prefill and decode alike (transformers' torch decode path leaves it out, so the
two agree only with the default limits (0, inf), which every published Granite-4.0-H and Nemotron-H config keeps).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import ClassVar

import torch
from torch import nn

from hybridcache.layers.linear import module_linear, scale_linear_
from hybridcache.layers.parallel import UNSHARDED, TensorParallel
from hybridcache.layers.step import StepContext
from hybridcache.state_spec import RecurrentSpec, conv_ssm_spec


class GroupGatedRMSNorm(nn.Module):
    """Mamba2's gated RMSNorm: x, gate [T, I] -> weight * group_rms_norm(x * silu(gate)) [T, I] in gate's dtype, or
    with `norm_before_gate` weight * group_rms_norm(x) * silu(gate) (`backend.gated_group_rms_norm`), the norm over
    each group of `group_size` channels; `weight` initialised to 1."""

    centred_on_one: ClassVar[bool] = True  # its weight scales as it is (random weights draw it around 1)

    def __init__(self, dim: int, group_size: int, eps: float, norm_before_gate: bool = False) -> None:
        super().__init__()
        self.group_size = group_size
        self.eps = eps
        self.norm_before_gate = norm_before_gate
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor, step: StepContext) -> torch.Tensor:
        return step.backend.gated_group_rms_norm(x, gate, self.weight, self.eps, self.group_size,
                                                 norm_before_gate=self.norm_before_gate)


class Mamba2Mixer(nn.Module):
    """Parameter names equal the checkpoints' (`in_proj`, `conv1d`, `dt_bias`, `A_log`, `D`, `norm.weight` unless
    `rms_norm` is False, `out_proj`). Tensor parallelism is not supported yet (`tp.size` 1 only). `in_multipliers`:
    the five scales of z, x, B, C, dt after in_proj (None: none), folded into in_proj's rows once its weights are
    loaded (`fold_multipliers_`); `out_proj_bias` None: `proj_bias`."""

    def __init__(
        self,
        hidden_size: int,
        *,
        num_heads: int,
        head_dim: int,
        num_groups: int,
        state_size: int,
        conv_kernel_size: int,
        conv_bias: bool,
        proj_bias: bool,
        eps: float,
        time_step_limit: tuple[float, float] = (0.0, float("inf")),
        rms_norm: bool = True,
        norm_before_gate: bool = False,
        out_proj_bias: bool | None = None,
        in_multipliers: tuple[float, float, float, float, float] | None = None,
        tp: TensorParallel = UNSHARDED,
    ) -> None:
        super().__init__()
        if tp.size > 1:
            raise ValueError(f"Mamba2 layers do not run under tensor parallelism yet (tensor_parallel_size {tp.size})")
        if num_heads % num_groups:
            raise ValueError(f"{num_heads} Mamba2 heads (mamba_n_heads) / {num_groups} groups (mamba_n_groups)")
        self.tp = tp
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_groups = num_groups
        self.state_size = state_size
        self.intermediate_size = num_heads * head_dim
        self.conv_dim = self.intermediate_size + 2 * num_groups * state_size
        self.time_step_limit = time_step_limit
        if in_multipliers is not None and len(in_multipliers) != 5:
            raise ValueError(f"Mamba2 in_multipliers {in_multipliers} must be five: z, x, B, C, dt")
        self.in_multipliers = None if in_multipliers is None or set(in_multipliers) == {1.0} else in_multipliers
        self.in_proj = nn.Linear(hidden_size, self.intermediate_size + self.conv_dim + num_heads, bias=proj_bias)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, conv_kernel_size, groups=self.conv_dim, bias=conv_bias,
                                padding=conv_kernel_size - 1)
        self.dt_bias = nn.Parameter(torch.ones(num_heads))
        self.A_log = nn.Parameter(torch.zeros(num_heads))
        self.D = nn.Parameter(torch.ones(num_heads))
        self.norm = GroupGatedRMSNorm(self.intermediate_size, self.intermediate_size // num_groups, eps,
                                      norm_before_gate) if rms_norm else None
        self.out_proj = nn.Linear(self.intermediate_size, hidden_size,
                                  bias=proj_bias if out_proj_bias is None else out_proj_bias)

    @property
    def input_projection(self) -> nn.Linear:
        """The projection of the layer's input (a norm before it may pre-quantise for it: `layers.linear.Fp8Rows`)."""
        return self.in_proj

    def state_spec(self, dtype: torch.dtype, state_dtype: torch.dtype) -> RecurrentSpec:
        """conv: the last K-1 pre-convolution inputs [C, K-1] (model dtype); ssm: S [Hm, Pm, N] (state dtype)."""
        return conv_ssm_spec(self.conv1d, (self.num_heads, self.head_dim, self.state_size), dtype, state_dtype)

    def forward(self, hidden: torch.Tensor, step: StepContext, state: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """hidden [T, hidden] -> [T, hidden]; state["conv"] [num_slots, C, K-1] and state["ssm"]
        [num_slots, Hm, Pm, N] of this layer are updated in place."""
        projected = module_linear(self.in_proj, hidden)
        z, xbc, dt = projected.split([self.intermediate_size, self.conv_dim, self.num_heads], dim=-1)
        y = step.core(functools.partial(self._recur, state), xbc, dt)  # [T, Hm, Pm] fp32
        y = y.view(hidden.shape[0], self.intermediate_size)
        y = step.backend.silu_mul(z, y) if self.norm is None else self.norm(y, z, step)  # (no norm: Falcon-H1's)
        return module_linear(self.out_proj, y)

    def fold_multipliers_(self, input_scale: float = 1.0) -> None:
        """Make in_proj compute in_multipliers * in_proj(input_scale * x) (Falcon-H1's muP: the layer input's
        `ssm_in_multiplier`, then z, x, B, C and dt each times its scalar, transformers' `mup_vector`): each weight
        row times input_scale and its range's multiplier, each bias entry times its range's. Once, after the weights
        are loaded (the model's `after_loading_`); the forward applies no multiplier."""
        group_dim = self.num_groups * self.state_size
        widths = (self.intermediate_size, self.intermediate_size, group_dim, group_dim, self.num_heads)
        rows = torch.cat([torch.full((width,), float(multiplier))
                          for width, multiplier in zip(widths, self.in_multipliers or (1.0,) * 5, strict=True)])
        scale_linear_(self.in_proj, rows * input_scale, rows)

    def _recur(self, state: Mapping[str, torch.Tensor], step: StepContext, xbc: torch.Tensor,
               dt: torch.Tensor) -> torch.Tensor:
        """The layer's core (`StepContext.core`): xbc [T, C], dt [T, Hm] -> y [T, Hm, Pm] fp32 (the conv and the
        scan, each sequence from its state rows, the rows updated in place)."""
        num_tokens = xbc.shape[0]
        xbc = step.backend.causal_conv1d(xbc, self.conv1d.weight.squeeze(1), self.conv1d.bias, state["conv"],
                                         step.batch)
        group_dim = self.num_groups * self.state_size
        x, B, C = xbc.split([self.intermediate_size, group_dim, group_dim], dim=-1)  # noqa: N806
        return step.backend.ssd_scan(
            x.reshape(num_tokens, self.num_heads, self.head_dim), dt,
            B.reshape(num_tokens, self.num_groups, self.state_size),
            C.reshape(num_tokens, self.num_groups, self.state_size),
            self.A_log, self.dt_bias, self.D, state["ssm"], step.batch, dt_limit=self.time_step_limit)
