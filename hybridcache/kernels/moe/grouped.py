"""Routed experts of a sparse MoE block on CUDA without a host sync: one grouped GEMM per projection over
all experts (`torch._grouped_mm`). Same contract as `moe/reference.py::routed_experts` (the layer routes and
adds the shared expert).

Steps for T tokens, E experts, top-k (every tensor stays on the device; nothing is read back):
    order = stable sort of the T*k (token, pick) pairs by expert (int16 keys);  counts per expert by scatter_add
    offs = cumsum(counts) (int32 group ends);  xs = x[token of each sorted pair]            [T*k, H]
    h = grouped_mm(xs, W_gate_up^T, offs) -> silu(gate) * up                                [T*k, I]
    y = grouped_mm(h, W_down^T, offs)                                                        [T*k, H]
    out[t] = sum over its k picks of weight * y  (a batched [1, k] @ [k, H] product: fp32 accumulation)

`torch._grouped_mm` runs CUTLASS's Hopper grouped GEMM for bf16 (sm90); other dtypes take torch's
fallback, which loops over the groups after copying `offs` to the host (a sync): fp32 is the exactness
path, not the fast one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class ExpertWeights:
    """Expert weights stacked for the grouped GEMM.

    gate_up [E, 2I, H]: rows [0, I) of expert e are gate_proj.weight, rows [I, 2I) up_proj.weight
    down    [E, H, I]: down_proj.weight
    """

    gate_up: torch.Tensor
    down: torch.Tensor

    @classmethod
    def stack(
        cls, gate: Sequence[torch.Tensor], up: Sequence[torch.Tensor], down: Sequence[torch.Tensor]
    ) -> ExpertWeights:
        """From per-expert nn.Linear weights: gate[e], up[e] [I, H]; down[e] [H, I] (copies)."""
        gate_up = torch.stack([torch.cat([g, u], dim=0) for g, u in zip(gate, up, strict=True)])
        return cls(gate_up=gate_up.contiguous(), down=torch.stack(list(down)).contiguous())

    @classmethod
    @torch.no_grad()
    def share(cls, experts: Sequence[nn.Module]) -> ExpertWeights:
        """Stack the experts' weights and re-point each expert's parameters at its slices of the stack, so
        the modules and the grouped GEMM share one copy of the weights (no doubled memory)."""
        stacked = cls.stack([e.gate_proj.weight for e in experts], [e.up_proj.weight for e in experts],
                            [e.down_proj.weight for e in experts])
        inter = stacked.gate_up.shape[1] // 2
        for e, expert in enumerate(experts):
            expert.gate_proj.weight.data = stacked.gate_up[e, :inter]
            expert.up_proj.weight.data = stacked.gate_up[e, inter:]
            expert.down_proj.weight.data = stacked.down[e]
        return stacked


def grouped_experts(
    x: torch.Tensor, top_weights: torch.Tensor, top_ids: torch.Tensor, experts: ExpertWeights
) -> torch.Tensor:
    """x [T, H], top_weights [T, k] (x's dtype), top_ids [T, k] int64 -> [T, H] in x's dtype:
    out[t] = sum_j top_weights[t, j] * expert_{top_ids[t, j]}(x[t])."""
    num_tokens, top_k = top_ids.shape
    num_experts = experts.gate_up.shape[0]
    if num_experts > torch.iinfo(torch.int16).max:
        raise ValueError(f"{num_experts} experts: the grouped MoE sorts expert ids as int16 (at most 32,767)")
    flat_ids = top_ids.reshape(-1)
    # int16 keys (E <= 32,767): the radix sort makes 4x fewer passes than over int64 (~26 -> ~7 us at T*k = 256)
    order = torch.argsort(flat_ids.to(torch.int16), stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, flat_ids, torch.ones_like(flat_ids, dtype=torch.int32))
    offs = counts.cumsum(0, dtype=torch.int32)
    xs = x.index_select(0, order // top_k)
    h = torch._grouped_mm(xs, experts.gate_up.transpose(1, 2), offs=offs)
    gate, up = h.chunk(2, dim=-1)
    y = torch._grouped_mm(F.silu(gate) * up, experts.down.transpose(1, 2), offs=offs)
    unsorted = torch.empty_like(y).index_copy_(0, order, y).view(num_tokens, top_k, -1)
    # [T, 1, k] @ [T, k, H]: the weighted sum over each token's k experts, accumulated in fp32, rounded once
    return torch.bmm(top_weights.to(y.dtype).unsqueeze(1), unsorted).squeeze(1)
