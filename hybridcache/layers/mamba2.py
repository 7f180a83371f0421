"""Mamba2 token mixer (the SSD layer of Granite-4.0-H, Bamba, Nemotron-H, Falcon-H1).

Over the whole batch (T new tokens, hidden [T, hidden]; the backend runs each sequence from its own state), with
I = Hm * Pm channels (Hm heads of Pm), G groups and state size N::

    z [T, I] | xBC [T, C] | dt [T, Hm]  = in_proj(hidden)           C = I + 2 G N
    xBC = silu(causal depthwise conv(xBC) + conv bias)              conv state: last K-1 inputs per channel
    x [T, Hm, Pm] | B [T, G, N] | C [T, G, N] = xBC
    y = ssd_scan(x, dt, B, C, A_log, dt_bias, D)                    recurrent state [Hm, Pm, N] (the state dtype)
        (dt = clamp(softplus(dt + dt_bias), time_step_limit), A = -exp(A_log), y = S C + D x: `kernels/mamba2`)
    out = out_proj(weight * group_rms_norm(y * silu(z)))             the gate before the norm, G norm groups

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

from hybridcache.layers.linear import module_linear
from hybridcache.layers.parallel import UNSHARDED, TensorParallel
from hybridcache.layers.step import StepContext
from hybridcache.state_spec import RecurrentSpec, StateTensorSpec


class GroupGatedRMSNorm(nn.Module):
    """Mamba2's gated RMSNorm: x, gate [T, I] -> weight * group_rms_norm(x * silu(gate)) [T, I] in gate's dtype
    (`backend.gated_group_rms_norm`), the norm over each group of `group_size` channels; `weight` initialised to 1."""

    centred_on_one: ClassVar[bool] = True  # its weight scales as it is (random weights draw it around 1)

    def __init__(self, dim: int, group_size: int, eps: float) -> None:
        super().__init__()
        self.group_size = group_size
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor, step: StepContext) -> torch.Tensor:
        return step.backend.gated_group_rms_norm(x, gate, self.weight, self.eps, self.group_size)


class Mamba2Mixer(nn.Module):
    """Parameter names equal the checkpoints' (`in_proj`, `conv1d`, `dt_bias`, `A_log`, `D`, `norm.weight`,
    `out_proj`). Tensor parallelism is not supported yet (`tp.size` 1 only)."""

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
        self.in_proj = nn.Linear(hidden_size, self.intermediate_size + self.conv_dim + num_heads, bias=proj_bias)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, conv_kernel_size, groups=self.conv_dim, bias=conv_bias,
                                padding=conv_kernel_size - 1)
        self.dt_bias = nn.Parameter(torch.ones(num_heads))
        self.A_log = nn.Parameter(torch.zeros(num_heads))
        self.D = nn.Parameter(torch.ones(num_heads))
        self.norm = GroupGatedRMSNorm(self.intermediate_size, self.intermediate_size // num_groups, eps)
        self.out_proj = nn.Linear(self.intermediate_size, hidden_size, bias=proj_bias)

    @property
    def input_projection(self) -> nn.Linear:
        """The projection of the layer's input (a norm before it may pre-quantise for it: `layers.linear.Fp8Rows`)."""
        return self.in_proj

    def state_spec(self, dtype: torch.dtype, state_dtype: torch.dtype) -> RecurrentSpec:
        """conv: the last K-1 pre-convolution inputs [C, K-1] (model dtype); ssm: S [Hm, Pm, N] (state dtype)."""
        conv_width = self.conv1d.kernel_size[0] - 1
        return RecurrentSpec(
            tensors=(
                StateTensorSpec(name="conv", shape=(self.conv_dim, conv_width), dtype=dtype),
                StateTensorSpec(name="ssm", shape=(self.num_heads, self.head_dim, self.state_size), dtype=state_dtype),
            )
        )

    def forward(self, hidden: torch.Tensor, step: StepContext, state: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """hidden [T, hidden] -> [T, hidden]; state["conv"] [num_slots, C, K-1] and state["ssm"]
        [num_slots, Hm, Pm, N] of this layer are updated in place."""
        z, xbc, dt = module_linear(self.in_proj, hidden).split(
            [self.intermediate_size, self.conv_dim, self.num_heads], dim=-1)
        y = step.core(functools.partial(self._recur, state), xbc, dt)  # [T, Hm, Pm] fp32
        y = self.norm(y.view(hidden.shape[0], self.intermediate_size), z, step)
        return module_linear(self.out_proj, y)

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
