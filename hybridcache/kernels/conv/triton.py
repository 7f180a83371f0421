"""Causal depthwise conv1d of gated DeltaNet on CUDA (Triton), varlen, with conv state read from and written
to the state pool by slot (same math as `conv/reference.py`).

Layouts: x [T, C] (rows of all sequences, cu_seqlens), weight [C, K], bias [C] or None,
conv_pool [num_slots, C, K-1] (the last K-1 pre-convolution inputs of each slot, oldest first).

Prefill (`causal_conv1d_varlen`), two launches:
  1. one program per (sequence, block of BLOCK_T rows, block of BLOCK_C channels): output row t of a
     sequence reads inputs at positions t-K+1 .. t; a position < 0 comes from the slot's old state (or 0 for a
     fresh sequence, context_len == query_len). For K <= 4 (every model here) `_conv_varlen_rows_kernel` walks
     its rows one at a time and keeps the K - 1 inputs before the current row in registers, so each input row is
     read once: e.g. K = 4, rows 64..127 of a sequence: it loads rows 61, 62, 63, then row 64 gives out[64] from
     61..64, row 65 gives out[65] from 62..65 (61 dropped), and so on. `_conv_varlen_kernel` (any K) loads K
     shifted [BLOCK_T, BLOCK_C] tiles instead, 1.8x slower at phase D's shape (docs/bench.md, session 47);
  2. one program per (sequence, channel block) writes the new state, the last K-1 of (old state ++ x), in place.
  The second launch runs after the first, so no program reads a state row another has already rewritten.
Decode (`causal_conv1d_decode`): one token per sequence, one launch; each program owns its (slot, channels)
rows, reads the state, writes the output and the shifted state; with `gates` (LFM2's B and C) it also multiplies
its input and output by them, so the gated short convolution's step is one launch instead of three.

Accumulation is fp32; the output is rounded once to x's dtype (the reference rounds each product in bf16,
so bf16 results differ by about one bf16 ulp).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from hybridcache.kernels import pdl
from hybridcache.kernels.varlen import chunk_indices as make_chunk_indices

_BLOCK_T = 64
_BLOCK_C = 128
_PREFILL_BLOCK_C, _PREFILL_WARPS = _BLOCK_C, 4  # the prefill conv's channels per program and warps
_ROWS_BLOCK_C, _ROWS_WARPS = 512, 4  # the row-at-a-time prefill conv's (K <= 4): 210 us a phase-D layer (sweep)
_STEP_BLOCK_C = 256  # the decode step's channels per program: 64 x 8,192 channels in 4.52 us against 4.94 at 128
# (the fastest of 8 launches on the H200; docs/bench.md, issue 32's sixth pass)


@triton.jit
def chunk_sequence(chunk_ptr, cu_ptr, ctx_ptr, slots_ptr, W: tl.constexpr):
    """The rows of a program of grid (chunk table entries, C / BLOCK_C): returns (its row block within the
    sequence, the sequence's first row bos in x, its query_len, state_lo, its slot). Old-state taps are positions
    in [state_lo, 0): state_lo is -W, or 0 for a fresh sequence (context_len == query_len)."""
    pid_t = tl.program_id(0)
    seq = tl.load(chunk_ptr + 2 * pid_t).to(tl.int64)
    block = tl.load(chunk_ptr + 2 * pid_t + 1).to(tl.int64)
    bos = tl.load(cu_ptr + seq).to(tl.int64)
    query_len = tl.load(cu_ptr + seq + 1).to(tl.int64) - bos
    state_lo = -W * (tl.load(ctx_ptr + seq).to(tl.int64) != query_len).to(tl.int64)
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    return block, bos, query_len, state_lo, slot


@triton.jit
def _conv_varlen_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, pool_ptr, slots_ptr, cu_ptr, ctx_ptr, chunk_ptr,
    stride_xt, stride_ot, stride_ps, stride_pc, stride_pw, num_channels,
    K: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):
    pid_c = tl.program_id(1)
    block, bos, query_len, state_lo, slot = chunk_sequence(chunk_ptr, cu_ptr, ctx_ptr, slots_ptr, K - 1)
    rows = block * BLOCK_T + tl.arange(0, BLOCK_T)  # positions within the sequence
    chans = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    row_ok = rows < query_len
    chan_ok = chans < num_channels
    acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    for j in tl.static_range(K):
        src = rows - (K - 1) + j  # input position read by tap j; < 0 means the old state
        xv = tl.load(
            x_ptr + (bos + src)[:, None] * stride_xt + chans[None, :],
            mask=((src >= 0) & row_ok)[:, None] & chan_ok[None, :], other=0.0,
        ).to(tl.float32)
        acc += xv * tl.load(w_ptr + chans * K + j, mask=chan_ok, other=0.0).to(tl.float32)[None, :]
    if block * BLOCK_T + state_lo < 0:  # only the first block of a continuing sequence reads the old state
        for j in tl.static_range(K - 1):
            src = rows - (K - 1) + j
            sv = tl.load(
                pool_ptr + slot * stride_ps + chans[None, :] * stride_pc + (src + K - 1)[:, None] * stride_pw,
                mask=((src < 0) & row_ok)[:, None] & chan_ok[None, :], other=0.0,
            ).to(tl.float32)
            acc += sv * tl.load(w_ptr + chans * K + j, mask=chan_ok, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + chans, mask=chan_ok, other=0.0).to(tl.float32)[None, :]
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(
        out_ptr + (bos + rows)[:, None] * stride_ot + chans[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & chan_ok[None, :],
    )


@triton.jit
def _tap_input(x_ptr, pool_ptr, bos, slot, src, query_len, state_lo, chans, chan_ok, stride_xt, stride_ps,
               stride_pc, stride_pw, W: tl.constexpr):
    """The conv input at sequence position `src` for the program's channels, fp32 [BLOCK_C]: x row bos + src
    for 0 <= src < query_len, the slot's old state entry W + src for state_lo <= src < 0, else 0."""
    src = src + 0 * chans  # a vector, so the masks below are per channel
    from_x = (src >= 0) & (src < query_len)
    xv = tl.load(x_ptr + (bos + src) * stride_xt + chans, mask=chan_ok & from_x, other=0.0)
    from_state = (src < 0) & (src >= state_lo)
    sv = tl.load(pool_ptr + slot * stride_ps + chans * stride_pc + (src + W) * stride_pw,
                 mask=chan_ok & from_state, other=0.0)
    return xv.to(tl.float32) + sv.to(tl.float32)


@triton.jit
def _conv_varlen_rows_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, pool_ptr, slots_ptr, cu_ptr, ctx_ptr, chunk_ptr,
    stride_xt, stride_ot, stride_ps, stride_pc, stride_pw, num_channels,
    K: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """The prefill conv for K <= 4 taps, one input row at a time: a program owns BLOCK_T rows of one sequence
    (a chunk table entry) and BLOCK_C channels, keeps the K - 1 inputs before the current row in registers and
    reads each of its rows once (`_conv_varlen_kernel` reads each K times). Taps are summed oldest first, as
    there, so fresh sequences get its bits; a continuing sequence's first rows may differ in the last place (there
    the old state's taps are added after the new inputs')."""
    pid_c = tl.program_id(1)
    block, bos, query_len, state_lo, slot = chunk_sequence(chunk_ptr, cu_ptr, ctx_ptr, slots_ptr, K - 1)
    chans = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    chan_ok = chans < num_channels
    first = block * BLOCK_T
    # p1, p2, p3: the inputs 1, 2 and 3 rows before the current one (only K - 1 of them are used)
    p1 = _tap_input(x_ptr, pool_ptr, bos, slot, first - 1, query_len, state_lo, chans, chan_ok, stride_xt,
                    stride_ps, stride_pc, stride_pw, K - 1)
    p2 = p1
    p3 = p1
    if K >= 3:
        p2 = _tap_input(x_ptr, pool_ptr, bos, slot, first - 2, query_len, state_lo, chans, chan_ok, stride_xt,
                        stride_ps, stride_pc, stride_pw, K - 1)
    if K >= 4:
        p3 = _tap_input(x_ptr, pool_ptr, bos, slot, first - 3, query_len, state_lo, chans, chan_ok, stride_xt,
                        stride_ps, stride_pc, stride_pw, K - 1)
    w_last = tl.load(w_ptr + chans * K + (K - 1), mask=chan_ok, other=0.0).to(tl.float32)
    w1 = tl.load(w_ptr + chans * K + (K - 2), mask=chan_ok, other=0.0).to(tl.float32)
    w2 = w1
    w3 = w1
    if K >= 3:
        w2 = tl.load(w_ptr + chans * K + (K - 3), mask=chan_ok, other=0.0).to(tl.float32)
    if K >= 4:
        w3 = tl.load(w_ptr + chans * K + (K - 4), mask=chan_ok, other=0.0).to(tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + chans, mask=chan_ok, other=0.0).to(tl.float32)
    rows = tl.minimum(query_len - first, BLOCK_T)
    for i in range(rows):
        row = bos + first + i
        cur = tl.load(x_ptr + row * stride_xt + chans, mask=chan_ok, other=0.0).to(tl.float32)
        acc = tl.zeros([BLOCK_C], dtype=tl.float32)
        if K >= 4:
            acc += p3 * w3
        if K >= 3:
            acc += p2 * w2
        acc += p1 * w1
        acc += cur * w_last
        if HAS_BIAS:
            acc += bias
        if SILU:
            acc = acc * tl.sigmoid(acc)
        tl.store(out_ptr + row * stride_ot + chans, acc.to(out_ptr.dtype.element_ty), mask=chan_ok)
        p3 = p2
        p2 = p1
        p1 = cur


@triton.jit
def state_sequence(slots_ptr, cu_ptr, ctx_ptr, W: tl.constexpr):
    """The sequence of a program of grid (S, C / BLOCK_C) that writes conv states: returns (seq, the program's
    channel block, the sequence's first row bos in x, its query_len, state_lo, its slot); state_lo is -W, or 0 for
    a fresh sequence (context_len == query_len: no old entries). Shared by `_conv_state_kernel` and
    `triton_verify`'s draft-state kernel."""
    seq = tl.program_id(0).to(tl.int64)
    pid_c = tl.program_id(1)
    bos = tl.load(cu_ptr + seq).to(tl.int64)
    query_len = tl.load(cu_ptr + seq + 1).to(tl.int64) - bos
    state_lo = -W * (tl.load(ctx_ptr + seq).to(tl.int64) != query_len).to(tl.int64)
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    return seq, pid_c, bos, query_len, state_lo, slot


@triton.jit
def state_entries(x_ptr, pool_ptr, bos, slot, src, state_lo, chans, ok, stride_xt, stride_ps, stride_pc, stride_pw,
                  W: tl.constexpr):
    """Conv state entries [BLOCK_C, BLOCK_W] in fp32: column col is the sequence's input at position src[col]
    (x row bos + src), or for src < 0 the old state's entry W + src of the slot's pool row (0 below state_lo).
    Each entry is a copy of one input (the other term is 0), so exact in every dtype."""
    xv = tl.load(x_ptr + (bos + src)[None, :] * stride_xt + chans[:, None], mask=ok & (src >= 0)[None, :], other=0.0)
    state_row = pool_ptr + slot * stride_ps + chans[:, None] * stride_pc
    from_state = (src < 0) & (src >= state_lo)
    sv = tl.load(state_row + (src + W)[None, :] * stride_pw, mask=ok & from_state[None, :], other=0.0)
    return xv.to(tl.float32) + sv.to(tl.float32)


@triton.jit
def _conv_state_kernel(
    x_ptr, pool_ptr, slots_ptr, cu_ptr, ctx_ptr,
    stride_xt, stride_ps, stride_pc, stride_pw, num_channels,
    W: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_C: tl.constexpr,
):
    _, pid_c, bos, query_len, state_lo, slot = state_sequence(slots_ptr, cu_ptr, ctx_ptr, W)
    chans = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    cols = tl.arange(0, BLOCK_W)
    ok = (chans < num_channels)[:, None] & (cols < W)[None, :]
    src = query_len - W + cols  # sequence position that becomes state entry `col`
    new_state = state_entries(x_ptr, pool_ptr, bos, slot, src, state_lo, chans, ok, stride_xt, stride_ps, stride_pc,
                              stride_pw, W)
    tl.store(pool_ptr + slot * stride_ps + chans[:, None] * stride_pc + cols[None, :] * stride_pw,
             new_state.to(pool_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _conv_step_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, pool_ptr, slots_ptr, ctx_ptr, in_gate_ptr, out_gate_ptr,
    stride_xn, stride_on, stride_gn, stride_ps, stride_pc, stride_pw, num_channels,
    K: tl.constexpr, BLOCK_W: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, GATED: tl.constexpr,
    BLOCK_C: tl.constexpr, PDL: tl.constexpr,
):
    """GATED: the input is in_gate * x and the output out_gate * conv, each product rounded to x's dtype as torch
    rounds `b * x` and `c * conv` (LFM2's short convolution: the state keeps in_gate * x)."""
    pdl.start(PDL)
    seq = tl.program_id(0).to(tl.int64)
    pid_c = tl.program_id(1)
    width = (K - 1) * (tl.load(ctx_ptr + seq) != 1).to(tl.int32)  # old entries to read: none when fresh
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    chans = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    chan_ok = chans < num_channels
    cols = tl.arange(0, BLOCK_W)
    col_ok = cols < K - 1
    state_row = pool_ptr + slot * stride_ps + chans[:, None] * stride_pc
    old = tl.load(state_row + cols[None, :] * stride_pw, mask=chan_ok[:, None] & (cols < width)[None, :],
                  other=0.0).to(tl.float32)
    shifted = tl.load(state_row + (cols + 1)[None, :] * stride_pw,
                      mask=chan_ok[:, None] & (cols + 1 < width)[None, :], other=0.0)
    xv = tl.load(x_ptr + seq * stride_xn + chans, mask=chan_ok, other=0.0)
    if GATED:
        gate = tl.load(in_gate_ptr + seq * stride_gn + chans, mask=chan_ok, other=0.0)
        xv = (xv.to(tl.float32) * gate.to(tl.float32)).to(x_ptr.dtype.element_ty)
    w_old = tl.load(w_ptr + chans[:, None] * K + cols[None, :], mask=chan_ok[:, None] & col_ok[None, :],
                    other=0.0).to(tl.float32)
    w_new = tl.load(w_ptr + chans * K + (K - 1), mask=chan_ok, other=0.0).to(tl.float32)
    acc = tl.sum(old * w_old, axis=1) + xv.to(tl.float32) * w_new
    if HAS_BIAS:
        acc += tl.load(bias_ptr + chans, mask=chan_ok, other=0.0).to(tl.float32)
    if SILU:
        acc = acc * tl.sigmoid(acc)
    out = acc.to(out_ptr.dtype.element_ty)
    if GATED:
        gate = tl.load(out_gate_ptr + seq * stride_gn + chans, mask=chan_ok, other=0.0)
        out = (out.to(tl.float32) * gate.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + seq * stride_on + chans, out, mask=chan_ok)
    new_state = tl.where((cols == K - 2)[None, :], xv[:, None].to(pool_ptr.dtype.element_ty),
                         shifted.to(pool_ptr.dtype.element_ty))
    tl.store(state_row + cols[None, :] * stride_pw, new_state, mask=chan_ok[:, None] & col_ok[None, :])


def _check(x: torch.Tensor, weight: torch.Tensor, conv_pool: torch.Tensor, activation: str | None) -> None:
    if activation not in (None, "silu"):
        raise ValueError(f"unsupported activation {activation!r}")
    if x.stride(-1) != 1 or not weight.is_contiguous():
        raise ValueError("x needs unit stride over channels and weight [C, K] must be contiguous")
    if weight.shape[1] < 2 or conv_pool.shape[-1] != weight.shape[1] - 1:
        raise ValueError(f"conv_pool width {conv_pool.shape[-1]} != kernel size {weight.shape[1]} - 1")


def causal_conv1d_varlen(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_pool: torch.Tensor,
    state_slots: torch.Tensor,
    cu_seqlens: torch.Tensor,
    context_lens: torch.Tensor,
    query_lens_cpu: Sequence[int],
    *,
    activation: str | None = "silu",
    chunk_indices: torch.Tensor | None = None,
) -> torch.Tensor:
    """Conv of every sequence of a varlen batch; updates conv_pool[state_slots] in place.

    x [T, C]; weight [C, K]; bias [C] or None; conv_pool [num_slots, C, K-1]; state_slots [S] int;
    cu_seqlens [S+1]; context_lens [S] (fresh sequences, context_len == query_len, start from zeros);
    query_lens_cpu: host lengths (for the grid); chunk_indices: `varlen.chunk_indices(cu_seqlens, query_lens_cpu,
    64)` if already built. Returns out [T, C] in x's dtype. Slots must be distinct.
    """
    _check(x, weight, conv_pool, activation)
    num_tokens, channels = x.shape
    kernel_size = weight.shape[1]
    out = torch.empty(num_tokens, channels, dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    if chunk_indices is None:
        chunk_indices = make_chunk_indices(cu_seqlens, query_lens_cpu, _BLOCK_T)
    grid_c = triton.cdiv(channels, _BLOCK_C)
    pool_strides = conv_pool.stride()
    rows = kernel_size <= 4
    block_c, warps = (_ROWS_BLOCK_C, _ROWS_WARPS) if rows else (_PREFILL_BLOCK_C, _PREFILL_WARPS)
    kernel = _conv_varlen_rows_kernel if rows else _conv_varlen_kernel
    kernel[(chunk_indices.shape[0], triton.cdiv(channels, block_c))](
        x, weight, bias if bias is not None else weight, out, conv_pool, state_slots, cu_seqlens, context_lens,
        chunk_indices, x.stride(0), out.stride(0), *pool_strides, channels,
        K=kernel_size, HAS_BIAS=bias is not None, SILU=activation == "silu", BLOCK_T=_BLOCK_T,
        BLOCK_C=block_c, num_warps=warps,
    )
    _conv_state_kernel[(len(query_lens_cpu), grid_c)](
        x, conv_pool, state_slots, cu_seqlens, context_lens, x.stride(0), *pool_strides, channels,
        W=kernel_size - 1, BLOCK_W=triton.next_power_of_2(kernel_size - 1), BLOCK_C=_BLOCK_C,
    )
    return out


def causal_conv1d_decode(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_pool: torch.Tensor,
    state_slots: torch.Tensor,
    context_lens: torch.Tensor,
    *,
    activation: str | None = "silu",
    gates: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """One new token per sequence: x [N, C] -> out [N, C]; conv_pool[state_slots] shifted in place.

    A sequence with context_len == 1 is fresh (its old state is read as zeros). Slots must be distinct.
    gates (b, c), each [N, C] with unit channel stride and one row stride (column views of one GEMM output, as
    LFM2's B and C): out = c * conv(b * x), the state keeping b * x, each product rounded to x's dtype (torch's
    `c * conv(b * x)` bit for bit).
    """
    _check(x, weight, conv_pool, activation)
    if gates is not None and not all(g.shape == x.shape and g.stride() == gates[0].stride() and g.stride(-1) == 1
                                     for g in gates):
        raise ValueError("gates must be two tensors of x's shape with unit stride over channels and one row stride")
    num, channels = x.shape
    kernel_size = weight.shape[1]
    out = torch.empty(num, channels, dtype=x.dtype, device=x.device)
    if num == 0:
        return out
    in_gate, out_gate = gates if gates is not None else (x, x)
    _conv_step_kernel[(num, triton.cdiv(channels, _STEP_BLOCK_C))](
        x, weight, bias if bias is not None else weight, out, conv_pool, state_slots, context_lens, in_gate, out_gate,
        x.stride(0), out.stride(0), in_gate.stride(0), *conv_pool.stride(), channels,
        K=kernel_size, BLOCK_W=triton.next_power_of_2(kernel_size - 1), HAS_BIAS=bias is not None,
        SILU=activation == "silu", GATED=gates is not None, BLOCK_C=_STEP_BLOCK_C, **pdl.options(x),
    )
    return out
