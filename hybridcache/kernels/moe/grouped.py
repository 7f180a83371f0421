"""Sparse MoE on CUDA without a host sync: routing, one grouped GEMM per projection over all experts
(`torch._grouped_mm`), and the sigmoid-gated shared expert. Same math as `layers.mlp.SparseMoeBlock`.

Steps for N tokens, E experts, top-k (every tensor stays on the device; nothing is read back):
    probs = softmax(router logits) in fp32; top-k weights (renormalised when norm_topk_prob)
    order = stable sort of the N*k (token, choice) pairs by expert;  counts per expert by scatter_add
    offs = cumsum(counts) (int32 group ends);  xs = x[token of each sorted pair]            [N*k, H]
    h = grouped_mm(xs, W_gate_up^T, offs) -> silu(gate) * up                                [N*k, I]
    y = grouped_mm(h, W_down^T, offs)                                                        [N*k, H]
    out[n] = sum over its k pairs of weight * y  (a batched [1, k] @ [k, H] product: fp32 accumulation, no atomics)
    out += sigmoid(x @ shared_gate^T) * shared_mlp(x)

`torch._grouped_mm` runs CUTLASS's Hopper grouped GEMM for bf16 (sm90); other dtypes take torch's
fallback, which loops over the groups after copying `offs` to the host (a sync): fp32 is the exactness
path, not the fast one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


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
        cls, gate: list[torch.Tensor], up: list[torch.Tensor], down: list[torch.Tensor]
    ) -> ExpertWeights:
        """From per-expert nn.Linear weights: gate[e], up[e] [I, H]; down[e] [H, I]."""
        gate_up = torch.stack([torch.cat([g, u], dim=0) for g, u in zip(gate, up, strict=True)])
        return cls(gate_up=gate_up.contiguous(), down=torch.stack(down).contiguous())


@dataclass(frozen=True)
class SharedExpert:
    """The dense shared expert: gate_up [2I_s, H] (gate rows then up rows), down [H, I_s], gate [1, H]."""

    gate_up: torch.Tensor
    down: torch.Tensor
    gate: torch.Tensor


def route(
    router_logits: torch.Tensor, top_k: int, norm_topk_prob: bool, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [N, E] -> (weights [N, k] in `dtype`, expert ids [N, k] int64), transformers' routing."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(dtype), ids


def grouped_experts(
    x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: ExpertWeights
) -> torch.Tensor:
    """Routed experts only: x [N, H], weights/ids [N, k] -> sum_k weights * expert_ids(x), [N, H] in x's dtype."""
    num_tokens, top_k = ids.shape
    num_experts = experts.gate_up.shape[0]
    flat_ids = ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, flat_ids, torch.ones_like(flat_ids, dtype=torch.int32))
    offs = counts.cumsum(0, dtype=torch.int32)
    xs = x.index_select(0, order // top_k)
    h = torch._grouped_mm(xs, experts.gate_up.transpose(1, 2), offs=offs)
    gate, up = h.chunk(2, dim=-1)
    y = torch._grouped_mm(F.silu(gate) * up, experts.down.transpose(1, 2), offs=offs)
    unsorted = torch.empty_like(y).index_copy_(0, order, y).view(num_tokens, top_k, -1)
    # [N, 1, k] @ [N, k, H]: the weighted sum over each token's k experts, accumulated in fp32, rounded once
    return torch.bmm(weights.to(y.dtype).unsqueeze(1), unsorted).squeeze(1)


def moe_forward(
    x: torch.Tensor,
    router_weight: torch.Tensor,
    experts: ExpertWeights,
    shared: SharedExpert | None,
    *,
    top_k: int,
    norm_topk_prob: bool,
) -> torch.Tensor:
    """x [N, H] -> [N, H]: routed experts (grouped GEMM) plus the gated shared expert when given."""
    weights, ids = route(F.linear(x, router_weight), top_k, norm_topk_prob, x.dtype)
    out = grouped_experts(x, weights, ids, experts)
    if shared is not None:
        gate, up = (x @ shared.gate_up.t()).chunk(2, dim=-1)
        out = out + torch.sigmoid(x @ shared.gate.t()) * ((F.silu(gate) * up) @ shared.down.t())
    return out
