"""Torch reference of Mamba2's selective state space scan (SSD), one sequence per call unless stated.

Notation: T new tokens, H heads of P channels, G groups (B and C are shared by the H / G heads of a group: head h
reads group h // (H / G)), N the state size. Per head, per token t (all in fp32):

    dt_t = clamp(softplus(dt_raw_t + dt_bias), *dt_limit)            (`discretized_dt`)
    S_t  = exp(dt_t A) S_{t-1} + dt_t x_t (x) B_t                    S [H, P, N], A = -exp(A_log) < 0
    y_t  = S_t C_t + D x_t                                           y [H, P]

`ssd_chunk_scan` computes the same thing chunk by chunk (the state space duality form, transformers'
`torch_chunk_scan_combined` / mamba_ssm's `mamba_chunk_scan_combined`): inside a chunk of L tokens the output is a
masked "attention" of C over B weighted by the decay between the two positions, plus the decayed contribution of the
state entering the chunk; the state leaving it is the decayed state plus every token's decayed write. Worked example,
one head, a chunk of 3 tokens, cumulative log decay c_l = sum_{j<=l} dt_j A:

    y_2 = exp(c_2) C_2.S_in + exp(c_2-c_0) (C_2.B_0) dt_0 x_0 + exp(c_2-c_1) (C_2.B_1) dt_1 x_1 + (C_2.B_2) dt_2 x_2
    S_out = exp(c_2) S_in + sum_s exp(c_2 - c_s) dt_s x_s (x) B_s

`ssd_step` is one token of many sequences (decode). Both agree with each other to fp32 rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK_SIZE = 64  # tokens per chunk of `ssd_chunk_scan` (any size gives the same result to rounding)


def discretized_dt(dt: torch.Tensor, dt_bias: torch.Tensor, dt_limit: tuple[float, float]) -> torch.Tensor:
    """dt [..., H] (the projection's raw output), dt_bias [H] -> clamp(softplus(dt + dt_bias), *dt_limit) fp32."""
    dt = F.softplus(dt.float() + dt_bias.float())
    low, high = dt_limit
    if low > 0.0 or high != float("inf"):
        dt = dt.clamp(min=low, max=high)
    return dt


def _heads(groups: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[..., G, N] -> [..., H, N] fp32: each group repeated for its H / G heads."""
    return groups.float().repeat_interleave(num_heads // groups.shape[-2], dim=-2)


def ssd_chunk_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,  # noqa: N803 (the paper's name)
    B: torch.Tensor,  # noqa: N803
    C: torch.Tensor,  # noqa: N803
    D: torch.Tensor,  # noqa: N803
    initial_state: torch.Tensor | None = None,
    *,
    chunk_size: int = CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The scan over one sequence, chunk by chunk (module docstring).

    x             [T, H, P]
    dt            [T, H]      discretized (`discretized_dt`), > 0
    A             [H]         -exp(A_log) (< 0)
    B, C          [T, G, N]
    D             [H]         skip connection
    initial_state [H, P, N]   state before the first token (None = zeros); any dtype, read as fp32
    returns       y [T, H, P] fp32 (the D skip included), final state [H, P, N] fp32
    """
    num_tokens, num_heads, head_dim = x.shape
    x, dt, A = x.float(), dt.float(), A.float()
    B, C = _heads(B, num_heads), _heads(C, num_heads)  # [T, H, N]
    state = (torch.zeros(num_heads, head_dim, B.shape[-1], dtype=torch.float32, device=x.device)
             if initial_state is None else initial_state.float())
    y = torch.empty(num_tokens, num_heads, head_dim, dtype=torch.float32, device=x.device)
    for start in range(0, num_tokens, chunk_size):
        rows = slice(start, min(start + chunk_size, num_tokens))
        xc, dtc, bc, cc = x[rows], dt[rows], B[rows], C[rows]  # [L, H, P], [L, H], [L, H, N] x 2
        length = xc.shape[0]
        cum = torch.cumsum(dtc * A, dim=0)  # [L, H] cumulative log decay
        causal = torch.ones(length, length, dtype=torch.bool, device=x.device).tril()
        # decay[l, s, h] = exp(cum_l - cum_s) for s <= l (masked before exp: no overflow above the diagonal)
        gap = (cum[:, None, :] - cum[None, :, :]).masked_fill(~causal[..., None], float("-inf"))
        scores = torch.einsum("lhn,shn->lsh", cc, bc) * gap.exp()  # [L, L, H]
        xdt = xc * dtc[..., None]  # [L, H, P]
        y[rows] = (torch.einsum("lsh,shp->lhp", scores, xdt)
                   + torch.einsum("lhn,hpn->lhp", cc, state) * cum.exp()[..., None])
        to_end = (cum[-1:] - cum).exp()  # [L, H] decay from each token to the end of the chunk
        state = state * cum[-1].exp()[:, None, None] + torch.einsum("lh,lhp,lhn->hpn", to_end, xdt, bc)
    return y + x * D.float()[:, None], state


def ssd_step(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,  # noqa: N803
    B: torch.Tensor,  # noqa: N803
    C: torch.Tensor,  # noqa: N803
    D: torch.Tensor,  # noqa: N803
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of M sequences (the recurrent form of the module docstring).

    x [M, H, P]; dt [M, H] discretized; A, D [H]; B, C [M, G, N]; state [M, H, P, N] (any dtype, read as fp32)
    returns y [M, H, P] fp32 (the D skip included), new state [M, H, P, N] fp32
    """
    num_heads = x.shape[1]
    x, dt = x.float(), dt.float()
    B, C = _heads(B, num_heads), _heads(C, num_heads)  # [M, H, N]
    decay = (dt * A.float()).exp()[..., None, None]  # [M, H, 1, 1]
    state = state.float() * decay + (x * dt[..., None])[..., None] * B[:, :, None, :]
    y = torch.einsum("mhpn,mhn->mhp", state, C) + x * D.float()[:, None]
    return y, state


def ssd_states_after(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,  # noqa: N803
    B: torch.Tensor,  # noqa: N803
    C: torch.Tensor,  # noqa: N803
    D: torch.Tensor,  # noqa: N803
    initial_state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence token by token, keeping every state (speculative decoding's verify rows).

    x [T, H, P]; dt [T, H]; B, C [T, G, N]; initial_state [H, P, N]
    returns y [T, H, P] fp32, states [T, H, P, N] fp32 (entry t: the state after token t)
    """
    outputs, states = [], []
    state = initial_state[None]
    for t in range(x.shape[0]):
        y, state = ssd_step(x[t : t + 1], dt[t : t + 1], A, B[t : t + 1], C[t : t + 1], D, state)
        outputs.append(y[0])
        states.append(state[0])
    return torch.stack(outputs), torch.stack(states)


def gated_group_rms_norm(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, group_size: int,
    norm_before_gate: bool = False,
) -> torch.Tensor:
    """Mamba2's gated RMSNorm, the norm taken over groups of `group_size` channels: x, gate [T, I], weight [I] ->
    [T, I] in gate's dtype, computed in fp32 and rounded once. The gate applied before the norm (mamba_ssm's
    `norm_before_gate=False`: Granite-4.0-H, Nemotron-H, Bamba), y = weight * rms_norm_per_group(x * silu(gate)), or
    with `norm_before_gate` after it (Falcon-H1's default), y = weight * rms_norm_per_group(x) * silu(gate)."""
    shape = x.shape
    silu_gate = F.silu(gate.float())
    gated = x.float() if norm_before_gate else x.float() * silu_gate
    grouped = gated.view(*shape[:-1], shape[-1] // group_size, group_size)
    normed = (weight.float() * (grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + eps)).view(shape))
    return (normed * silu_gate if norm_before_gate else normed).to(gate.dtype)
