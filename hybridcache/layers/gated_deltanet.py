"""Gated DeltaNet token mixer of Qwen3.5 (separate input projections), Qwen3-Next (packed ones) and OLMo Hybrid
(one projection each for q, k, v, the gate, a and b; beta up to 2).

Over the whole batch (T new tokens, hidden [T, hidden]; the backend runs each sequence from its own state):
    q|k|v (pre-conv) [T, C], z [T, Hv, Dv], b, a [T, Hv]      <- input projections
    q|k|v = silu(causal depthwise conv(q|k|v))                 conv state: last K-1 inputs per channel
    beta = beta_scale * sigmoid(b);  g = -exp(A_log) * softplus(a + dt_bias)
    o = gated delta rule(q, k, v, g, beta)                     recurrent state [Hv, Dk, Dv] (fp32)
    out = out_proj(GatedRMSNorm(o, z))                         norm over Dv, per value head

`beta_scale` is 1 but for OLMo Hybrid's `allow_neg_eigval` (2: beta in (0, 2), so I - beta k k^T, with k
l2-normalised, may have the eigenvalue 1 - beta < 0). The scaling happens before the rule (`backend.delta_gates`, the
product, `backend.gated_delta_rule`), whose kernels take any beta: the reference's chunked form solves the unit
lower-triangular system (I + tril(beta K K^T, -1)), invertible whatever beta is; fla's chunked kernel solves the same
system (fla's own GatedDeltaNet layer scales beta by 2 before it, its `allow_neg_eigval`); the Triton step and verify
kernels apply the delta rule token by token. In bf16, beta = 2 sigmoid(b) rounds as transformers' (the doubling is
exact).

State (`state_spec`): `conv` [num_slots, C, K-1] in the model dtype and `ssm` [num_slots, Hv, Dk, Dv] in the
state dtype; sequence i uses row batch.state_slots[i]. A sequence with context_len == query_len starts
from zero state whatever the row holds; every sequence's final states are written back to its row.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import ClassVar

import torch
from torch import nn

from hybridcache.layers.fused import FusedProjection
from hybridcache.layers.linear import module_linear, wants_fp8_rows
from hybridcache.layers.norm import GatedRMSNorm
from hybridcache.layers.parallel import UNSHARDED, Shard, TensorParallel, columns, rows
from hybridcache.layers.step import StepContext
from hybridcache.state_spec import RecurrentSpec, conv_ssm_spec


class _GatedDeltaNetBase(nn.Module):
    """Shared parameters and forward; subclasses define the input projections and `_project`, and may rename the
    output projection and the gated norm (`out_name`, `norm_name`: their checkpoint names)."""

    out_name: ClassVar[str] = "out_proj"
    norm_name: ClassVar[str] = "norm"

    def __init__(
        self,
        hidden_size: int,
        *,
        num_k_heads: int,
        num_v_heads: int,
        k_head_dim: int,
        v_head_dim: int,
        conv_kernel_size: int,
        eps: float,
        tp: TensorParallel = UNSHARDED,
        beta_scale: float = 1.0,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.beta_scale = beta_scale
        self.split = tp.split_heads(num_v_heads, num_k_heads, "DeltaNet value heads (linear_num_value_heads)",
                                    "DeltaNet key heads (linear_num_key_heads)")
        self.total_key_dim = num_k_heads * k_head_dim  # of the full layer (the checkpoint's layout)
        num_k_heads, num_v_heads = self.split.num_groups, self.split.num_heads
        self.hidden_size = hidden_size
        self.num_k_heads = num_k_heads
        self.num_v_heads = num_v_heads
        self.k_head_dim = k_head_dim
        self.v_head_dim = v_head_dim
        self.key_dim = num_k_heads * k_head_dim
        self.value_dim = num_v_heads * v_head_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv1d = nn.Conv1d(
            self.conv_dim,
            self.conv_dim,
            conv_kernel_size,
            groups=self.conv_dim,
            bias=False,
            padding=conv_kernel_size - 1,
        )
        self.dt_bias = nn.Parameter(torch.ones(num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(num_v_heads))
        self.add_module(self.norm_name, GatedRMSNorm(v_head_dim, eps=eps))
        self.add_module(self.out_name, nn.Linear(self.value_dim, hidden_size, bias=False))

    @property
    def gated_norm(self) -> GatedRMSNorm:
        return getattr(self, self.norm_name)

    @property
    def output_projection(self) -> nn.Linear:
        return getattr(self, self.out_name)

    @property
    def input_projection(self) -> FusedProjection:
        """The projection of the layer's input, `in_proj` (a norm before it may pre-quantise for it:
        `layers.linear.Fp8Rows`)."""
        return self.in_proj

    def shards(self) -> dict[str, Shard]:
        """Parameter name -> this rank's part of the full checkpoint tensor, in the order held; unsharded, only the
        input projections a subclass keeps in another row order than the checkpoint's (`_projection_shards`)."""
        if self.tp.size == 1:
            return self._projection_shards(None)
        s, dk, dv, key_dim = self.split, self.k_head_dim, self.v_head_dim, self.total_key_dim
        qkv = rows((s.group_start * dk, s.group_stop * dk), (key_dim + s.group_start * dk, key_dim + s.group_stop * dk),
                   (2 * key_dim + s.start * dv, 2 * key_dim + s.stop * dv))
        heads = rows((s.start, s.stop))
        return {"conv1d.weight": qkv, "dt_bias": heads, "A_log": heads,
                f"{self.out_name}.weight": columns((s.start * dv, s.stop * dv)), **self._projection_shards(qkv)}

    def _projection_shards(self, qkv: Shard | None) -> dict[str, Shard]:
        """The input projections' shards; `qkv`: the rows of the q | k | v channels (None unsharded)."""
        raise NotImplementedError

    def _project(self, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """hidden [T, hidden] -> mixed_qkv [T, C] (q | k | v), z [T, Hv, Dv], b [T, Hv], a [T, Hv]."""
        raise NotImplementedError

    def state_spec(self, dtype: torch.dtype, state_dtype: torch.dtype) -> RecurrentSpec:
        """conv: the last K-1 pre-convolution inputs [C, K-1] (model dtype); ssm: S [Hv, Dk, Dv] (state dtype)."""
        return conv_ssm_spec(self.conv1d, (self.num_v_heads, self.k_head_dim, self.v_head_dim), dtype, state_dtype)

    def forward(self, hidden: torch.Tensor, step: StepContext, state: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """hidden [T, hidden] -> [T, hidden]; state["conv"] [num_slots, C, K-1] and
        state["ssm"] [num_slots, Hv, Dk, Dv] of this layer are updated in place."""
        mixed_qkv, z, b, a = self._project(hidden)
        core = step.core(functools.partial(self._recur, state), mixed_qkv, a, b)
        out_proj = self.output_projection
        fp8 = wants_fp8_rows(out_proj, core)  # the norm quantises for an FP8 out_proj (Fp8Rows [T, value_dim])
        core = self.gated_norm(core, z, step.backend, fp8=fp8)
        core = core if fp8 else core.reshape(hidden.shape[0], self.value_dim)
        return self.tp.all_reduce(module_linear(out_proj, core))

    def _recur(self, state: Mapping[str, torch.Tensor], step: StepContext, mixed_qkv: torch.Tensor, a: torch.Tensor,
               b: torch.Tensor) -> torch.Tensor:
        """The layer's core (`StepContext.core`): mixed_qkv [T, C], a, b [T, Hv] -> o [T, Hv, Dv] (the conv, the
        gates and the gated delta rule, each sequence from its state row, the rows updated in place). With a
        `beta_scale` the ops one at a time, beta scaled between the gates and the rule (module docstring)."""
        backend, weight = step.backend, self.conv1d.weight.squeeze(1)
        if self.beta_scale == 1.0:  # the conv, its output split into q | k | v, the gates and the rule: one op
            return backend.conv_gated_delta(mixed_qkv, weight, self.conv1d.bias, state["conv"], a, b, self.A_log,
                                            self.dt_bias, state["ssm"], step.batch, num_k_heads=self.num_k_heads)
        conv_out = backend.causal_conv1d(mixed_qkv, weight, self.conv1d.bias, state["conv"], step.batch)
        q, k, v = conv_out.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        heads = (self.num_k_heads, self.k_head_dim)
        g, beta = backend.delta_gates(a, b, self.A_log, self.dt_bias)
        return backend.gated_delta_rule(q.unflatten(-1, heads), k.unflatten(-1, heads),
                                        v.unflatten(-1, (self.num_v_heads, self.v_head_dim)), g,
                                        beta * self.beta_scale, state["ssm"], step.batch)


class GatedDeltaNet(_GatedDeltaNetBase):
    """Qwen3.5 / Qwen3.5-MoE: separate `in_proj_qkv` [C, hidden], `in_proj_z` [Hv*Dv, hidden],
    `in_proj_b` and `in_proj_a` [Hv, hidden]."""

    def __init__(self, hidden_size: int, **kwargs: int | float | TensorParallel) -> None:
        super().__init__(hidden_size, **kwargs)
        self.in_proj_qkv = nn.Linear(hidden_size, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(hidden_size, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(hidden_size, self.num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(hidden_size, self.num_v_heads, bias=False)
        self.in_proj = FusedProjection(self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a)

    def _projection_shards(self, qkv: Shard | None) -> dict[str, Shard]:
        if qkv is None:  # unsharded: read in the checkpoint's order
            return {}
        s, dv = self.split, self.v_head_dim
        heads = rows((s.start, s.stop))
        return {"in_proj_qkv.weight": qkv, "in_proj_z.weight": rows((s.start * dv, s.stop * dv)),
                "in_proj_b.weight": heads, "in_proj_a.weight": heads}

    def _project(self, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
        mixed_qkv, z, b, a = self.in_proj(hidden)
        return mixed_qkv, z.view(-1, self.num_v_heads, self.v_head_dim), b, a


class PackedGatedDeltaNet(_GatedDeltaNetBase):
    """Qwen3-Next: packed `in_proj_qkvz` [2*Hk*Dk + 2*Hv*Dv, hidden] and `in_proj_ba` [2*Hv, hidden], which the
    checkpoint groups per key head j (r = Hv / Hk value heads each; r = 2 shown)::

        in_proj_qkvz rows: | q_j (Dk) | k_j (Dk) | v_{2j} v_{2j+1} (2*Dv) | z_{2j} z_{2j+1} (2*Dv) |  j = 0 .. Hk-1
        in_proj_ba rows:   | b_{2j} b_{2j+1} | a_{2j} a_{2j+1} |                                       j = 0 .. Hk-1

    The loader reads those rows in another order (`shards`, also unsharded): in_proj_qkvz holds q (every key
    head) | k | v (every value head) | z, in_proj_ba holds b | a, so one projection's output columns are
    q | k | v | z | b | a and the conv input q | k | v, z, b and a are views of it (ungrouping the checkpoint's
    order per step took seven copies per layer). `state_dict()` therefore holds these two in that order. An FP8
    weight's scale rows follow its rows (`loader.checkpoint_shards`)."""

    def __init__(self, hidden_size: int, **kwargs: int | float | TensorParallel) -> None:
        super().__init__(hidden_size, **kwargs)
        self.in_proj_qkvz = nn.Linear(hidden_size, 2 * self.key_dim + 2 * self.value_dim, bias=False)
        self.in_proj_ba = nn.Linear(hidden_size, 2 * self.num_v_heads, bias=False)
        self.in_proj = FusedProjection(self.in_proj_qkvz, self.in_proj_ba)

    def _projection_shards(self, qkv: Shard | None) -> dict[str, Shard]:
        """The checkpoint rows of the rank's key heads j (q_j, then k_j) and value heads (v, then z; all r of a
        group when key heads are split, a slice of them when key heads are replicated), ungrouped: every q row
        first, then every k, v and z row; in_proj_ba likewise, b rows then a rows. Unsharded, every head."""
        del qkv  # the rows are found per head here
        s, dk, dv, ratio = self.split, self.k_head_dim, self.v_head_dim, self.split.heads_per_group
        group = 2 * dk + 2 * ratio * dv
        q, k, v, z, b, a = [], [], [], [], [], []
        for j in range(s.group_start, s.group_stop):
            first, last = max(s.start, j * ratio) - j * ratio, min(s.stop, (j + 1) * ratio) - j * ratio
            base, ba_base = j * group, j * 2 * ratio
            q.append((base, base + dk))
            k.append((base + dk, base + 2 * dk))
            v.append((base + 2 * dk + first * dv, base + 2 * dk + last * dv))
            z.append((base + 2 * dk + (ratio + first) * dv, base + 2 * dk + (ratio + last) * dv))
            b.append((ba_base + first, ba_base + last))
            a.append((ba_base + ratio + first, ba_base + ratio + last))
        return {"in_proj_qkvz.weight": rows(*q, *k, *v, *z), "in_proj_ba.weight": rows(*b, *a)}

    def _project(self, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
        qkvz, ba = self.in_proj(hidden)
        mixed_qkv, z = qkvz.split([self.conv_dim, self.value_dim], dim=-1)
        b, a = ba.split([self.num_v_heads, self.num_v_heads], dim=-1)
        return mixed_qkv, z.view(-1, self.num_v_heads, self.v_head_dim), b, a


class SeparateGatedDeltaNet(_GatedDeltaNetBase):
    """OLMo Hybrid: one projection each, `q_proj`, `k_proj` [Hk*Dk, hidden], `v_proj`, `g_proj` [Hv*Dv, hidden] (g:
    the norm's gate, Qwen's z), `b_proj`, `a_proj` [Hv, hidden]; the output projection `o_proj`, the gated norm
    `o_norm`; beta scaled by `beta_scale` (2 with `linear_allow_neg_eigval`). The checkpoints hold the conv as
    `q_conv1d`, `k_conv1d`, `v_conv1d`, which the loader concatenates into `conv1d` (transformers does too)."""

    out_name = "o_proj"
    norm_name = "o_norm"

    def __init__(self, hidden_size: int, **kwargs: int | float | TensorParallel) -> None:
        super().__init__(hidden_size, **kwargs)
        self.q_proj = nn.Linear(hidden_size, self.key_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, self.key_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, self.value_dim, bias=False)
        self.g_proj = nn.Linear(hidden_size, self.value_dim, bias=False)
        self.b_proj = nn.Linear(hidden_size, self.num_v_heads, bias=False)
        self.a_proj = nn.Linear(hidden_size, self.num_v_heads, bias=False)
        # one GEMM; its q | k | v columns one view (the conv input, no copy)
        self.in_proj = FusedProjection(self.q_proj, self.k_proj, self.v_proj, self.g_proj, self.b_proj, self.a_proj,
                                       groups=(3, 1, 1, 1))

    def _projection_shards(self, qkv: Shard | None) -> dict[str, Shard]:
        if qkv is not None:  # (OlmoHybridForCausalLM refuses tensor parallelism before it builds a layer)
            raise ValueError("OLMo Hybrid's DeltaNet layers are not split across ranks")
        return {}  # unsharded: read in the checkpoint's order

    def _project(self, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
        mixed_qkv, gate, b, a = self.in_proj(hidden)
        return mixed_qkv, gate.view(-1, self.num_v_heads, self.v_head_dim), b, a
