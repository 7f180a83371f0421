"""The gated delta rule over speculative decoding's verify rows on CUDA (Triton): a fused recurrent kernel that
keeps the state after each draft position in the sequence's draft rows of the state pool.

A verify row feeds a sequence's last token and its n drafts (positions s .. s+n). The state after position s+j
(j < n) is what the slot must hold if only j drafts are accepted, so the kernel writes it to pool row
`draft_table[i, j]`; the cache's `STATE_ROLLBACK` copy later moves the accepted one into the slot. Per sequence i,
value head h, token t of its rows (same math as `gated_delta/reference.py::gated_delta_rule_verify`)::

    q, k = l2norm(q_t), l2norm(k_t) (when use_qk_l2norm);  q = q * Dk^-1/2
    S = exp(g_t) S;  S = S + k (beta_t (v_t - S^T k))^T;  o_t = S^T q
    S rounded to the pool's dtype (as a decode step stores it);  t < n: pool[draft_table[i, t], h] = S

S starts at pool[state_slots[i], h] (zeros when context_len == query_len: a fresh sequence). Two modes:

- full (`states_only=False`): every sequence of the batch is short (decode or verify rows): all its tokens run,
  outputs are written, and the state after its last token is written back to its slot;
- states only (`states_only=True`): a step that also has prefill chunks, which fla's chunked kernel runs for every
  sequence afterwards (outputs and final states): only the first n positions of each verify row run, and only the
  draft rows are written (before fla rewrites the slots it reads).

Grid (S, Hv, cdiv(Dv, BLOCK_V)): each program owns a [Dk, BLOCK_V] column block of one sequence's state and walks
its tokens in order, so the state is read once, each draft state written once, and no gather or scatter is needed.
Any head dims: the tiles are padded to powers of two and the entries past Dk / Dv masked, as in the step kernel
(`triton_step`'s docstring: they load as 0 and are never stored).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridcache.kernels.gated_delta.triton_step import delta_rule_update, head_tiles, program_heads, token_inputs
from hybridcache.kernels.varlen import check_verify_rows

_BLOCK_V = 32


@triton.jit(do_not_specialize=["stride_table"])  # the table's width is the step's most drafts: 1 is a run-time value
def _gdn_verify_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, out_ptr, pool_ptr, slots_ptr, cu_ptr, ctx_ptr, table_ptr, drafts_ptr, scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_bt, stride_ot, stride_oh,
    stride_ps, stride_ph, stride_pk, stride_table,
    RATIO: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
    L2NORM: tl.constexpr, STATES_ONLY: tl.constexpr, ROUND: tl.constexpr,
):
    seq, head, key_head, ks, vs, k_in, v_in = program_heads(RATIO, DK, DV, BLOCK_K, BLOCK_V)
    bos = tl.load(cu_ptr + seq).to(tl.int64)
    query_len = tl.load(cu_ptr + seq + 1).to(tl.int64) - bos
    num_drafts = tl.load(drafts_ptr + seq).to(tl.int64)
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    rows_to_read = DK * (tl.load(ctx_ptr + seq).to(tl.int64) != query_len).to(tl.int32)  # 0 for a fresh sequence
    state_offsets = head * stride_ph + ks[:, None] * stride_pk + vs[None, :]
    columns = v_in[None, :]  # (and rows_to_read <= DK: the rows past Dk read 0 and stay 0)
    state = tl.load(pool_ptr + slot * stride_ps + state_offsets, mask=(ks < rows_to_read)[:, None] & columns,
                    other=0.0).to(tl.float32)  # [BLOCK_K, BLOCK_V]
    if STATES_ONLY:  # noqa: SIM108 (a constexpr branch, resolved when the kernel compiles)
        steps = num_drafts
    else:
        steps = query_len
    for t in range(0, steps):
        row = bos + t
        bq, bk, bv, bg, bb = token_inputs(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, row, head, key_head, ks, vs, k_in,
                                          v_in, scale, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                                          stride_gt, stride_bt, L2NORM)
        state = delta_rule_update(state, bk, bv, bg, bb)
        if ROUND:  # a state pool narrower than fp32 holds the state rounded after every position
            state = state.to(pool_ptr.dtype.element_ty).to(tl.float32)
        if not STATES_ONLY:
            out = tl.sum(state * bq[:, None], axis=0)
            tl.store(out_ptr + row * stride_ot + head * stride_oh + vs, out.to(out_ptr.dtype.element_ty),
                     mask=v_in)
        keep = t < num_drafts
        draft_row = tl.load(table_ptr + seq * stride_table + t, mask=keep, other=0).to(tl.int64)
        tl.store(pool_ptr + draft_row * stride_ps + state_offsets, state.to(pool_ptr.dtype.element_ty),
                 mask=(ks < DK * keep.to(tl.int32))[:, None] & columns)
    if not STATES_ONLY:
        tl.store(pool_ptr + slot * stride_ps + state_offsets, state.to(pool_ptr.dtype.element_ty),
                 mask=k_in[:, None] & columns)


def gated_delta_rule_verify(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_pool: torch.Tensor,
    state_slots: torch.Tensor,
    cu_seqlens: torch.Tensor,
    context_lens: torch.Tensor,
    draft_table: torch.Tensor,
    num_drafts: torch.Tensor,
    *,
    states_only: bool,
    use_qk_l2norm: bool = True,
) -> torch.Tensor | None:
    """The gated delta rule over a varlen batch with verify rows (see the module docstring for the two modes).

    q, k        [T, Hk, Dk]  (unit stride on the last dim; other strides free)
    v           [T, Hv, Dv]  (unit stride on the last dim)
    g, beta     [T, Hv]      log decay (fp32) and write strength
    ssm_pool    [num_slots, Hv, Dk, Dv]  contiguous; fp32 normally (a narrower dtype rounds after each position)
    state_slots [S] int64 distinct slots;  cu_seqlens [S + 1] int32/int64;  context_lens [S] (== query_len: fresh)
    draft_table [S, W] int64 pool rows: the state after position j of sequence i goes to draft_table[i, j] for
                j < num_drafts[i] (W >= max num_drafts, at least 1; the rest of a row is never read)
    num_drafts  [S] int32: drafts of each sequence (0: a decode row or, in states-only mode, a prefill chunk);
                num_drafts[i] < query_len of sequence i
    Returns out [T, Hv, Dv] in q's dtype (full mode), or None (states-only mode: out and the slots untouched).
    Any Dk and Dv (tiles as the step kernel's, `triton_step.head_tiles`); in full mode every sequence is run token
    by token, so its rows should be few.
    """
    num_tokens, num_k_heads, k_dim = q.shape
    num_v_heads, v_dim = v.shape[1], v.shape[2]
    num_seqs = state_slots.shape[0]
    if k.shape != q.shape or v.shape[0] != num_tokens or num_v_heads % num_k_heads:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: q and k must match, v have "
                         f"as many rows and a multiple of the key heads")
    if g.shape != (num_tokens, num_v_heads) or beta.shape != (num_tokens, num_v_heads):
        raise ValueError(f"g {tuple(g.shape)} and beta {tuple(beta.shape)} must be [T, Hv] = "
                         f"{(num_tokens, num_v_heads)}")
    if ssm_pool.dim() != 4 or tuple(ssm_pool.shape[1:]) != (num_v_heads, k_dim, v_dim) or not ssm_pool.is_contiguous():
        raise ValueError(f"ssm_pool {tuple(ssm_pool.shape)} must be contiguous [num_slots, {num_v_heads}, {k_dim}, "
                         f"{v_dim}]")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("q, k and v need unit stride on their last dim")
    check_verify_rows(num_seqs, cu_seqlens, context_lens, draft_table, num_drafts)
    if g.dtype != torch.float32:
        raise ValueError(f"g must be fp32 (the log decay), got {g.dtype}")
    g, beta = g.contiguous(), beta.contiguous()
    out = None if states_only else torch.empty(num_tokens, num_v_heads, v_dim, dtype=q.dtype, device=q.device)
    if num_seqs == 0 or num_tokens == 0:
        return out
    block_k, block_v = head_tiles(k_dim, v_dim, _BLOCK_V)
    out_arg = out if out is not None else v  # never written in states-only mode
    _gdn_verify_kernel[(num_seqs, num_v_heads, triton.cdiv(v_dim, block_v))](
        q, k, v, g, beta, out_arg, ssm_pool, state_slots, cu_seqlens, context_lens, draft_table, num_drafts,
        k_dim**-0.5,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0),
        out_arg.stride(0), out_arg.stride(1), ssm_pool.stride(0), ssm_pool.stride(1), ssm_pool.stride(2),
        draft_table.stride(0),
        RATIO=num_v_heads // num_k_heads, DK=k_dim, DV=v_dim, BLOCK_K=block_k, BLOCK_V=block_v, L2NORM=use_qk_l2norm,
        STATES_ONLY=states_only, ROUND=ssm_pool.dtype != torch.float32,
    )
    return out
