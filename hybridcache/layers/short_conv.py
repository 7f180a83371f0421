"""LFM2's gated short convolution (`Lfm2ShortConv`): a token mixer whose only state is its conv's last K-1 inputs.

Over the whole batch (T new tokens, hidden [T, H]; the backend runs each sequence from its own state):
    B | C | x = in_proj(hidden)                  [T, H] each (column views of one GEMM's output)
    y = C * causal depthwise conv(B * x)         K taps, no activation; conv state: the last K-1 inputs B * x
    out = out_proj(y)

`bias` (config.json's `conv_bias`) puts a bias on in_proj, the conv and out_proj, as transformers does. The conv is
the backend's `causal_conv1d` with `activation=None` and `gates=(B, C)`, the op (and kernels) DeltaNet's and
Mamba2's convs run with SiLU; a CUDA decode step runs the gates inside the conv's launch.

State (`state_spec`): `conv` [num_slots, H, K-1] in the model dtype; sequence i uses row batch.state_slots[i]; a fresh
sequence (context_len == query_len) starts from zeros whatever its row holds.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import torch
from torch import nn

from hybridcache.layers.linear import module_linear
from hybridcache.layers.step import StepContext
from hybridcache.state_spec import RecurrentSpec, StateTensorSpec


class ShortConv(nn.Module):
    """Module names are the checkpoint's: `in_proj` [3H, H], `conv` (depthwise, weight [H, 1, K]), `out_proj` [H, H]."""

    def __init__(self, hidden_size: int, *, conv_kernel_size: int, bias: bool) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.in_proj = nn.Linear(hidden_size, 3 * hidden_size, bias=bias)
        self.conv = nn.Conv1d(hidden_size, hidden_size, conv_kernel_size, groups=hidden_size, bias=bias,
                              padding=conv_kernel_size - 1)
        self.out_proj = nn.Linear(hidden_size, hidden_size, bias=bias)

    @property
    def input_projection(self) -> nn.Linear:
        return self.in_proj

    def state_spec(self, dtype: torch.dtype, state_dtype: torch.dtype) -> RecurrentSpec:
        """conv: the last K-1 conv inputs B * x [H, K-1] in the model dtype (`state_dtype` is for recurrent states
        this layer does not have)."""
        del state_dtype
        return RecurrentSpec(tensors=(
            StateTensorSpec(name="conv", shape=(self.hidden_size, self.conv.kernel_size[0] - 1), dtype=dtype),))

    def forward(self, hidden: torch.Tensor, step: StepContext, state: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """hidden [T, H] -> [T, H]; state["conv"] [num_slots, H, K-1] of this layer is updated in place."""
        b, c, x = module_linear(self.in_proj, hidden).chunk(3, dim=-1)
        return module_linear(self.out_proj, step.core(functools.partial(self._conv, state), b, c, x))

    def _conv(self, state: Mapping[str, torch.Tensor], step: StepContext, b: torch.Tensor, c: torch.Tensor,
              x: torch.Tensor) -> torch.Tensor:
        """The layer's core (`StepContext.core`): b, c, x [T, H] -> c * the conv of b * x, each sequence from its
        state row [T, H] (the rows updated in place; one launch for a decode step on CUDA)."""
        return step.backend.causal_conv1d(x, self.conv.weight.squeeze(1), self.conv.bias, state["conv"], step.batch,
                                          activation=None, gates=(b, c))
