"""Triton kernels of the routed experts: an expert GEMM that reads its rows in the sorted-by-expert order (with
the token gather and the expert's activation fused in: the SiLU gate, or relu(x)^2 of ungated experts), and the
weighted combine of each token's k expert outputs.

Layout, for T tokens, top-k picks, E experts, R = T*k (token, pick) pairs (see `moe/grouped.py` for the steps):
    order [R]       the pairs sorted by expert (stable); sorted row r holds pair order[r] = t*k + j
    counts [E]      int32 rows per expert; each program derives from them (a cumsum over E) the run ends and
                    tile_ends = cumsum(cdiv(count_e, BLOCK_M)): each expert's run is cut into tiles of BLOCK_M rows
Program (m, n) of `expert_gemm` takes tile m: its expert e is the number of tile_ends <= m, its rows are
[start_e + (m - tile_start_e) * BLOCK_M, ...) clipped to the run's end, its columns the n-th BLOCK_N of the
output. The grid is sized for the worst case, cdiv(R, BLOCK_M) + E tiles, so nothing goes back to the host:
programs past the last tile return at once. The gate/up GEMM reads token rows through the sort (row
order[r] // k of x); the down GEMM writes each row back at its pair's place (row order[r]), so the combine
reads each token's k rows contiguously and no inverse permutation is built.

Worked example: E = 3, counts (5, 0, 2), BLOCK_M = 4 -> ends (5, 5, 7), tile_ends (2, 2, 3). Grid rows
cdiv(7, 4) + 3 = 5: tile 0 is expert 0 rows 0-3, tile 1 expert 0 row 4, tile 2 expert 2 rows 5-6, tiles 3 and
4 return. Expert e's weight tile is read once per tile of e, so with BLOCK_M >= the rows per expert (decode) the
weights are read once: the GEMMs of a decode step are bound by weight bytes, and small tiles over N keep every
SM streaming them.

`combine`: out[t] = sum_j w[t, j] * y[t*k + j] in fp32, rounded once; on the grouped-GEMM path, whose y is in
sorted order, through pos (a pair's sorted row): the un-permutation and the weighted sum in one read of y.
`spread`, the grouped path's gather: xs[pos[t*k + j]] = x[t] for every pick j, each token row read once and
written k times (a gather by sorted row, xs[r] = x[order[r] // k], would read every row k times).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridcache.kernels import pdl


@triton.jit
def expert_tile(counts_ptr, num_experts, pid_m, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
    """Tile `pid_m` of the sorted rows (module docstring): (its expert e, its sorted rows [BLOCK_M], which of them
    are in e's run). e == num_experts for a program past the last tile (the caller returns)."""
    experts = tl.arange(0, BLOCK_E)
    counts = tl.load(counts_ptr + experts, mask=experts < num_experts, other=0)
    run_ends = tl.cumsum(counts, axis=0)
    tile_ends = tl.cumsum((counts + BLOCK_M - 1) // BLOCK_M, axis=0)
    e = tl.sum((tile_ends <= pid_m).to(tl.int32))
    tile_start = tl.sum(tl.where(experts == e - 1, tile_ends, 0))
    run_start = tl.sum(tl.where(experts == e - 1, run_ends, 0))
    run_end = tl.sum(tl.where(experts == e, run_ends, 0))
    rows = run_start + (pid_m - tile_start) * BLOCK_M + tl.arange(0, BLOCK_M)
    return e, rows, rows < run_end


@triton.jit
def tile_indices(order_ptr, rows, row_ok, top_k, N, pid_n, GATHER: tl.constexpr, SCATTER: tl.constexpr,
                 BLOCK_N: tl.constexpr):
    """The rows and columns of a tile (`expert_tile`'s sorted rows, column tile pid_n's block of BLOCK_N columns):
    returns (pairs, a_rows, cols, col_ok). pairs [BLOCK_M] int64 are the rows' (token, pick) pairs order[rows],
    read when GATHER or SCATTER (else the sorted rows, for a caller that reads neither); a_rows the activation
    rows the tile reads, pairs // top_k (token rows) when GATHER, else the sorted rows; cols [BLOCK_N] its output
    columns, col_ok which are < N. Shared by `_expert_gemm_kernel` and the FP8 expert GEMM
    (`gemm/triton_fp8_moe.py`), which write to rows pairs when SCATTER."""
    if GATHER or SCATTER:  # noqa: SIM108 (a constexpr branch)
        pairs = tl.load(order_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    else:
        pairs = rows.to(tl.int64)
    if GATHER:  # noqa: SIM108 (a constexpr branch)
        a_rows = pairs // top_k
    else:
        a_rows = rows.to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return pairs, a_rows, cols, cols < N


@triton.jit
def relu_squared(acc):
    """relu(acc)^2, the epilogue of ungated experts (Nemotron-H); shared by this module's expert GEMM and the FP8
    one (`gemm/triton_fp8_moe.py`)."""
    acc = tl.maximum(acc, 0.0)
    return acc * acc


@triton.jit
def _expert_gemm_kernel(a_ptr, order_ptr, w_ptr, out_ptr, counts_ptr, num_experts, top_k, N, K,
                        stride_a, stride_we, stride_wn, stride_out,
                        GATHER: tl.constexpr, SCATTER: tl.constexpr, SWIGLU: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
                        PRECISION: tl.constexpr, PDL: tl.constexpr, SWAP_AB: tl.constexpr = False,
                        RELU2: tl.constexpr = False):
    pdl.start(PDL)
    e, rows, row_ok = expert_tile(counts_ptr, num_experts, tl.program_id(0), BLOCK_M, BLOCK_E)
    if e >= num_experts:
        return
    pairs, a_rows, cols, col_ok = tile_indices(order_ptr, rows, row_ok, top_k, N, tl.program_id(1), GATHER, SCATTER,
                                               BLOCK_N)
    w_base = w_ptr + e.to(tl.int64) * stride_we
    if SWAP_AB:  # the weight tile is the MMA's A operand ([BLOCK_N, BLOCK_K], its rows K-contiguous), the rows its B
        acc_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        acc_up_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            a_t = tl.load(a_ptr + a_rows[None, :] * stride_a + ks[:, None], mask=row_ok[None, :] & k_ok[:, None],
                          other=0.0)
            w_mask = col_ok[:, None] & k_ok[None, :]
            w = tl.load(w_base + cols[:, None].to(tl.int64) * stride_wn + ks[None, :], mask=w_mask, other=0.0)
            acc_t = tl.dot(w, a_t, acc_t, input_precision=PRECISION)
            if SWIGLU:
                w_up = tl.load(w_base + (cols[:, None] + N).to(tl.int64) * stride_wn + ks[None, :], mask=w_mask,
                               other=0.0)
                acc_up_t = tl.dot(w_up, a_t, acc_up_t, input_precision=PRECISION)
        acc = tl.trans(acc_t)
        acc_up = tl.trans(acc_up_t)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            a = tl.load(a_ptr + a_rows[:, None] * stride_a + ks[None, :], mask=row_ok[:, None] & k_ok[None, :],
                        other=0.0)
            w_mask = k_ok[:, None] & col_ok[None, :]
            w = tl.load(w_base + cols[None, :].to(tl.int64) * stride_wn + ks[:, None], mask=w_mask, other=0.0)
            acc = tl.dot(a, w, acc, input_precision=PRECISION)
            if SWIGLU:
                w_up = tl.load(w_base + (cols[None, :] + N).to(tl.int64) * stride_wn + ks[:, None], mask=w_mask,
                               other=0.0)
                acc_up = tl.dot(a, w_up, acc_up, input_precision=PRECISION)
    if SWIGLU:
        acc = acc * tl.sigmoid(acc) * acc_up
    if RELU2:  # ungated experts (Nemotron-H): relu(x)^2 of the up projection
        acc = relu_squared(acc)
    if SCATTER:  # noqa: SIM108 (a constexpr branch)
        out_rows = pairs
    else:
        out_rows = rows.to(tl.int64)
    out = out_ptr + out_rows[:, None] * stride_out + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def expert_gemm(a: torch.Tensor, order: torch.Tensor, top_k: int, weights: torch.Tensor, counts: torch.Tensor, *,
                gather: bool, scatter: bool, swiglu: bool, block_m: int, block_n: int = 64, block_k: int = 128,
                num_warps: int = 4, num_stages: int = 3, swap_ab: bool = False, relu2: bool = False) -> torch.Tensor:
    """The expert GEMM over the sorted rows of R = order.numel() (token, pick) pairs (module docstring).

    a: [T, K] token rows when `gather` (sorted row r reads row order[r] // top_k), else [R, K] in sorted order.
    weights [E, N_w, K] (unit stride on K); counts [E] int32 rows per expert. swiglu=False: each row's W_e a_r
    [N_w]; swiglu=True: the weights hold gate rows [0, N) and up rows [N, 2N) (N = N_w / 2), the row's
    silu(gate) * up [N] from fp32 accumulators, rounded once to a's dtype; relu2=True (not with swiglu): the row's
    relu(W_e a_r)^2 [N_w], from the fp32 accumulator, rounded once. Output [R, N] in sorted order, or in
    pair order (row order[r] for sorted row r) when `scatter`. fp32 inputs are multiplied in IEEE fp32 (not
    tf32), with a shallower depth tile (their tiles take twice the shared memory). `swap_ab`: the same products
    with the weight tile as the tensor cores' A operand (out^T = W a^T: a [block_n, block_k] weight tile fills the
    MMA's 64 rows whatever block_m is; `benchmarks/decode_kernel_sweep.py --only experts` times both).
    """
    num_experts, width, depth = weights.shape
    if swiglu and relu2:
        raise ValueError("expert_gemm: swiglu and relu2 are two activations; pick one")
    if a.stride(-1) != 1 or weights.stride(-1) != 1:
        raise ValueError("expert_gemm needs unit stride on the reduced dim of a and of the weights")
    num_rows = order.numel()
    n = width // 2 if swiglu else width
    if a.dtype == torch.float32:
        block_k = min(block_k, 32)
    out = torch.empty((num_rows, n), dtype=a.dtype, device=a.device)
    if num_rows:
        grid = (triton.cdiv(num_rows, block_m) + num_experts, triton.cdiv(n, block_n))
        _expert_gemm_kernel[grid](
            a, order, weights, out, counts, num_experts, top_k, n, depth,
            a.stride(0), weights.stride(0), weights.stride(1), out.stride(0),
            GATHER=gather, SCATTER=scatter, SWIGLU=swiglu, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
            BLOCK_E=triton.next_power_of_2(num_experts), PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
            SWAP_AB=swap_ab, RELU2=relu2, num_warps=num_warps, num_stages=num_stages, **pdl.options(a),
        )
    return out


@triton.jit
def _combine_kernel(y_ptr, pos_ptr, w_ptr, out_ptr, gate_ptr, shared_ptr, H, stride_y, stride_out, stride_gate,
                    stride_shared, TOP_K: tl.constexpr, BLOCK_H: tl.constexpr, SORTED: tl.constexpr,
                    SHARED: tl.constexpr, PDL: tl.constexpr):
    pdl.start(PDL)
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = cols < H
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        if SORTED:  # noqa: SIM108 (a constexpr branch)
            row = tl.load(pos_ptr + token * TOP_K + j).to(tl.int64)
        else:
            row = token * TOP_K + j
        weight = tl.load(w_ptr + token * TOP_K + j).to(tl.float32)
        acc += weight * tl.load(y_ptr + row * stride_y + cols, mask=ok, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    if SHARED:  # + sigmoid(gate) * shared (1, rounded where `activation.sigmoid_gate_add` rounds) or + shared (2)
        routed = acc.to(dtype).to(tl.float32)
        s = tl.load(shared_ptr + token * stride_shared + cols, mask=ok, other=0.0).to(tl.float32)
        if SHARED == 1:
            w = tl.sigmoid(tl.load(gate_ptr + token * stride_gate).to(tl.float32)).to(dtype).to(tl.float32)
            s = (w * s).to(dtype).to(tl.float32)
        acc = routed + s
    tl.store(out_ptr + token * stride_out + cols, acc.to(dtype), mask=ok)


def combine(y: torch.Tensor, top_weights: torch.Tensor, pos: torch.Tensor | None = None,
            shared: tuple[torch.Tensor | None, torch.Tensor] | None = None) -> torch.Tensor:
    """y [R, H] (unit stride on H): the pairs' expert outputs in pair order (row t*k + j), or in sorted order
    with pos [R] the sorted row of each pair; top_weights [T, k] -> [T, H] in y's dtype:
    out[t] = sum_j top_weights[t, j] * y[row of pair t*k + j], an fp32 sum rounded once. With `shared` = (gate
    [T, 1], shared [T, H], y's dtype, unit stride on H): that sum + sigmoid(gate) * shared in the same launch, with
    the roundings of `activation.sigmoid_gate_add` (the same bits as the two launches); with gate None (Granite's
    ungated shared MLP): the rounded sum + shared, rounded (torch's `routed + shared`)."""
    num_tokens, top_k = top_weights.shape
    hidden = y.shape[1]
    gate, extra = shared if shared is not None else (y, y)
    mode = 0 if shared is None else 2 if gate is None else 1
    gate = extra if gate is None else gate
    if shared is not None and ((mode == 1 and tuple(gate.shape) != (num_tokens, 1))
                               or tuple(extra.shape) != (num_tokens, hidden)
                               or gate.dtype != y.dtype or extra.dtype != y.dtype or extra.stride(1) != 1):
        raise ValueError(f"combine: gate [{num_tokens}, 1] and shared [{num_tokens}, {hidden}] (unit stride) in "
                         f"{y.dtype} needed, got {list(gate.shape)} {gate.dtype} and {list(extra.shape)} "
                         f"{extra.dtype}")
    out = torch.empty((num_tokens, hidden), dtype=y.dtype, device=y.device)
    if num_tokens:
        block_h = min(1024, triton.next_power_of_2(hidden))
        _combine_kernel[(num_tokens, triton.cdiv(hidden, block_h))](
            y, y if pos is None else pos, top_weights.contiguous(), out, gate, extra, hidden, y.stride(0),
            out.stride(0), gate.stride(0), extra.stride(0),
            TOP_K=top_k, BLOCK_H=block_h, SORTED=pos is not None, SHARED=mode, **pdl.options(y),
        )
    return out


@triton.jit
def _spread_kernel(x_ptr, pos_ptr, out_ptr, H, stride_x, stride_out, TOP_K: tl.constexpr, BLOCK_H: tl.constexpr,
                   PDL: tl.constexpr):
    pdl.start(PDL)
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = cols < H
    row = tl.load(x_ptr + token * stride_x + cols, mask=ok, other=0.0)
    for j in tl.static_range(TOP_K):
        dest = tl.load(pos_ptr + token * TOP_K + j).to(tl.int64)
        tl.store(out_ptr + dest * stride_out + cols, row, mask=ok)


SPREAD_BLOCK_H = 1024  # columns per program (`benchmarks/decode_kernel_sweep.py --only moe_prefill`)
SPREAD_WARPS = 4


def spread(x: torch.Tensor, pos: torch.Tensor, top_k: int, block_h: int = SPREAD_BLOCK_H,
           num_warps: int = SPREAD_WARPS) -> torch.Tensor:
    """x [T, H] (unit stride on H), pos [T*k] (the sorted row of each (token, pick) pair, `grouped.pair_rows`) ->
    xs [T*k, H] with xs[pos[t*k + j]] = x[t]: the token rows in sorted order, as x.index_select(0, order // k),
    read once (module docstring). block_h, num_warps: the launch (benchmarks sweep them)."""
    num_tokens, hidden = x.shape
    if x.stride(1) != 1 or pos.numel() != num_tokens * top_k:
        raise ValueError(f"spread: x [{num_tokens}, {hidden}] needs unit stride on H and pos {num_tokens * top_k} "
                         f"rows, got strides {x.stride()} and {pos.numel()} rows")
    out = torch.empty((num_tokens * top_k, hidden), dtype=x.dtype, device=x.device)
    if num_tokens and hidden:
        block_h = min(block_h, triton.next_power_of_2(hidden))
        _spread_kernel[(num_tokens, triton.cdiv(hidden, block_h))](
            x, pos, out, hidden, x.stride(0), out.stride(0), TOP_K=top_k, BLOCK_H=block_h, num_warps=num_warps,
            **pdl.options(x))
    return out
