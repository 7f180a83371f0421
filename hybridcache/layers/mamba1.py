"""Mamba1 token mixer with Jamba's inner RMSNorms (transformers' `JambaMambaMixer`).

Over the whole batch (T new tokens, hidden [T, hidden]; the backend runs each sequence from its own state), with
I channels (d_inner = mamba_expand * hidden_size), state size N and dt rank R::

    x [T, I] | z [T, I]  = in_proj(hidden)                            (the first half x, the second the gate)
    x = silu(causal depthwise conv(x) + conv bias)                    conv state: last K-1 inputs per channel
    dt [T, R] | B [T, N] | C [T, N] = x_proj(x)
    dt, B, C = dt_layernorm(dt), b_layernorm(B), c_layernorm(C)       Jamba's RMSNorms (w * x / rms(x))
    dt = dt_proj.weight @ dt                                           [T, I] (its bias goes to the scan)
    y = selective_scan(x, dt, B, C, A_log, dt_proj.bias, D, z)        recurrent state [I, N] (the state dtype)
        (dt = softplus(dt + dt_proj.bias), A = -exp(A_log) [I, N], y = (S C + D x) * silu(z): `kernels/mamba1`)
    out = out_proj(y)                                                  (y rounded to the model dtype first)

State (`state_spec`): `conv` [num_slots, I, K-1] in the model dtype and `ssm` [num_slots, I, N] in the state dtype
(transformers' and mamba_ssm's layout of both); sequence i uses row batch.state_slots[i]. A sequence with
context_len == query_len starts from zero state whatever the row holds; every sequence's final states are written
back to its row.

Two sequence-structured cores (`StepContext.core`): the conv, then the scan; x_proj, the norms and dt_proj between
them are token-wise, so piecewise CUDA graphs replay them.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import torch
from torch import nn

import hybridcache.kernels.backend as kernel_backend
from hybridcache.layers.linear import module_linear
from hybridcache.layers.norm import RMSNorm
from hybridcache.layers.parallel import UNSHARDED, TensorParallel
from hybridcache.layers.step import StepContext
from hybridcache.state_spec import RecurrentSpec, conv_ssm_spec


class Mamba1Mixer(nn.Module):
    """Parameter names equal the checkpoints' (`in_proj`, `conv1d`, `x_proj`, `dt_proj`, `A_log`, `D`, `out_proj`,
    `dt_layernorm`, `b_layernorm`, `c_layernorm`). Tensor parallelism is not supported yet (`tp.size` 1 only)."""

    def __init__(
        self,
        hidden_size: int,
        *,
        intermediate_size: int,
        state_size: int,
        dt_rank: int,
        conv_kernel_size: int,
        conv_bias: bool,
        proj_bias: bool,
        eps: float,
        tp: TensorParallel = UNSHARDED,
    ) -> None:
        super().__init__()
        if tp.size > 1:
            raise ValueError(f"Mamba1 layers do not run under tensor parallelism yet (tensor_parallel_size {tp.size})")
        self.intermediate_size = intermediate_size
        self.state_size = state_size
        self.dt_rank = dt_rank
        self.in_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=proj_bias)
        self.conv1d = nn.Conv1d(intermediate_size, intermediate_size, conv_kernel_size, groups=intermediate_size,
                                bias=conv_bias, padding=conv_kernel_size - 1)
        self.x_proj = nn.Linear(intermediate_size, dt_rank + 2 * state_size, bias=False)
        self.dt_proj = nn.Linear(dt_rank, intermediate_size, bias=True)
        # S4D-real initialisation, as transformers' (the checkpoint overwrites it)
        decay_rates = torch.arange(1, state_size + 1, dtype=torch.float32)
        self.A_log = nn.Parameter(decay_rates.log().repeat(intermediate_size, 1))
        self.D = nn.Parameter(torch.ones(intermediate_size))
        self.out_proj = nn.Linear(intermediate_size, hidden_size, bias=proj_bias)
        self.dt_layernorm = RMSNorm(dt_rank, eps)
        self.b_layernorm = RMSNorm(state_size, eps)
        self.c_layernorm = RMSNorm(state_size, eps)

    @property
    def input_projection(self) -> nn.Linear:
        """The projection of the layer's input (a norm before it may pre-quantise for it: `layers.linear.Fp8Rows`)."""
        return self.in_proj

    def state_spec(self, dtype: torch.dtype, state_dtype: torch.dtype) -> RecurrentSpec:
        """conv: the last K-1 pre-convolution inputs [I, K-1] (model dtype); ssm: S [I, N] (state dtype)."""
        return conv_ssm_spec(self.conv1d, (self.intermediate_size, self.state_size), dtype, state_dtype)

    def forward(self, hidden: torch.Tensor, step: StepContext, state: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """hidden [T, hidden] -> [T, hidden]; state["conv"] [num_slots, I, K-1] and state["ssm"] [num_slots, I, N]
        of this layer are updated in place."""
        x, z = module_linear(self.in_proj, hidden).chunk(2, dim=-1)
        x = step.core(functools.partial(self._conv, state), x)  # [T, I]
        dt, B, C = module_linear(self.x_proj, x).split([self.dt_rank, self.state_size, self.state_size], dim=-1)  # noqa: N806
        backend = step.backend  # (Jamba's three RMSNorms: the backend's fused norm on CUDA)
        dt = kernel_backend.dense_linear(self.dt_layernorm(dt, backend), self.dt_proj.weight)  # [T, I], no bias
        B, C = self.b_layernorm(B, backend), self.c_layernorm(C, backend)  # noqa: N806
        y = step.core(functools.partial(self._scan, state), x, dt, B, C, z)
        return module_linear(self.out_proj, y.to(hidden.dtype))

    def _conv(self, state: Mapping[str, torch.Tensor], step: StepContext, x: torch.Tensor) -> torch.Tensor:
        """The first core (`StepContext.core`): x [T, I] -> silu(conv(x)) [T, I], each sequence from its conv row."""
        return step.backend.causal_conv1d(x, self.conv1d.weight.squeeze(1), self.conv1d.bias, state["conv"],
                                          step.batch)

    def _scan(self, state: Mapping[str, torch.Tensor], step: StepContext, x: torch.Tensor, dt: torch.Tensor,
              B: torch.Tensor, C: torch.Tensor, z: torch.Tensor) -> torch.Tensor:  # noqa: N803
        """The second core: the selective scan, each sequence from its ssm row -> y [T, I] fp32."""
        return step.backend.selective_scan(x, dt, B, C, self.A_log, self.dt_proj.bias, self.D, z, state["ssm"],
                                           step.batch)
