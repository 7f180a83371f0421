"""Torch reference of the gated delta rule (CPU friendly), one sequence per call unless stated.

The math mirrors transformers' torch fallbacks (`torch_chunk_gated_delta_rule`,
`torch_recurrent_gated_delta_rule`) so that results agree to float rounding. Notation: T new tokens,
Hk / Hv key / value heads (Hv is a multiple of Hk; key head `h // (Hv/Hk)` serves value head h), Dk / Dv
their head dims.

The log decay g is per head, [T, Hv] (gated DeltaNet), or per key channel, [T, Hv, Dk] (Kimi Delta Attention,
KDA: each row of the state S [Dk, Dv] decays at its own rate, S = diag(exp(g_t)) S); every function here takes
either (transformers' `chunk_kimi_delta_attention` / `recurrent_kimi_delta_attention` are the per-channel
reference).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (the flash-linear-attention convention)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _state_decay(g: torch.Tensor, per_channel: bool) -> torch.Tensor:
    """exp(g) shaped to scale states [..., Dk, Dv]: per head, g [...] -> [..., 1, 1]; per key channel (KDA), g
    [..., Dk] -> [..., Dk, 1]."""
    return g.exp()[..., None] if per_channel else g.exp()[..., None, None]


def _prepare_delta_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    use_qk_l2norm: bool,
) -> tuple[torch.Tensor, ...]:
    """Expand key heads to value heads, move heads first, cast to fp32, normalise and scale q.

    Returns q, k [Hv, T, Dk], v [Hv, T, Dv], g [Hv, T] (or [Hv, T, Dk] per channel), beta [Hv, T], all fp32.
    """
    num_k_heads, num_v_heads = k.shape[1], v.shape[1]
    if num_v_heads != num_k_heads:
        q = q.repeat_interleave(num_v_heads // num_k_heads, dim=1)
        k = k.repeat_interleave(num_v_heads // num_k_heads, dim=1)
    q, k, v, g, beta = (x.transpose(0, 1).to(torch.float32).contiguous() for x in (q, k, v, g, beta))
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    q = q * q.shape[-1] ** -0.5
    return q, k, v, g, beta


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    *,
    chunk_size: int = 64,
    use_qk_l2norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated delta rule over one sequence, computed chunk by chunk (the WY / UT-transform form).

    q, k          [T, Hk, Dk]   (l2-normalised here when `use_qk_l2norm`, as transformers does)
    v             [T, Hv, Dv]
    g             [T, Hv]       log decay (<= 0): the state is multiplied by exp(g_t) at step t; or
                  [T, Hv, Dk]   per key channel (KDA): row i of S is multiplied by exp(g_t[i])
    beta          [T, Hv]       write strength in (0, 1)
    initial_state [Hv, Dk, Dv]  state before the first token (None = zeros); any dtype, read as fp32
    returns       out [T, Hv, Dv] in q's dtype, final_state [Hv, Dk, Dv] fp32

    Per token t and value head (S is [Dk, Dv], q is scaled by Dk^-1/2):
        S = exp(g_t) S;  S = S + k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T q_t
    """
    out_dtype = q.dtype
    seq_len = q.shape[0]
    per_channel = g.dim() == 3
    q, k, v, g, beta = _prepare_delta_inputs(q, k, v, g, beta, use_qk_l2norm)
    if per_channel:
        out, state = _chunk_per_channel(q, k, v, g, beta, initial_state, chunk_size)
        return out.transpose(0, 1).contiguous().to(out_dtype), state
    num_heads, _, k_dim = k.shape
    v_dim = v.shape[-1]

    pad = (chunk_size - seq_len % chunk_size) % chunk_size
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    num_chunks = (seq_len + pad) // chunk_size

    v_beta = v * beta.unsqueeze(-1)
    k_beta = k * beta.unsqueeze(-1)
    q, k, k_beta, v_beta = (
        x.reshape(num_heads, num_chunks, chunk_size, x.shape[-1]) for x in (q, k, k_beta, v_beta)
    )
    g = g.reshape(num_heads, num_chunks, chunk_size)

    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    g_cum = g.cumsum(dim=-1)
    # decay[..., i, j] = exp(g_cum_i - g_cum_j) for j <= i, 0 above the diagonal
    decay = (g_cum.unsqueeze(-1) - g_cum.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()
    ut_system = (k_beta @ k.transpose(-1, -2)) * decay
    intra_attn = (q @ k.transpose(-1, -2)) * decay
    decayed_k_beta = k_beta * g_cum.exp().unsqueeze(-1)
    # One triangular solve for both right-hand sides (the factorisation, not the width, is what costs).
    solved = torch.linalg.solve_triangular(
        ut_system, torch.cat([v_beta, decayed_k_beta], dim=-1), upper=False, unitriangular=True
    )
    new_values, k_cumdecay = solved.split([v_dim, k_dim], dim=-1)

    if initial_state is None:
        state = torch.zeros(num_heads, k_dim, v_dim, dtype=torch.float32, device=q.device)
    else:
        state = initial_state.to(torch.float32)
    out = torch.zeros_like(new_values)
    q = q * g_cum.exp().unsqueeze(-1)
    k = k * (g_cum[..., -1:] - g_cum).exp().unsqueeze(-1)
    chunk_decay = g_cum[..., -1].exp()[..., None, None]
    for i in range(num_chunks):
        v_new = new_values[:, i] - k_cumdecay[:, i] @ state
        out[:, i] = q[:, i] @ state + intra_attn[:, i] @ v_new
        state = state * chunk_decay[:, i] + k[:, i].transpose(-1, -2) @ v_new
    out = out.reshape(num_heads, -1, v_dim)[:, :seq_len]
    return out.transpose(0, 1).contiguous().to(out_dtype), state


def _chunk_per_channel(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`chunk_gated_delta_rule`'s form with a per-channel decay, prepared inputs (q, k [H, T, Dk], v [H, T, Dv],
    g [H, T, Dk], beta [H, T], fp32) -> out [H, T, Dv], final state [H, Dk, Dv] fp32. A chunk's decays between
    positions i >= j are exp(G_i - G_j) per channel (G the in-chunk cumulative g), so the decayed inner products
    sum over Dk explicitly, [H, C, C, Dk] a chunk (never exp(-G) alone, which overflows)."""
    num_heads, seq_len, k_dim = k.shape
    v_dim = v.shape[-1]
    state = (torch.zeros(num_heads, k_dim, v_dim, dtype=torch.float32, device=q.device) if initial_state is None
             else initial_state.to(torch.float32))
    out = torch.empty(num_heads, seq_len, v_dim, dtype=torch.float32, device=q.device)
    for start in range(0, seq_len, chunk_size):
        rows = slice(start, min(start + chunk_size, seq_len))
        qc, kc, vc, gc, bc = q[:, rows], k[:, rows], v[:, rows], g[:, rows].cumsum(dim=1), beta[:, rows]
        size = qc.shape[1]
        upper = torch.ones(size, size, dtype=torch.bool, device=q.device).triu(1)
        # decay[h, i, j, c] = exp(G_i[c] - G_j[c]) for j <= i, 0 above the diagonal
        decay = (gc[:, :, None] - gc[:, None]).masked_fill(upper[..., None], float("-inf")).exp()
        k_beta = kc * bc[..., None]
        ut_system = torch.einsum("hic,hjc,hijc->hij", k_beta, kc, decay)
        intra_attn = torch.einsum("hic,hjc,hijc->hij", qc, kc, decay)
        solved = torch.linalg.solve_triangular(
            ut_system, torch.cat([vc * bc[..., None], k_beta * gc.exp()], dim=-1), upper=False, unitriangular=True
        )
        new_values, k_cumdecay = solved.split([v_dim, k_dim], dim=-1)
        v_new = new_values - k_cumdecay @ state
        out[:, rows] = (qc * gc.exp()) @ state + intra_attn @ v_new
        last = gc[:, -1:]
        state = state * last.exp().transpose(1, 2) + (kc * (last - gc).exp()).transpose(1, 2) @ v_new
    return out, state


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    *,
    use_qk_l2norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated delta rule over one sequence, token by token (same contract as `chunk_gated_delta_rule`).

    q, k [T, Hk, Dk]; v [T, Hv, Dv]; g [T, Hv] or [T, Hv, Dk]; beta [T, Hv]; initial_state [Hv, Dk, Dv] or None
    returns out [T, Hv, Dv] in q's dtype, final_state [Hv, Dk, Dv] fp32
    """
    out_dtype = q.dtype
    per_channel = g.dim() == 3
    q, k, v, g, beta = _prepare_delta_inputs(q, k, v, g, beta, use_qk_l2norm)
    num_heads, seq_len, k_dim = k.shape
    if initial_state is None:
        state = torch.zeros(num_heads, k_dim, v.shape[-1], dtype=torch.float32, device=q.device)
    else:
        state = initial_state.to(torch.float32)
    out = torch.zeros_like(v)
    for t in range(seq_len):
        state = state * _state_decay(g[:, t], per_channel)
        predicted = (state * k[:, t].unsqueeze(-1)).sum(dim=-2)  # S^T k: [Hv, Dv]
        delta = (v[:, t] - predicted) * beta[:, t].unsqueeze(-1)
        state = state + k[:, t].unsqueeze(-1) * delta.unsqueeze(-2)
        out[:, t] = (state * q[:, t].unsqueeze(-1)).sum(dim=-2)
    return out.transpose(0, 1).contiguous().to(out_dtype), state


def gated_delta_rule_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    *,
    use_qk_l2norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One new token for each of N sequences at once (the decode case of `recurrent_gated_delta_rule`).

    q, k [N, Hk, Dk]; v [N, Hv, Dv]; g [N, Hv] or [N, Hv, Dk]; beta [N, Hv]; state [N, Hv, Dk, Dv]
    returns out [N, Hv, Dv] in q's dtype, new_state [N, Hv, Dk, Dv] fp32
    """
    out_dtype = q.dtype
    per_channel = g.dim() == 3
    # With the N sequences in place of time, the per-token preparation is the same; then move N back first.
    q, k, v, g, beta = (x.transpose(0, 1) for x in _prepare_delta_inputs(q, k, v, g, beta, use_qk_l2norm))
    state = state.to(torch.float32) * _state_decay(g, per_channel)
    predicted = (state * k.unsqueeze(-1)).sum(dim=-2)  # S^T k: [N, Hv, Dv]
    delta = (v - predicted) * beta.unsqueeze(-1)
    state = state + k.unsqueeze(-1) * delta.unsqueeze(-2)
    out = (state * q.unsqueeze(-1)).sum(dim=-2)
    return out.to(out_dtype), state


def split_qkv(
    conv_out: torch.Tensor, num_k_heads: int, k_dim: int, v_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gated DeltaNet's conv output [T, C] (C = q of every key head | k | v of every value head) -> views q, k
    [T, Hk, Dk] and v [T, Hv, Dv] (Hk = num_k_heads, Hv = the rest of C over Dv)."""
    num, key_dim = conv_out.shape[0], num_k_heads * k_dim
    q, k, v = torch.split(conv_out, [key_dim, key_dim, conv_out.shape[1] - 2 * key_dim], dim=-1)
    return q.view(num, num_k_heads, k_dim), k.view(num, num_k_heads, k_dim), v.view(num, -1, v_dim)


def delta_gates(
    a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor  # noqa: N803 (checkpoint name)
) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-head gates of gated DeltaNet: a, b [T, Hv]; A_log, dt_bias [Hv] ->
    g = -exp(A_log) * softplus(a + dt_bias) [T, Hv] fp32 (the log decay, <= 0) and beta = sigmoid(b) in b's dtype."""
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
    return g, b.sigmoid()


def gated_delta_rule_verify(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor,
    *,
    use_qk_l2norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A verify row of speculative decoding: one sequence's T tokens fed one decode step at a time, keeping the
    state after every position (what a rejected draft rolls back to).

    q, k [T, Hk, Dk]; v [T, Hv, Dv]; g [T, Hv] or [T, Hv, Dk]; beta [T, Hv]; initial_state [Hv, Dk, Dv] in the
    pool's dtype
    returns out [T, Hv, Dv] in q's dtype, states [T, Hv, Dk, Dv] in initial_state's dtype: states[t] is the state
    after position t, rounded to that dtype after every position exactly as T decode steps would round it.
    """
    outs, states = [], []
    state = initial_state
    for t in range(q.shape[0]):
        out, new = recurrent_gated_delta_rule(
            q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1], state, use_qk_l2norm=use_qk_l2norm
        )
        state = new.to(initial_state.dtype)
        outs.append(out)
        states.append(state)
    return torch.cat(outs), torch.stack(states)
