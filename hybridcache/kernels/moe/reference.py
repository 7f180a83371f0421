"""Torch reference of the routed experts of a sparse MoE block.

Each expert e is an MLP of the block's expert activation (`EXPERT_ACTIVATIONS`):
    "silu_gated" (Qwen, Granite)  down_e(silu(gate_e(x)) * up_e(x))
    "relu2" (Nemotron-H)          down_e(relu(up_e(x))^2)          (ungated: no gate_e)
with weights gate_e, up_e [I, H] and down_e [H, I] (checkpoint layout, `nn.Linear` convention: y = x W^T).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

SILU_GATED = "silu_gated"
RELU2 = "relu2"
EXPERT_ACTIVATIONS = (SILU_GATED, RELU2)


def check_activation(activation: str) -> None:
    """ValueError naming `activation` unless it is one of `EXPERT_ACTIVATIONS`."""
    if activation not in EXPERT_ACTIVATIONS:
        raise ValueError(f"expert activation {activation!r} is not supported; one of {EXPERT_ACTIVATIONS}")


def routed_experts(
    x: torch.Tensor,
    top_weights: torch.Tensor,
    top_ids: torch.Tensor,
    gate_weights: Sequence[torch.Tensor] | None,
    up_weights: Sequence[torch.Tensor],
    down_weights: Sequence[torch.Tensor],
    activation: str = SILU_GATED,
) -> torch.Tensor:
    """Weighted sum of each token's top-k experts.

    x            [T, H]
    top_weights  [T, k]   routing weight of each pick, in x's dtype or float32
    top_ids      [T, k]   int64 expert id of each pick
    *_weights    per expert e: gate/up [I, H], down [H, I]; gate_weights None (unread) for "relu2"
    returns      [T, H]: out[t] = sum_j top_weights[t, j] * expert_{top_ids[t, j]}(x[t])

    Experts are visited in increasing id; each gathers its tokens, and `index_add_` scatters the weighted
    outputs back (one host sync: the set of picked experts). Each expert's output times its weights is rounded to
    x's dtype before the add (float32 weights: the product in float32, as transformers' NemotronH computes it).
    """
    check_activation(activation)
    out = torch.zeros_like(x)
    for expert_id in torch.unique(top_ids).tolist():
        token_ids, pick = torch.where(top_ids == expert_id)
        tokens = x[token_ids]
        up = F.linear(tokens, up_weights[expert_id])
        if activation == RELU2:
            hidden = torch.square(F.relu(up))
        else:
            hidden = F.silu(F.linear(tokens, gate_weights[expert_id])) * up
        expert_out = F.linear(hidden, down_weights[expert_id]) * top_weights[token_ids, pick, None]
        out.index_add_(0, token_ids, expert_out.to(out.dtype))
    return out


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing of Qwen3-Next / Qwen3.5-MoE (transformers' order): logits [T, E] -> probs = softmax in fp32,
    the top_k largest (descending), renormalised to sum 1 when `renormalize`; returns (weights [T, k] in logits'
    dtype, ids [T, k] int64)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    top_weights, top_ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        top_weights = top_weights / top_weights.sum(dim=-1, keepdim=True)
    return top_weights.to(logits.dtype), top_ids
