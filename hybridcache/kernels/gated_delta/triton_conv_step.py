"""One decode step of gated DeltaNet's core in one Triton launch: the causal conv's step, the gates and the gated
delta rule, reading and writing both state pools in place (the two launches `conv.triton.causal_conv1d_decode` +
`triton_step.gated_delta_rule_decode(..., gates=...)`, with the same bits).

One program per (sequence n, key head j) owns everything that key head touches:

    mixed_qkv[n]:  | q_0 .. q_j .. (Hk x Dk) | k_0 .. k_j .. (Hk x Dk) | v_0 .. v_{rj} .. v_{rj+r-1} .. (Hv x Dv) |
                           ^ conv'd once          ^ conv'd once                  ^ r = Hv / Hk value heads, a
                                                                                   [Dk, BLOCK_V] state tile each
                                                                                   block of BLOCK_V columns

q_j and k_j (and their conv state rows) are read and written by this program alone, so the conv state is shifted
exactly once per channel with no ordering between programs (a grid over value heads would need one: another
program could read the q/k rows after their writer shifted them). The program then walks its r * Dv / BLOCK_V
state tiles [Dk, BLOCK_V] in order; with PREFETCH the next tile's load is issued before the current one's
update and store (software pipelining by hand: two tiles in registers), so the loads of one tile overlap the
arithmetic and the stores of the one before; with STAGES > 1 Triton's pipeliner copies the next tiles into shared
memory ahead instead (cp.async); UNROLL unrolls the tile loop. HOIST issues the loads of every tile's v columns
and gates (and, unrolled, of the first state tile) in the prologue, beside q's and k's: the conv state rows are
cold, and their round trip would otherwise wait on the tile before. Without FUSE_CONV the program reads q, k, v from
a conv output of the same layout instead (the step alone, for the launch sweep).

Same math as `reference.gated_delta_rule_step` after `conv/reference.causal_conv1d_step` (see triton_step.py);
the conv output is rounded to x's dtype before use, as the two-launch path rounds it when it stores it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridcache.kernels.conv.triton import conv_step_channels
from hybridcache.kernels.gated_delta.triton_gates import gate_values
from hybridcache.kernels.gated_delta.triton_step import delta_rule_update

# The launch: [Dk, 64] tiles, 4 warps, the next tile prefetched in registers (a loop, not unrolled), v and the
# gates loaded in the prologue, streaming hints as `triton_step`: 78.6 us for 64 x 32 heads, the fastest of nine
# launches on the H200 (unrolled 80.6-84.5, [Dk, 32] tiles 89.6-94.4; docs/bench.md, session 44, dec17a)
_BLOCK_V = 64
_NUM_WARPS = 4
_PREFETCH = True
_UNROLL = False
_STAGES = 1
_HOIST = True
_HEADS_FIRST = False
_STREAM = True


@triton.jit
def key_head_inputs(x_row, w_ptr, bias_ptr, conv_row, chans, width, stride_cc, stride_cw, K: tl.constexpr,
                    BLOCK_W: tl.constexpr, HAS_BIAS: tl.constexpr, FUSE_CONV: tl.constexpr):
    """Channels `chans` of the conv's output for one sequence in fp32, rounded to x's dtype first: with FUSE_CONV
    the conv's step over x_row (the pre-conv inputs; the conv state row `conv_row` shifted in place), else x_row
    is already the conv's output."""
    if FUSE_CONV:
        out = conv_step_channels(x_row, w_ptr, bias_ptr, conv_row, chans, chans >= 0, width, stride_cc, stride_cw,
                                 K, BLOCK_W, HAS_BIAS, True)
        return out.to(x_row.dtype.element_ty).to(tl.float32)
    return tl.load(x_row + chans).to(tl.float32)


@triton.jit
def head_gates(a, b, a_log, dt_bias, b_ptr):
    """A value head's gates from its loaded a, b, A_log, dt_bias (scalars or vectors): g in fp32 and beta rounded to
    b's dtype, as the step kernel makes them (`triton_gates.gate_values`: the same bits)."""
    g, beta = gate_values(a.to(tl.float32), b.to(tl.float32), a_log.to(tl.float32), dt_bias.to(tl.float32))
    return g, beta.to(b_ptr.dtype.element_ty).to(tl.float32)


@triton.jit
def tile_values(t, key_head, seq, x_row, conv_row, width, cols, w_ptr, bias_ptr, a_ptr, b_ptr, alog_ptr, dt_ptr,
                stride_an, stride_bn, stride_cc, stride_cw, KEY_DIM: tl.constexpr, RATIO: tl.constexpr,
                DV: tl.constexpr, BLOCK_V: tl.constexpr, K: tl.constexpr, BLOCK_W: tl.constexpr,
                HAS_BIAS: tl.constexpr, FUSE_CONV: tl.constexpr):
    """Tile t's v columns [BLOCK_V] (conv'd when FUSE_CONV) and its value head's gates (g, beta)."""
    NV: tl.constexpr = DV // BLOCK_V
    head = key_head * RATIO + t // NV
    bv = key_head_inputs(x_row, w_ptr, bias_ptr, conv_row, 2 * KEY_DIM + head * DV + (t % NV) * BLOCK_V + cols,
                         width, stride_cc, stride_cw, K, BLOCK_W, HAS_BIAS, FUSE_CONV)
    bg, bb = head_gates(tl.load(a_ptr + seq * stride_an + head), tl.load(b_ptr + seq * stride_bn + head),
                        tl.load(alog_ptr + head), tl.load(dt_ptr + head), b_ptr)
    return bv, bg, bb


@triton.jit
def program_values(key_head, seq, x_row, conv_row, width, w_ptr, bias_ptr, a_ptr, b_ptr, alog_ptr, dt_ptr,
                   stride_an, stride_bn, stride_cc, stride_cw, KEY_DIM: tl.constexpr, RATIO: tl.constexpr,
                   DV: tl.constexpr, NT: tl.constexpr, BLOCK_V: tl.constexpr, K: tl.constexpr,
                   BLOCK_W: tl.constexpr, HAS_BIAS: tl.constexpr, FUSE_CONV: tl.constexpr):
    """All of the program's v columns at once, [NT, BLOCK_V] (row t: tile t's), and its RATIO value heads' gates
    g, beta [RATIO] (HOIST: their loads issued together in the prologue, after the first state tile's)."""
    v = key_head_inputs(x_row, w_ptr, bias_ptr, conv_row, 2 * KEY_DIM + key_head * RATIO * DV
                        + tl.arange(0, NT * BLOCK_V), width, stride_cc, stride_cw, K, BLOCK_W, HAS_BIAS, FUSE_CONV)
    heads = key_head * RATIO + tl.arange(0, RATIO)
    g, beta = head_gates(tl.load(a_ptr + seq * stride_an + heads), tl.load(b_ptr + seq * stride_bn + heads),
                         tl.load(alog_ptr + heads), tl.load(dt_ptr + heads), b_ptr)
    return tl.reshape(v, (NT, BLOCK_V)), g, beta


@triton.jit
def pick_tile(v_all, g_all, beta_all, t, NT: tl.constexpr, NV: tl.constexpr, RATIO: tl.constexpr):
    """Tile t's v columns and gates out of `program_values`' blocks (each a sum whose other terms are zeros: the
    values themselves)."""
    bv = tl.sum(tl.where((tl.arange(0, NT) == t)[:, None], v_all, 0.0), axis=0)
    head = tl.arange(0, RATIO) == t // NV
    return bv, tl.sum(tl.where(head, g_all, 0.0)), tl.sum(tl.where(head, beta_all, 0.0))


@triton.jit
def tile_update(state, t, key_head, seq, bq, bk, bv, bg, bb, state_base, cols, out_ptr, pool_ptr, stride_on,
                stride_oh, stride_ph, RATIO: tl.constexpr, DV: tl.constexpr, BLOCK_V: tl.constexpr,
                STREAM: tl.constexpr):
    """The program's tile t, its state [DK, BLOCK_V] loaded: the update; stores the output columns and the new
    state tile."""
    NV: tl.constexpr = DV // BLOCK_V
    state = delta_rule_update(state.to(tl.float32), bk, bv, bg, bb)  # [DK, BLOCK_V]
    out = tl.sum(state * bq[:, None], axis=0)
    head = key_head * RATIO + t // NV
    tl.store(out_ptr + seq * stride_on + head * stride_oh + (t % NV) * BLOCK_V + cols,
             out.to(out_ptr.dtype.element_ty))
    state_ptrs = state_base + (t // NV) * stride_ph + (t % NV) * BLOCK_V
    if STREAM:
        tl.store(state_ptrs, state.to(pool_ptr.dtype.element_ty), cache_modifier=".cs")
    else:
        tl.store(state_ptrs, state.to(pool_ptr.dtype.element_ty))


@triton.jit
def _conv_gdn_step_kernel(
    x_ptr, w_ptr, bias_ptr, conv_ptr, a_ptr, b_ptr, alog_ptr, dt_ptr, out_ptr, pool_ptr, slots_ptr, ctx_ptr, scale,
    stride_xn, stride_an, stride_bn, stride_on, stride_oh, stride_cs, stride_cc, stride_cw,
    stride_ps, stride_ph, stride_pk,
    KEY_DIM: tl.constexpr, RATIO: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_V: tl.constexpr,
    K: tl.constexpr, BLOCK_W: tl.constexpr, HAS_BIAS: tl.constexpr, L2NORM: tl.constexpr,
    FUSE_CONV: tl.constexpr, PREFETCH: tl.constexpr, STREAM: tl.constexpr, UNROLL: tl.constexpr = False,
    STAGES: tl.constexpr = 1, HOIST: tl.constexpr = False, HEADS_FIRST: tl.constexpr = False,
):
    seq = tl.program_id(1 if HEADS_FIRST else 0).to(tl.int64)  # HEADS_FIRST: grid (Hk, N), a state's key heads
    key_head = tl.program_id(0 if HEADS_FIRST else 1)  # in neighbouring programs
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    old = (tl.load(ctx_ptr + seq) != 1).to(tl.int32)  # 0 for a fresh sequence: both its states read as zeros
    rows_to_read = DK * old
    ks = tl.arange(0, DK)
    cols = tl.arange(0, BLOCK_V)
    NV: tl.constexpr = DV // BLOCK_V
    NT: tl.constexpr = RATIO * NV  # the program's state tiles: tile t is value head j r + t // NV, columns t % NV
    state_base = pool_ptr + slot * stride_ps + key_head * RATIO * stride_ph + ks[:, None] * stride_pk + cols[None, :]
    load_mask = (ks < rows_to_read)[:, None]
    evict: tl.constexpr = "evict_first" if STREAM else ""
    if PREFETCH or (UNROLL and HOIST):  # the first tile's load before the prologue (whose conv-state stores would
        nxt = tl.load(state_base, mask=load_mask, other=0.0, eviction_policy=evict)  # hold it back)

    x_row = x_ptr + seq * stride_xn
    conv_row = conv_ptr + slot * stride_cs
    width = (K - 1) * old
    bq = key_head_inputs(x_row, w_ptr, bias_ptr, conv_row, key_head * DK + ks, width, stride_cc, stride_cw, K,
                         BLOCK_W, HAS_BIAS, FUSE_CONV)
    bk = key_head_inputs(x_row, w_ptr, bias_ptr, conv_row, KEY_DIM + key_head * DK + ks, width, stride_cc,
                         stride_cw, K, BLOCK_W, HAS_BIAS, FUSE_CONV)
    if HOIST:
        v_all, g_all, beta_all = program_values(key_head, seq, x_row, conv_row, width, w_ptr, bias_ptr, a_ptr, b_ptr,
                                                alog_ptr, dt_ptr, stride_an, stride_bn, stride_cc, stride_cw, KEY_DIM,
                                                RATIO, DV, NT, BLOCK_V, K, BLOCK_W, HAS_BIAS, FUSE_CONV)
    if L2NORM:
        bq = bq / tl.sqrt(tl.sum(bq * bq) + 1e-6)
        bk = bk / tl.sqrt(tl.sum(bk * bk) + 1e-6)
    bq = bq * scale

    if UNROLL:  # the tiles' code unrolled: the prefetch's last-tile test is resolved when compiling (with HOIST the
        # first tile is the one loaded above)
        for t in tl.static_range(NT):
            if PREFETCH:
                state = nxt
                if t + 1 < NT:
                    nxt = tl.load(state_base + ((t + 1) // NV) * stride_ph + ((t + 1) % NV) * BLOCK_V,
                                  mask=load_mask, other=0.0, eviction_policy=evict)
            elif HOIST and t == 0:
                state = nxt
            else:
                state = tl.load(state_base + (t // NV) * stride_ph + (t % NV) * BLOCK_V, mask=load_mask, other=0.0,
                                eviction_policy=evict)
            if HOIST:
                bv, bg, bb = pick_tile(v_all, g_all, beta_all, t, NT, NV, RATIO)
            else:
                bv, bg, bb = tile_values(t, key_head, seq, x_row, conv_row, width, cols, w_ptr, bias_ptr, a_ptr,
                                         b_ptr, alog_ptr, dt_ptr, stride_an, stride_bn, stride_cc, stride_cw,
                                         KEY_DIM, RATIO, DV, BLOCK_V, K, BLOCK_W, HAS_BIAS, FUSE_CONV)
            tile_update(state, t, key_head, seq, bq, bk, bv, bg, bb, state_base, cols, out_ptr, pool_ptr, stride_on,
                        stride_oh, stride_ph, RATIO, DV, BLOCK_V, STREAM)
    else:  # a loop: one tile's code (and registers) at a time; STAGES > 1: Triton's pipeliner copies the next
        # tiles into shared memory ahead (cp.async) instead of PREFETCH's registers
        for t in tl.range(NT, num_stages=STAGES):
            if PREFETCH:  # the next tile's load before this one's update (none after the last: masked off)
                state = nxt
                nxt = tl.load(state_base + ((t + 1) // NV) * stride_ph + ((t + 1) % NV) * BLOCK_V,
                              mask=load_mask & (t + 1 < NT), other=0.0, eviction_policy=evict)
            else:
                state = tl.load(state_base + (t // NV) * stride_ph + (t % NV) * BLOCK_V, mask=load_mask, other=0.0,
                                eviction_policy=evict)
            if HOIST:
                bv, bg, bb = pick_tile(v_all, g_all, beta_all, t, NT, NV, RATIO)
            else:
                bv, bg, bb = tile_values(t, key_head, seq, x_row, conv_row, width, cols, w_ptr, bias_ptr, a_ptr,
                                         b_ptr, alog_ptr, dt_ptr, stride_an, stride_bn, stride_cc, stride_cw,
                                         KEY_DIM, RATIO, DV, BLOCK_V, K, BLOCK_W, HAS_BIAS, FUSE_CONV)
            tile_update(state, t, key_head, seq, bq, bk, bv, bg, bb, state_base, cols, out_ptr, pool_ptr, stride_on,
                        stride_oh, stride_ph, RATIO, DV, BLOCK_V, STREAM)


def conv_gated_delta_decode(
    mixed_qkv: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    conv_pool: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    gates: tuple[torch.Tensor, torch.Tensor],
    ssm_pool: torch.Tensor,
    state_slots: torch.Tensor,
    context_lens: torch.Tensor,
    *,
    num_k_heads: int,
    use_qk_l2norm: bool = True,
    fuse_conv: bool = True,
) -> torch.Tensor:
    """One token for each of N sequences through the conv (SiLU), the gates and the gated delta rule, in one launch;
    conv_pool[state_slots] and ssm_pool[state_slots] are updated in place. The results (output, both states) are
    those of `causal_conv1d_decode(mixed_qkv, ...)`, then q, k, v split from its output and
    `gated_delta_rule_decode(q, k, v, a, b, ..., gates=gates)`.

    mixed_qkv [N, C] (unit stride on C; C = 2 Hk Dk + Hv Dv: q of every key head | k | v of every value head);
    conv_weight [C, K] contiguous; conv_bias [C] or None; conv_pool [num_slots, C, K-1]; a, b [N, Hv] (strided
    rows allowed); gates (A_log, dt_bias [Hv]); ssm_pool [num_slots, Hv, Dk, Dv] (unit stride on Dv), whose shape
    gives Hv, Dk and Dv; state_slots [N] distinct; context_lens [N] (1 = fresh: both states read as zeros).
    Dk and Dv must be powers of two. `fuse_conv=False`: mixed_qkv is already the conv's output (the step alone;
    conv_pool is then untouched). Returns out [N, Hv, Dv] in mixed_qkv's dtype.
    """
    num, channels = mixed_qkv.shape
    num_v_heads, k_dim, v_dim = ssm_pool.shape[1:]
    key_dim = num_k_heads * k_dim
    if k_dim & (k_dim - 1) or v_dim & (v_dim - 1):
        raise ValueError(f"head dims must be powers of two, got Dk={k_dim}, Dv={v_dim}")
    if channels != 2 * key_dim + num_v_heads * v_dim or num_v_heads % num_k_heads:
        raise ValueError(f"mixed_qkv has {channels} channels; {num_k_heads} key heads of {k_dim} and {num_v_heads} "
                         f"value heads of {v_dim} need {2 * key_dim + num_v_heads * v_dim}")
    if mixed_qkv.stride(-1) != 1 or ssm_pool.stride(-1) != 1 or not conv_weight.is_contiguous():
        raise ValueError("mixed_qkv and ssm_pool need unit stride on their last dim, conv_weight [C, K] contiguous")
    kernel_size = conv_weight.shape[1]
    if conv_pool.shape[-1] != kernel_size - 1:
        raise ValueError(f"conv_pool width {conv_pool.shape[-1]} != kernel size {kernel_size} - 1")
    if a.stride(-1) != 1 or b.stride(-1) != 1:
        a, b = a.contiguous(), b.contiguous()
    a_log, dt_bias = gates
    out = torch.empty(num, num_v_heads, v_dim, dtype=mixed_qkv.dtype, device=mixed_qkv.device)
    if num == 0:
        return out
    block_v = min(_BLOCK_V, v_dim)
    ratio = num_v_heads // num_k_heads
    _conv_gdn_step_kernel[(num_k_heads, num) if _HEADS_FIRST else (num, num_k_heads)](
        mixed_qkv, conv_weight, conv_bias if conv_bias is not None else conv_weight, conv_pool, a, b, a_log, dt_bias,
        out, ssm_pool, state_slots, context_lens, k_dim**-0.5,
        mixed_qkv.stride(0), a.stride(0), b.stride(0), out.stride(0), out.stride(1), *conv_pool.stride(),
        ssm_pool.stride(0), ssm_pool.stride(1), ssm_pool.stride(2),
        KEY_DIM=key_dim, RATIO=ratio, DK=k_dim, DV=v_dim, BLOCK_V=block_v, K=kernel_size,
        BLOCK_W=triton.next_power_of_2(kernel_size - 1), HAS_BIAS=conv_bias is not None, L2NORM=use_qk_l2norm,
        FUSE_CONV=fuse_conv, PREFETCH=_PREFETCH, STREAM=_STREAM, UNROLL=_UNROLL, STAGES=_STAGES,
        HOIST=_HOIST and ratio & (ratio - 1) == 0, HEADS_FIRST=_HEADS_FIRST, num_warps=_NUM_WARPS,
    )
    return out
