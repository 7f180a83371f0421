"""The torch reference kernels against naive formulations and against each other."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridcache.kernels.attention import reference as attention_ref
from hybridcache.kernels.conv import reference as conv_ref
from hybridcache.kernels.gated_delta import reference as delta_ref


def delta_inputs(seq_len: int, num_k_heads=2, num_v_heads=4, k_dim=16, v_dim=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(seq_len, num_k_heads, k_dim, generator=gen)
    k = torch.randn(seq_len, num_k_heads, k_dim, generator=gen)
    v = torch.randn(seq_len, num_v_heads, v_dim, generator=gen)
    g = -torch.rand(seq_len, num_v_heads, generator=gen) * 0.5
    beta = torch.rand(seq_len, num_v_heads, generator=gen)
    state = torch.randn(num_v_heads, k_dim, v_dim, generator=gen)
    return q, k, v, g, beta, state


@pytest.mark.parametrize("seq_len", [1, 63, 64, 150])
def test_chunked_equals_recurrent_delta_rule(seq_len):
    q, k, v, g, beta, state = delta_inputs(seq_len)
    out_c, state_c = delta_ref.chunk_gated_delta_rule(q, k, v, g, beta, state)
    out_r, state_r = delta_ref.recurrent_gated_delta_rule(q, k, v, g, beta, state)
    assert out_c.shape == (seq_len, 4, 8) and state_c.shape == (4, 16, 8)
    torch.testing.assert_close(out_c, out_r, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(state_c, state_r, rtol=1e-4, atol=1e-4)


def test_delta_rule_split_at_any_step_continues_exactly():
    q, k, v, g, beta, _ = delta_inputs(150, seed=1)
    whole, final = delta_ref.chunk_gated_delta_rule(q, k, v, g, beta, None)
    first, mid = delta_ref.chunk_gated_delta_rule(q[:77], k[:77], v[:77], g[:77], beta[:77], None)
    second, end = delta_ref.chunk_gated_delta_rule(q[77:], k[77:], v[77:], g[77:], beta[77:], mid)
    torch.testing.assert_close(torch.cat([first, second]), whole, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(end, final, rtol=1e-4, atol=1e-4)


def test_recurrent_delta_rule_matches_the_textbook_update():
    q, k, v, g, beta, state = delta_inputs(5, num_k_heads=1, num_v_heads=1, seed=2)
    out, final = delta_ref.recurrent_gated_delta_rule(q, k, v, g, beta, state)
    s = state[0].clone()
    for t in range(5):
        kt, qt = F.normalize(k[t, 0], dim=-1, eps=0), F.normalize(q[t, 0], dim=-1, eps=0) / 4.0
        s = torch.exp(g[t, 0]) * s
        s = s + torch.outer(kt, beta[t, 0] * (v[t, 0] - s.T @ kt))
        torch.testing.assert_close(out[t, 0], s.T @ qt, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(final[0], s, rtol=1e-4, atol=1e-5)


def test_causal_conv1d_with_state_equals_one_long_convolution():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(40, 6, generator=gen)
    weight, bias = torch.randn(6, 4, generator=gen), torch.randn(6, generator=gen)
    whole, state = conv_ref.causal_conv1d(x, weight, bias, None)
    padded = F.pad(x.T, (3, 0))
    naive = F.silu(torch.stack([(padded[:, t : t + 4] * weight).sum(-1) + bias for t in range(40)]))
    torch.testing.assert_close(whole, naive)
    torch.testing.assert_close(state, x[-3:].T)
    pieces, carried = [], None
    for start, end in [(0, 2), (2, 3), (3, 25), (25, 40)]:  # includes pieces shorter than the kernel
        out, carried = conv_ref.causal_conv1d(x[start:end], weight, bias, carried)
        pieces.append(out)
    torch.testing.assert_close(torch.cat(pieces), whole)
    torch.testing.assert_close(carried, state)


def test_paged_attention_equals_dense_causal_attention():
    """Prefill and batched decode rows against dense attention, over a pool whose unwritten slots hold NaN."""
    gen = torch.Generator().manual_seed(4)
    num_pages, block, kv_heads, q_heads, dim = 40, 8, 2, 4, 16
    # every slot no sequence has written holds NaN: the pool's pages are recycled (a freed checkpoint's state bytes
    # read as KV can be NaN or inf), so a slot past a context or a padding page must never reach the output
    pool = torch.full((2, num_pages, block, kv_heads, dim), float("nan"))
    # seq 0: 30 tokens of history + 5 new; seq 1: 12 history + 1 decode; seq 2: a fresh prefill of 9;
    # seq 3: 25 history + 1 decode (decodes of different lengths are batched together, with padding masked)
    query_lens, context_lens = (5, 1, 9, 1), (35, 13, 9, 26)
    pages = [[7, 3, 30, 12, 5], [20, 1], [33, 9], [14, 15, 16, 17]]
    table = torch.tensor([row + [0] * (5 - len(row)) for row in pages], dtype=torch.int32)
    keys = torch.randn(sum(context_lens), kv_heads, dim, generator=gen)
    values = torch.randn(sum(context_lens), kv_heads, dim, generator=gen)
    kv_rows = []
    for row, ctx in zip(pages, context_lens, strict=True):
        kv_rows += [row[p // block] * block + p % block for p in range(ctx)]
    attention_ref.write_kv(pool, keys, values, torch.tensor(kv_rows))
    q = torch.randn(sum(query_lens), q_heads, dim, generator=gen)
    cu = torch.tensor([0, 5, 6, 15, 16], dtype=torch.int32)
    out = attention_ref.paged_attention(q, pool, table, cu, query_lens, context_lens, scale=dim**-0.5)
    kv_start = 0
    for i, (qlen, ctx) in enumerate(zip(query_lens, context_lens, strict=True)):
        k = keys[kv_start : kv_start + ctx].repeat_interleave(2, dim=1).transpose(0, 1)
        v = values[kv_start : kv_start + ctx].repeat_interleave(2, dim=1).transpose(0, 1)
        kv_start += ctx
        mask = torch.ones(qlen, ctx, dtype=torch.bool).tril(ctx - qlen)
        qi = q[cu[i] : cu[i + 1]].transpose(0, 1)
        dense = F.scaled_dot_product_attention(qi, k, v, attn_mask=mask).transpose(0, 1)
        torch.testing.assert_close(out[cu[i] : cu[i + 1]], dense, rtol=1e-5, atol=1e-5)


def test_batched_decode_steps_equal_per_sequence_steps():
    """The N-sequence one-token kernels give what the per-sequence kernels give for each sequence."""
    gen = torch.Generator().manual_seed(4)
    num = 5
    weight, bias = torch.randn(6, 4, generator=gen), torch.randn(6, generator=gen)
    x, conv_state = torch.randn(num, 6, generator=gen), torch.randn(num, 6, 3, generator=gen)
    out, new_conv = conv_ref.causal_conv1d_step(x, weight, bias, conv_state)
    inputs = [delta_inputs(1, seed=10 + i) for i in range(num)]
    q, k, v, g, beta, state = (torch.cat([x_[j] if j < 5 else x_[j][None] for x_ in inputs]) for j in range(6))
    delta_out, delta_state = delta_ref.gated_delta_rule_step(q, k, v, g, beta, state)
    for i in range(num):
        want, want_state = conv_ref.causal_conv1d(x[i : i + 1], weight, bias, conv_state[i])
        torch.testing.assert_close(out[i : i + 1], want)
        torch.testing.assert_close(new_conv[i], want_state)
        want, want_state = delta_ref.recurrent_gated_delta_rule(*inputs[i])
        torch.testing.assert_close(delta_out[i : i + 1], want, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(delta_state[i], want_state, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_route_of_half_logits_is_the_route_of_their_upcast_rounded(dtype):
    """Granite's gating hands `route` the router's logits in the model dtype: its fp32 softmax of the exact upcast,
    rounded to that dtype, is transformers' `.float()` before and `.type_as(hidden)` after, bit for bit."""
    from hybridcache.kernels.moe import reference as moe_ref

    logits = (3 * torch.randn(200, 64, generator=torch.Generator().manual_seed(0))).to(dtype)
    weights, ids = moe_ref.route(logits, 6, True)
    ref_weights, ref_ids = moe_ref.route(logits.float(), 6, True)
    assert weights.dtype == dtype and torch.equal(ids, ref_ids)
    assert torch.equal(weights, ref_weights.to(dtype))
