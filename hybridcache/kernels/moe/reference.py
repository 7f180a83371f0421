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


def route_sigmoid(logits: torch.Tensor, bias: torch.Tensor, top_k: int, renormalize: bool, eps: float,
                  scale: float, num_groups: int = 1, topk_groups: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid routing with a correction bias (DeepSeek-V3's "noaux_tc": Nemotron-H's, Kimi Linear's, LFM2-MoE's
    routers, transformers' order), all in fp32: logits [T, E], bias [E] -> scores = sigmoid(logits); the choice
    ranks scores + bias, within the `topk_groups` best of `num_groups` groups of E / num_groups experts (a group
    ranks by the sum of its two best choices; one group keeps every expert); the top_k chosen (in torch.topk's
    unsorted order); weights the picks' scores, divided by their sum + eps when `renormalize`, times `scale`.
    Returns (weights [T, k] fp32, ids [T, k] int64).

    Worked example, E = 8 experts in 4 groups, topk_groups 2, k = 2: choice scores (.9 .1 | .85 .05 | .8 .7 | .2 .3)
    rank the groups by the sum of their two best, 1.0 .9 1.5 .5, so groups 2 and 0 are kept and experts 0 and 4
    (.9, .8) picked: expert 2 (.85) is in a dropped group."""
    scores = logits.float().sigmoid()
    choice = scores + bias.float()
    if num_groups > 1:  # (one group keeps every expert)
        grouped = choice.view(choice.shape[0], num_groups, -1)
        kept = grouped.topk(2, dim=-1)[0].sum(dim=-1).topk(topk_groups, dim=-1, sorted=False)[1]
        mask = torch.zeros(grouped.shape[:2], dtype=torch.bool, device=logits.device).scatter_(1, kept, True)
        keep = mask[:, :, None].expand(grouped.shape).reshape(choice.shape)  # (no host sync: graph-safe)
        choice = choice.masked_fill(~keep, float("-inf"))
    top_ids = choice.topk(top_k, dim=-1, sorted=False)[1]
    top_weights = scores.gather(1, top_ids)
    if renormalize:
        top_weights = top_weights / (top_weights.sum(dim=-1, keepdim=True) + eps)
    return top_weights * scale, top_ids
