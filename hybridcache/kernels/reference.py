"""Torch reference kernels (CPU friendly) for hybrid models: gated delta rule, short causal convolution,
paged attention over block tables, and the KV write through a slot mapping.

Every function works on ONE sequence unless its docstring says otherwise; callers loop over the
sequences of a varlen batch (`cu_seqlens`). The math mirrors transformers' torch fallbacks
(`torch_chunk_gated_delta_rule`, `torch_recurrent_gated_delta_rule`, `causal_conv1d_fn/update`,
eager attention) so that results agree to float rounding.

Notation: T new tokens, Hk / Hv DeltaNet key / value heads (Hv is a multiple of Hk; key head `h // (Hv/Hk)`
serves value head h), Dk / Dv their head dims, C conv channels, K conv kernel size, Hq / Hkv attention
query / key-value heads, D attention head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (the flash-linear-attention convention)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _prepare_delta_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    use_qk_l2norm: bool,
) -> tuple[torch.Tensor, ...]:
    """Expand key heads to value heads, move heads first, cast to fp32, normalise and scale q.

    Returns q, k [Hv, T, Dk], v [Hv, T, Dv], g, beta [Hv, T], all fp32.
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
    g             [T, Hv]       log decay (<= 0): the state is multiplied by exp(g_t) at step t
    beta          [T, Hv]       write strength in (0, 1)
    initial_state [Hv, Dk, Dv]  state before the first token (None = zeros); any dtype, read as fp32
    returns       out [T, Hv, Dv] in q's dtype, final_state [Hv, Dk, Dv] fp32

    Per token t and value head (S is [Dk, Dv], q is scaled by Dk^-1/2):
        S = exp(g_t) S;  S = S + k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T q_t
    """
    out_dtype = q.dtype
    seq_len = q.shape[0]
    q, k, v, g, beta = _prepare_delta_inputs(q, k, v, g, beta, use_qk_l2norm)
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

    q, k [T, Hk, Dk]; v [T, Hv, Dv]; g, beta [T, Hv]; initial_state [Hv, Dk, Dv] or None
    returns out [T, Hv, Dv] in q's dtype, final_state [Hv, Dk, Dv] fp32
    """
    out_dtype = q.dtype
    q, k, v, g, beta = _prepare_delta_inputs(q, k, v, g, beta, use_qk_l2norm)
    num_heads, seq_len, k_dim = k.shape
    if initial_state is None:
        state = torch.zeros(num_heads, k_dim, v.shape[-1], dtype=torch.float32, device=q.device)
    else:
        state = initial_state.to(torch.float32)
    out = torch.zeros_like(v)
    for t in range(seq_len):
        state = state * g[:, t].exp()[:, None, None]
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

    q, k [N, Hk, Dk]; v [N, Hv, Dv]; g, beta [N, Hv]; state [N, Hv, Dk, Dv]
    returns out [N, Hv, Dv] in q's dtype, new_state [N, Hv, Dk, Dv] fp32
    """
    out_dtype = q.dtype
    # With the N sequences in place of time, the per-token preparation is the same; then move N back first.
    q, k, v, g, beta = (x.transpose(0, 1) for x in _prepare_delta_inputs(q, k, v, g, beta, use_qk_l2norm))
    state = state.to(torch.float32) * g.exp()[..., None, None]
    predicted = (state * k.unsqueeze(-1)).sum(dim=-2)  # S^T k: [N, Hv, Dv]
    delta = (v - predicted) * beta.unsqueeze(-1)
    state = state + k.unsqueeze(-1) * delta.unsqueeze(-2)
    out = (state * q.unsqueeze(-1)).sum(dim=-2)
    return out.to(out_dtype), state


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor | None,
    *,
    activation: str | None = "silu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal convolution over one sequence, continuing from a conv state.

    x          [T, C]       pre-convolution inputs of the new tokens
    weight     [C, K]       depthwise kernel (transformers' conv1d.weight [C, 1, K] squeezed)
    bias       [C] or None
    conv_state [C, K-1]     the last K-1 pre-convolution inputs before x, oldest first (None = zeros)
    returns    out [T, C] (SiLU applied when activation == "silu"), new_state [C, K-1]

    Worked example, K = 4, state [s1 s2 s3], new inputs [x1 x2]:
        window for x1 = [s1 s2 s3 x1], for x2 = [s2 s3 x1 x2];  new_state = [s3 x1 x2]
    """
    channels, kernel_size = weight.shape
    width = kernel_size - 1
    if conv_state is None:
        conv_state = torch.zeros(channels, width, dtype=x.dtype, device=x.device)
    full = torch.cat([conv_state.to(weight.dtype), x.transpose(0, 1).to(weight.dtype)], dim=-1)  # [C, K-1+T]
    out = _depthwise_windows(full, weight, bias, activation)  # [C, T]
    return out.transpose(0, 1).to(x.dtype), full[:, full.shape[-1] - width :].to(conv_state.dtype)


def causal_conv1d_step(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    *,
    activation: str | None = "silu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """One new token for each of N sequences at once (the decode case of `causal_conv1d`).

    x [N, C]; weight [C, K]; bias [C] or None; conv_state [N, C, K-1]
    returns out [N, C], new_state [N, C, K-1]  (window = state + x, new_state = window[..., 1:])
    """
    window = torch.cat([conv_state.to(weight.dtype), x.to(weight.dtype).unsqueeze(-1)], dim=-1)  # [N, C, K]
    out = _depthwise_windows(window, weight, bias, activation)[..., 0]
    return out.to(x.dtype), window[..., 1:].to(conv_state.dtype)


def _depthwise_windows(
    full: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None
) -> torch.Tensor:
    """full [..., C, K-1+T] -> [..., C, T]: every window of K inputs times the channel's kernel, summed."""
    out = (full.unfold(-1, weight.shape[-1], 1) * weight.unsqueeze(-2)).sum(-1)
    if bias is not None:
        out = out + bias.unsqueeze(-1)
    if activation == "silu":
        return F.silu(out)
    if activation is not None:
        raise ValueError(f"unsupported activation {activation!r}")
    return out


def write_kv(
    kv_pool: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write new keys/values into one layer's paged KV pool, in place.

    kv_pool      [2, num_pages, kernel_block_size, Hkv, D]   (0 = keys, 1 = values)
    keys, values [T, Hkv, D]
    slot_mapping [T] int64   flat row page * kernel_block_size + offset of each token
    """
    flat = kv_pool.view(2, -1, *kv_pool.shape[3:])
    flat[0, slot_mapping] = keys.to(kv_pool.dtype)
    flat[1, slot_mapping] = values.to(kv_pool.dtype)


def gather_kv(
    kv_pool: torch.Tensor, pages: torch.Tensor, context_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of positions [0, context_len) of one sequence.

    kv_pool [2, num_pages, kernel_block_size, Hkv, D]; pages [P] int (the sequence's block-table row)
    returns keys, values [context_len, Hkv, D]
    """
    block = kv_pool.shape[2]
    used = pages[: -(-context_len // block)].long()
    kv = kv_pool[:, used].reshape(2, -1, *kv_pool.shape[3:])[:, :context_len]
    return kv[0], kv[1]


def paged_attention(
    q: torch.Tensor,
    kv_pool: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens: torch.Tensor,
    query_lens: tuple[int, ...],
    context_lens: tuple[int, ...],
    *,
    scale: float,
) -> torch.Tensor:
    """Causal GQA attention of a varlen batch over a paged KV pool (its new K/V already written).

    q            [T, Hq, D]    queries of all sequences, concatenated
    kv_pool      [2, num_pages, kernel_block_size, Hkv, D]
    block_tables [S, P] int32  kernel pages of each sequence
    cu_seqlens   [S + 1]       query rows of sequence i: cu_seqlens[i]:cu_seqlens[i+1]
    query_lens, context_lens   per-sequence host ints; the new tokens sit at positions
                               [context_len - query_len, context_len)
    returns      [T, Hq, D] in q's dtype

    Query head h reads kv head h // (Hq / Hkv). Query at position p sees keys at positions <= p
    (softmax in fp32, like transformers' eager attention). Sequences with one query token (decode) are
    computed together by `paged_decode_attention`; the others one by one.
    """
    out = torch.empty_like(q)
    num_q_heads, num_kv_heads = q.shape[1], kv_pool.shape[3]
    group = num_q_heads // num_kv_heads
    starts = cu_seqlens.tolist()
    decode_ids = [i for i, query_len in enumerate(query_lens) if query_len == 1]
    if decode_ids:
        rows = torch.tensor([starts[i] for i in decode_ids], device=q.device)
        lens = torch.tensor([context_lens[i] for i in decode_ids], device=q.device)
        out[rows] = paged_decode_attention(q[rows], kv_pool, block_tables[decode_ids], lens, scale=scale)
    for i, (query_len, context_len) in enumerate(zip(query_lens, context_lens, strict=True)):
        if query_len == 1:
            continue
        rows = slice(starts[i], starts[i] + query_len)
        keys, values = gather_kv(kv_pool, block_tables[i], context_len)
        keys = keys.repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, ctx, D]
        values = values.repeat_interleave(group, dim=1).transpose(0, 1)
        query = q[rows].transpose(0, 1)  # [Hq, qlen, D]
        scores = (query @ keys.transpose(-1, -2)) * scale
        query_pos = torch.arange(context_len - query_len, context_len, device=q.device)
        key_pos = torch.arange(context_len, device=q.device)
        scores = scores.masked_fill(key_pos[None, :] > query_pos[:, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out[rows] = (probs @ values).transpose(0, 1)
    return out


def paged_decode_attention(
    q: torch.Tensor, kv_pool: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor, *, scale: float
) -> torch.Tensor:
    """One query token per sequence, N sequences at once, over the paged pool.

    q [N, Hq, D] (the token at position context_len - 1 of each sequence); kv_pool [2, num_pages,
    kernel_block_size, Hkv, D]; block_tables [N, P]; context_lens [N] -> [N, Hq, D] in q's dtype.
    Keys are gathered for P * kernel_block_size positions per sequence and those >= context_len masked.
    """
    num, num_q_heads, head_dim = q.shape
    num_kv_heads = kv_pool.shape[3]
    max_len = int(context_lens.max())
    pages = block_tables[:, : -(-max_len // kv_pool.shape[2])].long()
    kv = kv_pool[:, pages].reshape(2, num, -1, num_kv_heads, head_dim)  # [2, N, L, Hkv, D]
    keys, values = kv[0].transpose(1, 2), kv[1].transpose(1, 2)  # [N, Hkv, L, D]
    query = q.reshape(num, num_kv_heads, num_q_heads // num_kv_heads, head_dim)  # head h = kv * group + g
    scores = (query @ keys.transpose(-1, -2)) * scale  # [N, Hkv, group, L]
    beyond = torch.arange(keys.shape[2], device=q.device)[None, :] >= context_lens[:, None]  # [N, L]
    scores = scores.masked_fill(beyond[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return (probs @ values).reshape(num, num_q_heads, head_dim)
