"""The FP8 grouped expert GEMM: `moe/triton_experts.py`'s expert GEMM over rows sorted by expert (the same tile
lookup, `triton_experts.expert_tile`), with FP8 expert weights scaled per 128 x 128 block, in one of two modes:

- W8A8 (the engine's choice at every size): activations quantised per row per 128 channels (`triton_quant`), the
  FP8 tensor-core product scaled per row and column per K step (DeepSeek-V3's recipe, as `triton_block_fp8.py`);
  at decode sizes with swap-AB tiles (the weight tile on the MMA's M side, the few rows its N side).
- W8A16 (`DECODE_W8A16`, benchmarks): activations in their own dtype, each weight tile converted to it in
  registers (exact) and each K step's product scaled per column; no activation quantisation launch.

Layout (T tokens, top-k, E experts, R = T*k pairs; `order`, `counts` and the tiling exactly as in
`moe/triton_experts.py`, whose module docstring has a worked example):
    a [T or R, K] (fp8 with a_scale [T or R, ceil(K/bk)] fp32, or bf16/fp16/fp32)   rows read through the sort
                                                                                      when GATHER
    w [E, N_w, K] fp8, w_scale [E, G_w, ceil(K/bk)] fp32      per expert a [N_w, K] weight and its block scales
With SWIGLU the weights hold gate rows [0, N) and up rows [N, 2N), and the scales gate groups [0, ceil(N/bn)) then
up groups [ceil(N/bn), 2 ceil(N/bn)) (the two projections' scale grids stacked, so N need not be a multiple of
bn); the program keeps two fp32 accumulators and writes silu(gate) * up. With RELU2 (ungated experts, Nemotron-H)
the weights are the up rows alone and the program writes relu(up)^2 of its scaled fp32 accumulator
(`triton_experts.relu_squared`, the bf16 kernel's epilogue).

`fp8_grouped_experts` is the whole routed-experts op (same contract as `moe/grouped.py::grouped_experts`): the
gate/up GEMM gathers, h = silu(gate) * up or relu(up)^2 (the stack's activation; quantised again in W8A8), the down
GEMM scatters to pair order, and `triton_experts.combine` sums each token's k rows in fp32.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import nn

from hybridcache.fp8_format import CHANNEL, FP8_DTYPE, FP8_MAX
from hybridcache.kernels.gemm import fp8_tiles, reference, triton_quant
from hybridcache.kernels.gemm.fp8_tiles import PrefillTile, prefill_bucket
from hybridcache.kernels.gemm.triton_block_fp8 import scaled_dot, store_tile
from hybridcache.kernels.gemm.triton_quant import quantize_tile
from hybridcache.kernels.moe.reference import RELU2, SILU_GATED, check_activation
from hybridcache.kernels.moe.triton_experts import combine, expert_tile, relu_squared, tile_indices
from hybridcache.kernels.moe.triton_sort import sort_block

# `fp8_grouped_experts`' choices (measured on the H200: `benchmarks/fp8_sweep.py`, docs/kernels.md)
DECODE_W8A16 = False  # few rows per expert: W8A8 (x and h quantised per token per 128 channels), else W8A16
DECODE_BLOCK_N = 64  # decode: weight rows per tile; BLOCK_M from `moe.grouped.tile_rows`
DECODE_SWAP_AB = True  # decode: the weight tile on the MMA's M side
DECODE_NUM_WARPS = 4
DECODE_NUM_STAGES = 4  # the sweep's fastest over T = 64 and 1 (docs/bench.md, "FP8 on the H200")
# decode tiles of per-channel experts: x and h quantised per token (`triton_quant.quantize_rows`), so both scales
# are constant over K and the product is scaled once after the K loop (`fp8_expert_gemm`'s `scale_once`: a plain
# MMA chain over K, as bf16's kernel runs), instead of per token per 128 channels scaled at every K step
DECODE_TOKEN_SCALES = True
# a stack holding the shared expert: the pair sort reads the routed picks alone and appends the shared run
# (`moe.grouped.sort_pairs(..., shared=True)`: bf16's sort bucket, not the next power of two), and at decode with
# DECODE_TOKEN_SCALES the sort, the shared pick's weights and x's quantisation run as one launch (`shared_prologue`)
SHARED_SORT = True
DECODE_PROLOGUE = True


@triton.jit
def chained_dot(a, w, acc, SWAP_AB: tl.constexpr):
    """acc + a [BM, BK] . w [BN, BK]^T as [BM, BN] (fp32), or its transpose [BN, BM] with SWAP_AB: one link of an
    unscaled MMA chain over K (FP8 operands, fp32 accumulator)."""
    if SWAP_AB:  # one return statement: Triton wants one return type over both (constexpr) branches
        out = tl.dot(w, tl.trans(a), acc, out_dtype=tl.float32)
    else:
        out = tl.dot(a, tl.trans(w), acc, out_dtype=tl.float32)
    return out


@triton.jit
def scale_tile(acc, a_scale, w_scale, SWAP_AB: tl.constexpr):
    """acc ([BM, BN], or [BN, BM] with SWAP_AB) * a_scale[m] * w_scale[n]."""
    if SWAP_AB:  # noqa: SIM108 (a constexpr branch)
        out = acc * (w_scale[:, None] * a_scale[None, :])
    else:
        out = acc * (a_scale[:, None] * w_scale[None, :])
    return out


@triton.jit
def _fp8_expert_gemm_kernel(a_ptr, a_scale_ptr, order_ptr, w_ptr, w_scale_ptr, out_ptr, counts_ptr, num_experts,
                            top_k, N, K, UP_GROUP, stride_a, stride_as, stride_we, stride_wn, stride_wse,
                            stride_wsn, stride_wsk, stride_out, GATHER: tl.constexpr, SCATTER: tl.constexpr,
                            SWIGLU: tl.constexpr, A_FP8: tl.constexpr, GROUP_N: tl.constexpr,
                            GROUP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr, SWAP_AB: tl.constexpr,
                            PRECISION: tl.constexpr, GROUP_M: tl.constexpr, SCALE_ONCE: tl.constexpr = False,
                            RELU2: tl.constexpr = False):
    # GROUP_M 0: a 2-D grid (row tiles, column tiles); else a 1-D grid walking GROUP_M row tiles across every
    # column tile before the next GROUP_M (their activation rows stay in L2 while the weight columns go by)
    if GROUP_M == 0:
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
    else:
        pid = tl.program_id(0)
        tiles_n = tl.cdiv(N, BLOCK_N)
        tiles_m = tl.cdiv(tl.num_programs(0), tiles_n)
        in_group = GROUP_M * tiles_n
        first_m = (pid // in_group) * GROUP_M
        group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
        pid_m = first_m + (pid % in_group) % group_rows
        pid_n = (pid % in_group) // group_rows
    e, rows, row_ok = expert_tile(counts_ptr, num_experts, pid_m, BLOCK_M, BLOCK_E)
    if e >= num_experts:
        return
    pairs, a_rows, cols, col_ok = tile_indices(order_ptr, rows, row_ok, top_k, N, pid_n, GATHER, SCATTER, BLOCK_N)
    w_base = w_ptr + e.to(tl.int64) * stride_we
    ws_base = w_scale_ptr + e.to(tl.int64) * stride_wse
    gate_rows = cols.to(tl.int64) * stride_wn
    up_rows = (cols + N).to(tl.int64) * stride_wn
    gate_groups = (cols // GROUP_N).to(tl.int64) * stride_wsn
    up_groups = (cols // GROUP_N + UP_GROUP).to(tl.int64) * stride_wsn
    # SWAP_AB: out^T = W a^T, the weight tile on the MMA's M side (wgmma needs 64 there; decode has few rows)
    if SWAP_AB:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        group = k0 // GROUP_K
        a = tl.load(a_ptr + a_rows[:, None] * stride_a + ks[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)
        w_mask = col_ok[:, None] & k_ok[None, :]
        w = tl.load(w_base + gate_rows[:, None] + ks[None, :], mask=w_mask, other=0.0)
        if SCALE_ONCE:  # per-token x, per-row weights: one MMA chain over K, scaled after the loop
            acc = chained_dot(a, w, acc, SWAP_AB)
            if SWIGLU:
                w_up = tl.load(w_base + up_rows[:, None] + ks[None, :], mask=w_mask, other=0.0)
                acc_up = chained_dot(a, w_up, acc_up, SWAP_AB)
        else:
            if A_FP8:  # noqa: SIM108 (a constexpr branch)
                a_scale = tl.load(a_scale_ptr + a_rows * stride_as + group, mask=row_ok, other=0.0)
            else:
                a_scale = tl.full((BLOCK_M,), 1.0, tl.float32)
            w_scale = tl.load(ws_base + gate_groups + group * stride_wsk, mask=col_ok, other=0.0).to(tl.float32)
            if not A_FP8:
                w = w.to(a.dtype)
            acc += scaled_dot(a, w, a_scale, w_scale, SWAP_AB, PRECISION)
            if SWIGLU:
                w_up = tl.load(w_base + up_rows[:, None] + ks[None, :], mask=w_mask, other=0.0)
                up_scale = tl.load(ws_base + up_groups + group * stride_wsk, mask=col_ok, other=0.0).to(tl.float32)
                if not A_FP8:
                    w_up = w_up.to(a.dtype)
                acc_up += scaled_dot(a, w_up, a_scale, up_scale, SWAP_AB, PRECISION)
    if SCALE_ONCE:
        a_scale = tl.load(a_scale_ptr + a_rows * stride_as, mask=row_ok, other=0.0)
        acc = scale_tile(acc, a_scale, tl.load(ws_base + gate_groups, mask=col_ok, other=0.0).to(tl.float32),
                         SWAP_AB)
        if SWIGLU:
            acc_up = scale_tile(acc_up, a_scale, tl.load(ws_base + up_groups, mask=col_ok, other=0.0).to(tl.float32),
                                SWAP_AB)
    if SWIGLU:
        acc = acc * tl.sigmoid(acc) * acc_up
    if RELU2:  # ungated experts: relu(up)^2 of the scaled product
        acc = relu_squared(acc)
    if SCATTER:  # noqa: SIM108 (a constexpr branch)
        out_rows = pairs
    else:
        out_rows = rows.to(tl.int64)
    store_tile(out_ptr, out_rows, cols, acc, row_ok, col_ok, stride_out, SWAP_AB)


def fp8_expert_gemm(a: torch.Tensor, a_scale: torch.Tensor | None, order: torch.Tensor, top_k: int,
                    weights: torch.Tensor, w_scale: torch.Tensor, counts: torch.Tensor, block: tuple[int, int],
                    out_dtype: torch.dtype, *, gather: bool, scatter: bool, swiglu: bool, block_m: int,
                    block_n: int = 64, block_k: int = 128, num_warps: int = 4, num_stages: int = 3,
                    swap_ab: bool = False, group_m: int = 0, scale_once: bool = False,
                    relu2: bool = False) -> torch.Tensor:
    """The launcher (module docstring for the layout): a [T or R, K] float8_e4m3fn with a_scale [T or R,
    ceil(K/bk)] fp32 (W8A8), or bf16/fp16/fp32 with a_scale None (W8A16: each weight tile converted to a's dtype);
    order [R] int64, weights [E, N_w, K] fp8, w_scale [E, G_w, ceil(K/bk)] fp32 (G_w = ceil(N_w/bn), or
    2 ceil(N/bn) with swiglu), counts [E] int32 -> [R, N] in out_dtype (N = N_w, or N_w / 2 with swiglu), sorted
    order or pair order when `scatter`. `group_m` 0: a 2-D grid (row tiles x column tiles); > 0: a 1-D grid in
    groups of `group_m` row tiles, each group across all column tiles (the dense kernel's L2 order). Shapes,
    dtypes and strides are checked first. `scale_once`: a_scale [rows, 1] (per token) and per-row weight scales
    (a K stride of 0, or one K group): the K loop is an unscaled MMA chain, scaled once after it (equal to the
    per-step scaling but for fp32 rounding). `relu2` (not with swiglu): each row's relu(W_e a_r)^2 [N_w], from the
    scaled fp32 accumulator, rounded once (ungated experts' first GEMM)."""
    if swiglu and relu2:
        raise ValueError("fp8_expert_gemm: swiglu and relu2 are two activations; pick one")
    bn, bk = block
    a_fp8 = a_scale is not None
    num_experts, width, depth = weights.shape
    n = width // 2 if swiglu else width
    groups = -(-depth // bk)
    if scale_once:
        per_row = bn == 1 and (w_scale.stride(2) == 0 or w_scale.shape[2] == 1)
        if not a_fp8 or tuple(a_scale.shape) != (a.shape[0], 1) or not per_row:
            raise ValueError("fp8_expert_gemm: scale_once needs a_scale [rows, 1] (per token) and per-row weight "
                             f"scales (K stride 0), got a_scale {None if a_scale is None else list(a_scale.shape)}, "
                             f"w_scale strides {w_scale.stride()}, block {block}")
        a_scale = a_scale.expand(-1, groups)  # the checks below see the per-group layout; the kernel reads column 0
    want_scale = (num_experts, 2 * -(-n // bn) if swiglu else -(-n // bn), groups)
    if weights.dtype != FP8_DTYPE or (a.dtype == FP8_DTYPE) != a_fp8:
        raise ValueError(f"fp8_expert_gemm: weights must be {FP8_DTYPE} and a too exactly when a_scale is given, "
                         f"got {a.dtype} (a_scale {'given' if a_fp8 else 'None'}), {weights.dtype}")
    if a.dim() != 2 or a.shape[1] != depth or (a_fp8 and tuple(a_scale.shape) != (a.shape[0], groups)):
        raise ValueError(f"fp8_expert_gemm: a [rows, {depth}] (and a_scale [rows, {groups}]) needed, got "
                         f"{list(a.shape)} and {None if a_scale is None else list(a_scale.shape)}")
    if tuple(w_scale.shape) != want_scale or w_scale.dtype != torch.float32 or (
            a_fp8 and a_scale.dtype != torch.float32):
        raise ValueError(f"fp8_expert_gemm: w_scale {list(want_scale)} float32 needed, got {list(w_scale.shape)} "
                         f"{w_scale.dtype}")
    if counts.shape != (num_experts,) or counts.dtype != torch.int32:
        raise ValueError(f"fp8_expert_gemm: counts [{num_experts}] int32 needed, got {list(counts.shape)} "
                         f"{counts.dtype}")
    if (a.stride(1) != 1 or weights.stride(2) != 1 or (a_fp8 and not scale_once and a_scale.stride(1) != 1)
            or w_scale.stride(2) > 1):
        raise ValueError("fp8_expert_gemm needs unit stride on K (activations, weights and both scales; the weight "
                         "scale's may be 0: one scale per row)")
    if bk < 16 or bk & (bk - 1):
        raise ValueError(f"fp8_expert_gemm: the K group {bk} must be a power of two >= 16")
    # a K step never straddles two scale groups, but with scale_once the scales do not change over K
    block_k = min(block_k, 32 if a.dtype == torch.float32 else block_k if scale_once else bk)
    num_rows = order.numel()
    out = torch.empty((num_rows, n), dtype=out_dtype, device=a.device)
    if num_rows:
        grid = (triton.cdiv(num_rows, block_m) + num_experts, triton.cdiv(n, block_n))
        if group_m:
            grid = (grid[0] * grid[1],)
        _fp8_expert_gemm_kernel[grid](
            a, a_scale if a_fp8 else a, order, weights, w_scale, out, counts, num_experts, top_k, n, depth,
            -(-n // bn), a.stride(0), a_scale.stride(0) if a_fp8 else 0, weights.stride(0), weights.stride(1),
            w_scale.stride(0), w_scale.stride(1), w_scale.stride(2), out.stride(0), GATHER=gather, SCATTER=scatter,
            SWIGLU=swiglu, A_FP8=a_fp8, GROUP_N=bn, GROUP_K=bk, BLOCK_M=block_m, BLOCK_N=block_n,
            BLOCK_K=block_k, BLOCK_E=triton.next_power_of_2(num_experts), SWAP_AB=swap_ab,
            PRECISION="ieee" if a.dtype == torch.float32 else "tf32", GROUP_M=group_m, SCALE_ONCE=scale_once,
            RELU2=relu2, num_warps=num_warps, num_stages=num_stages,
        )
    return out


@dataclass(frozen=True)
class Fp8ExpertWeights:
    """FP8 expert weights stacked for the grouped GEMM, and the experts' activation (`moe.reference.
    EXPERT_ACTIVATIONS`, as `moe.grouped.ExpertWeights`).

    gate_up [E, 2I, H] fp8 (gate rows, then up rows), gate_up_scale [E, 2 ceil(I/bn), ceil(H/bk)] fp32 (gate
    groups, then up groups); "relu2" (ungated experts): up rows alone, [E, I, H] and [E, ceil(I/bn), ceil(H/bk)];
    down [E, H, I] fp8, down_scale [E, ceil(H/bn), ceil(I/bk)] fp32; block (bn, bk).
    Per-channel weights (one scale per row) keep it as gate_up_rows [E, 2I] ("relu2": [E, I]) and down_rows [E, H]
    fp32 (`F.scaled_grouped_mm`'s row-wise scales; None for 128 x 128 blocks), their block scales being (1, bk)
    views of them (a K stride of 0). `shared`: the stack's last expert is the MoE block's shared expert (`share(...,
    shared=...)`; SiLU-gated stacks only), which every token picks once more with weight sigmoid(its gate)
    (`fp8_grouped_experts`' `shared_gate`).
    """

    gate_up: torch.Tensor
    gate_up_scale: torch.Tensor
    down: torch.Tensor
    down_scale: torch.Tensor
    block: tuple[int, int]
    gate_up_rows: torch.Tensor | None = None
    down_rows: torch.Tensor | None = None
    shared: bool = False
    activation: str = SILU_GATED

    @classmethod
    @torch.no_grad()
    def share(cls, experts: Sequence[nn.Module], per_channel: bool | None = None,
              shared: nn.Module | None = None, activation: str = SILU_GATED) -> Fp8ExpertWeights:
        """Stack the FP8 experts (modules with `gate_proj`, `up_proj`, `down_proj` FP8 linears of one format:
        `weight`, `scale`, `fmt`; "relu2" experts have no `gate_proj`, and their stack holds up_proj alone) and
        re-point each expert's weights at their slices of the stack (one copy in memory). Per-channel scales
        [N, 1] become blocks of (1, 128): each row's scale read at every K group (a view with a K stride of 0;
        activations then quantised per token per 128 channels in the Triton kernels, finer than per token), and
        stay rows (`gate_up_rows`, `down_rows`).
        Block-scaled experts with `per_channel` (default `fp8_tiles.EXPERTS_PER_CHANNEL`) are re-quantised per
        output channel (`reference.requantize_rows`; a change of numerics, docs/kernels.md "Quantization") and
        their modules become per-channel `Fp8Linear`s holding the new weights. `shared` (a module like the
        experts, `shared_fits` must hold): stacked last, as one more expert (re-quantised with the others).
        `activation`: the experts' (`moe.reference.EXPERT_ACTIVATIONS`; another is a ValueError naming it)."""
        check_activation(activation)
        if shared is not None and activation != SILU_GATED:
            raise ValueError(f"Fp8ExpertWeights.share: a shared expert is stacked with SiLU-gated experts only (its "
                             f"sigmoid-gated pick), not {activation!r} ones")
        if shared is not None and not shared_fits(experts, shared):
            raise ValueError("Fp8ExpertWeights.share: the shared expert must have the routed experts' FP8 format "
                             "and widths (shared_fits)")
        experts = [*experts, shared] if shared is not None else list(experts)
        fmt = experts[0].up_proj.fmt
        per_channel = fp8_tiles.EXPERTS_PER_CHANNEL if per_channel is None else per_channel
        requantize = fmt.kind == "block" and per_channel
        bk = fmt.block[1]
        block = fmt.block if fmt.kind == "block" and not requantize else (1, bk)

        def stacked(linears: list[nn.Module]) -> tuple[torch.Tensor, torch.Tensor]:
            """(weights [E, N, K] fp8, scales: [E, N/bn, K/bk] blocks, or [E, N] per row)."""
            weights = torch.stack([linear.weight for linear in linears])
            scales = torch.stack([linear.scale for linear in linears]).float()
            if requantize:
                weights, scales = reference.requantize_rows(weights, scales, fmt.block)
                for e, linear in enumerate(linears):
                    _to_channel(linear, scales[e, :, None])
            return weights, scales.reshape(len(linears), -1) if block[0] == 1 else scales

        gated = activation == SILU_GATED
        gate_up, gate_up_scale = stacked([e.up_proj for e in experts])
        if gated:  # gate rows first
            gate, gate_scale = stacked([e.gate_proj for e in experts])
            gate_up, gate_up_scale = torch.cat([gate, gate_up], dim=1), torch.cat([gate_scale, gate_up_scale], dim=1)
            del gate
        gate_up_scale = gate_up_scale.contiguous()
        down, down_scale = stacked([e.down_proj for e in experts])
        down_scale = down_scale.contiguous()
        inter = down.shape[2]
        for e, expert in enumerate(experts):
            if gated:
                expert.gate_proj.weight.data = gate_up[e, :inter]
            expert.up_proj.weight.data = gate_up[e, gate_up.shape[1] - inter:]
            expert.down_proj.weight.data = down[e]
        if block[0] != 1:
            return cls(gate_up, gate_up_scale, down, down_scale, block, shared=shared is not None,
                       activation=activation)

        def blocks(rows: torch.Tensor, depth: int) -> torch.Tensor:  # [E, N, K groups], a K stride of 0
            return rows[:, :, None].expand(-1, -1, -(-depth // bk))

        return cls(gate_up, blocks(gate_up_scale, gate_up.shape[2]), down, blocks(down_scale, down.shape[2]), block,
                   gate_up_scale, down_scale, shared=shared is not None, activation=activation)


def shared_fits(experts: Sequence[nn.Module], shared: nn.Module) -> bool:
    """Whether a MoE block's shared expert can run as one more routed expert (`fp8_tiles.SHARED_AS_EXPERT`):
    every projection of the experts and of `shared` an FP8 linear (`fmt`) of one format, the shared expert as
    wide as the routed ones (gate / up rows, down columns), and one more expert within the sort's limit. Ungated
    experts (no `gate_proj`: "relu2") never do."""
    from hybridcache.kernels.moe.triton_sort import MAX_EXPERTS

    if not (hasattr(experts[0], "gate_proj") and hasattr(shared, "gate_proj")):
        return False
    projections = [getattr(m, name) for m in (experts[0], shared) for name in ("gate_proj", "up_proj", "down_proj")]
    if not all(hasattr(p, "fmt") for p in projections) or len({p.fmt for p in projections}) != 1:
        return False
    routed, own = experts[0], shared
    return (fp8_tiles.SHARED_AS_EXPERT and len(experts) + 1 <= MAX_EXPERTS
            and own.gate_proj.weight.shape == routed.gate_proj.weight.shape
            and own.up_proj.weight.shape == routed.up_proj.weight.shape
            and own.down_proj.weight.shape == routed.down_proj.weight.shape)


@triton.jit(do_not_specialize=["T"])  # one compile for every token count
def _with_shared_kernel(w_ptr, ids_ptr, gate_ptr, w_out_ptr, ids_out_ptr, T, top_k, shared_id, stride_w,
                        stride_ids, stride_gate, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr):
    with_shared_tile(w_ptr, ids_ptr, gate_ptr, w_out_ptr, ids_out_ptr, tl.program_id(0) * BLOCK_T, T, top_k,
                     shared_id, stride_w, stride_ids, stride_gate, BLOCK_T, BLOCK_K, True)


@triton.jit
def with_shared_tile(w_ptr, ids_ptr, gate_ptr, w_out_ptr, ids_out_ptr, first, T, top_k, shared_id, stride_w,
                     stride_ids, stride_gate, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, WRITE_IDS: tl.constexpr):
    """`with_shared` for tokens [first, first + BLOCK_T) in the calling program (the ids only when WRITE_IDS)."""
    tokens = first + tl.arange(0, BLOCK_T)
    picks = tl.arange(0, BLOCK_K)
    token_ok = tokens < T
    routed = token_ok[:, None] & (picks[None, :] < top_k)
    tokens64 = tokens.to(tl.int64)
    w = tl.load(w_ptr + tokens64[:, None] * stride_w + picks[None, :], mask=routed, other=0.0)
    gate = tl.load(gate_ptr + tokens64 * stride_gate, mask=token_ok, other=0.0).to(tl.float32)
    shared_w = tl.sigmoid(gate).to(w_out_ptr.dtype.element_ty)
    is_shared = picks[None, :] == top_k
    w = tl.where(is_shared, shared_w[:, None], w)
    out = tokens64[:, None] * (top_k + 1) + picks[None, :]
    keep = token_ok[:, None] & (picks[None, :] <= top_k)
    tl.store(w_out_ptr + out, w, mask=keep)
    if WRITE_IDS:
        ids = tl.load(ids_ptr + tokens64[:, None] * stride_ids + picks[None, :], mask=routed, other=0)
        ids = tl.where(is_shared, shared_id, ids)
        tl.store(ids_out_ptr + out, ids.to(tl.int64), mask=keep)


_PROLOGUE_TOKENS = 64  # tokens per step of the prologue's weights loop


# the step's token count and the strides of the router output's views: one compile for all
@triton.jit(do_not_specialize=["T", "num_pairs", "top_k", "stride_w", "stride_gate"])
def _shared_prologue_kernel(ids_ptr, w_ptr, gate_ptr, order_ptr, counts_ptr, w_out_ptr, x_ptr, q_ptr, s_ptr, T,
                            num_pairs, num_experts, top_k, K, stride_w, stride_gate, stride_x, stride_q,
                            BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_T: tl.constexpr,
                            BLOCK_K: tl.constexpr, GROUP: tl.constexpr, QMAX: tl.constexpr):
    pid = tl.program_id(0)
    if pid == 0:
        sort_block(ids_ptr, order_ptr, counts_ptr, num_pairs, num_experts, top_k, BLOCK_N, BLOCK_E, True)
    elif pid == 1:
        for first in range(0, T, BLOCK_T):
            with_shared_tile(w_ptr, ids_ptr, gate_ptr, w_out_ptr, ids_ptr, first, T, top_k, num_experts - 1,
                             stride_w, 0, stride_gate, BLOCK_T, BLOCK_K, False)
    else:
        quantize_tile(x_ptr, q_ptr, s_ptr, (pid - 2).to(tl.int64), 0, T, K, 1, stride_x, stride_q, 1, 0, GROUP, 1,
                      QMAX)


def shared_prologue(x: torch.Tensor, top_weights: torch.Tensor, top_ids: torch.Tensor, gate: torch.Tensor,
                    num_experts: int) -> tuple[torch.Tensor, ...]:
    """The decode prologue of a stack holding the shared expert (its last, E - 1), in one launch of 2 + T programs:
    the pair sort of the routed picks with the shared run appended (`moe.grouped.sort_pairs(top_ids, E,
    shared=True)`), the combine weights with the shared pick (`with_shared`'s weights) and x quantised per token
    (`triton_quant.quantize_rows`), each equal to its own launch's result. x [T, H] (unit stride on H), top_weights
    [T, k] (x's dtype, unit stride on k), top_ids [T, k] int64 contiguous (ids < E - 1), gate [T, 1], 1 <= T*k <=
    `triton_sort.MAX_PAIRS`, E <= `MAX_EXPERTS` -> (order [T*(k + 1)] int64, counts [E] int32, weights
    [T, k + 1], xq [T, H] float8_e4m3fn, x_scale [T, 1] fp32)."""
    from hybridcache.kernels.moe.triton_sort import MAX_EXPERTS, MAX_PAIRS, block_size

    tokens, top_k = top_ids.shape
    hidden = x.shape[1]
    if not 0 < tokens * top_k <= MAX_PAIRS or num_experts > MAX_EXPERTS or x.shape[0] != tokens:
        raise ValueError(f"shared_prologue: 1 to {MAX_PAIRS} routed pairs over at most {MAX_EXPERTS} experts and "
                         f"x of their tokens, got {list(top_ids.shape)} over {num_experts}, x {list(x.shape)}")
    if (not top_ids.is_contiguous() or top_ids.dtype != torch.int64 or top_weights.shape != top_ids.shape
            or top_weights.stride(1) != 1 or x.stride(1) != 1 or tuple(gate.shape) != (tokens, 1)):
        raise ValueError("shared_prologue: contiguous int64 top_ids [T, k], top_weights [T, k] and x [T, H] with "
                         f"unit inner stride, gate [T, 1] needed, got {list(top_weights.shape)}, {top_ids.dtype}, "
                         f"{list(gate.shape)}")
    order = torch.empty(tokens * (top_k + 1), dtype=torch.int64, device=x.device)
    counts = torch.empty(num_experts, dtype=torch.int32, device=x.device)
    weights = torch.empty((tokens, top_k + 1), dtype=top_weights.dtype, device=x.device)
    xq = torch.empty((tokens, hidden), dtype=FP8_DTYPE, device=x.device)
    x_scale = torch.empty((tokens, 1), dtype=torch.float32, device=x.device)
    _shared_prologue_kernel[(2 + tokens,)](
        top_ids, top_weights, gate, order, counts, weights, x, xq, x_scale, tokens, tokens * top_k, num_experts, top_k,
        hidden, top_weights.stride(0), gate.stride(0), x.stride(0), xq.stride(0),
        BLOCK_N=block_size(tokens * top_k), BLOCK_E=triton.next_power_of_2(num_experts + 1),
        BLOCK_T=_PROLOGUE_TOKENS, BLOCK_K=triton.next_power_of_2(top_k + 1),
        GROUP=max(16, triton.next_power_of_2(hidden)), QMAX=FP8_MAX, num_warps=4)
    return order, counts, weights, xq, x_scale


def with_shared(top_weights: torch.Tensor, top_ids: torch.Tensor, gate: torch.Tensor,
                shared_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The routes with the shared expert as every token's last pick, in one launch: top_weights [T, k] (x's
    dtype), top_ids [T, k] int64, gate [T, 1] (the shared expert's gate logits) -> (weights [T, k + 1]: the k
    picks', then sigmoid(gate) computed in fp32 and rounded to the weights' dtype; ids [T, k + 1] int64: the k
    picks', then `shared_id`)."""
    tokens, top_k = top_ids.shape
    if top_weights.shape != top_ids.shape or top_ids.dtype != torch.int64 or tuple(gate.shape) != (tokens, 1):
        raise ValueError(f"with_shared: top_weights and top_ids [T, k] (int64 ids) and gate [T, 1] needed, got "
                         f"{list(top_weights.shape)}, {list(top_ids.shape)} {top_ids.dtype}, {list(gate.shape)}")
    if top_weights.stride(1) != 1 or top_ids.stride(1) != 1:
        raise ValueError("with_shared needs unit stride over the picks")
    weights = torch.empty((tokens, top_k + 1), dtype=top_weights.dtype, device=top_weights.device)
    ids = torch.empty((tokens, top_k + 1), dtype=torch.int64, device=top_ids.device)
    if tokens:
        block_t = 64
        _with_shared_kernel[(triton.cdiv(tokens, block_t),)](
            top_weights, top_ids, gate, weights, ids, tokens, top_k, shared_id, top_weights.stride(0),
            top_ids.stride(0), gate.stride(0), BLOCK_T=block_t, BLOCK_K=triton.next_power_of_2(top_k + 1))
    return weights, ids


def _to_channel(linear: nn.Module, scale: torch.Tensor) -> None:
    """Make a block-scaled `Fp8Linear` per-channel with `scale` [N, 1] (its weight is set by the caller)."""
    delattr(linear, linear.fmt.scale_name)
    linear.fmt = CHANNEL
    linear.register_parameter(CHANNEL.scale_name, nn.Parameter(scale, requires_grad=False))


def rowwise_expert_rows(x: torch.Tensor, order: torch.Tensor, counts: torch.Tensor, top_k: int,
                        experts: Fp8ExpertWeights, rows: torch.Tensor | None = None) -> torch.Tensor:
    """y [T*k, H] in sorted order (`combine` through `pair_rows`): per-channel experts by two of torch's row-wise
    scaled grouped GEMMs (`F.scaled_grouped_mm`, CUTLASS on sm90), as bf16's `moe.grouped.expert_rows_grouped`:
    x quantised per token and written to its rows in sorted order in one launch (`triton_quant.
    quantize_rows_scatter`; `rows`: `pair_rows(order)`, computed here when None), then silu(gate) * up (or "relu2"
    experts' relu(up)^2) quantised per row in one launch (`triton_quant.swiglu_quantize_rows` /
    `relu2_quantize_rows`)."""
    from hybridcache.kernels.moe.grouped import pair_rows

    ends = counts.cumsum(0, dtype=torch.int32)
    xq, x_scale = triton_quant.quantize_rows_scatter(x, pair_rows(order) if rows is None else rows, top_k)
    rowwise = F.ScalingType.RowWise
    fast = {"use_fast_accum": True} if fp8_tiles.ROWWISE_FAST_ACCUM else {}
    gate_up = F.scaled_grouped_mm(xq, experts.gate_up.transpose(1, 2), x_scale, rowwise, experts.gate_up_rows,
                                  rowwise, offs=ends, output_dtype=x.dtype, **fast)
    activate = triton_quant.relu2_quantize_rows if experts.activation == RELU2 else triton_quant.swiglu_quantize_rows
    h, h_scale = activate(gate_up)
    return F.scaled_grouped_mm(h, experts.down.transpose(1, 2), h_scale, rowwise, experts.down_rows, rowwise,
                               offs=ends, output_dtype=x.dtype, **fast)


def rowwise_fits(x: torch.Tensor, experts: Fp8ExpertWeights) -> bool:
    """Whether `fp8_grouped_experts` may take `rowwise_expert_rows` above the decode sizes: per-channel experts,
    bf16 on CUDA, `fp8_tiles.ROWWISE_PREFILL`, a torch with `F.scaled_grouped_mm`, and widths that are multiples
    of 16 (its TMA rule: the experts' width I, the down GEMM's K, and the hidden size H)."""
    return (fp8_tiles.ROWWISE_PREFILL and experts.gate_up_rows is not None and x.is_cuda
            and x.dtype == torch.bfloat16 and hasattr(F, "scaled_grouped_mm")
            and experts.down.shape[2] % 16 == 0 and experts.gate_up.shape[2] % 16 == 0)


def fp8_grouped_experts(x: torch.Tensor, top_weights: torch.Tensor, top_ids: torch.Tensor,
                        experts: Fp8ExpertWeights, block_m: int | None = None, w8a16: bool | None = None,
                        block_n: int | None = None, prefill: PrefillTile | None = None,
                        rowwise: bool | None = None, shared_gate: torch.Tensor | None = None,
                        **tile: int | bool) -> torch.Tensor:
    """x [T, H] (bf16/fp16/fp32), top_weights [T, k] (x's dtype, or fp32 without the shared expert: Nemotron-H's
    router), top_ids [T, k] int64 -> [T, H] in x's dtype:
    out[t] = sum_j top_weights[t, j] * expert_{top_ids[t, j]}(x[t]) with FP8 expert weights, each expert's MLP the
    stack's activation (silu(gate) * up, or relu(up)^2 for "relu2"; the same paths and tiles for both).

    Few rows per expert (`moe.grouped.tile_rows` gives a tile: decode): the `DECODE_*` tile, W8A8 swap-AB (or W8A16
    with `DECODE_W8A16`: x and h in x's dtype, the weights converted in the kernel, no quantisation launch;
    per-channel experts with `DECODE_TOKEN_SCALES`: x and h per token, the product scaled once); more: per-channel
    experts where `rowwise_fits` holds by torch's row-wise scaled grouped GEMM (`rowwise_expert_rows`; without fast
    accumulation from `fp8_tiles.ROWWISE_FULL_ACCUM_ROWS` rows per expert; `rowwise` True / False forces it or the
    Triton kernels), else W8A8 with `fp8_tiles.PREFILL_TILES[prefill_bucket(...)]` (or `prefill`, a `PrefillTile`,
    when given). W8A8 quantises x and h per token per 128 channels (`triton_quant`; per token on the row-wise path
    and with `DECODE_TOKEN_SCALES`). `w8a16`, `block_m`, `block_n` and `tile` (`fp8_expert_gemm`'s other settings)
    override the choice for both GEMMs (benchmarks sweep them); the choice is made from shapes alone, so captured
    and eager runs agree.

    A stack with the block's shared expert (`experts.shared`) needs `shared_gate` [T, 1] (x's dtype): the
    shared expert is every token's pick k + 1 with weight sigmoid(shared_gate) (`with_shared`), and the result
    is routed + shared as the unfused block's (rounded once, in the combine's fp32 sum); the path and the tiles
    are chosen from the routed picks' rows per routed expert, as without it."""
    from hybridcache.kernels.moe.grouped import pair_rows, sort_pairs, tile_rows

    num_experts = experts.gate_up.shape[0]
    routed_experts, routed_rows = num_experts - experts.shared, top_ids.numel()
    if experts.shared != (shared_gate is not None):
        raise ValueError("fp8_grouped_experts: shared_gate is needed exactly when the stack holds the shared expert")
    top_k = top_ids.shape[1] + experts.shared
    bk = experts.block[1]
    decode_tile = tile_rows(routed_rows, routed_experts)
    if rowwise is None:
        rowwise = (decode_tile is None and prefill is None and not tile and block_m is None and w8a16 is None
                   and rowwise_fits(x, experts) and (fp8_tiles.ROWWISE_FAST_ACCUM or routed_rows
                                                     >= fp8_tiles.ROWWISE_FULL_ACCUM_ROWS * routed_experts))
    token_scales = False
    if rowwise:
        options = down_options = {}
    elif decode_tile is not None and prefill is None:
        options, down_options = decode_launch(experts.gate_up, decode_tile), decode_launch(experts.down, decode_tile)
        w8a16 = DECODE_W8A16 if w8a16 is None else w8a16
        token_scales = DECODE_TOKEN_SCALES and not w8a16 and experts.gate_up_rows is not None
    else:
        chosen = prefill or fp8_tiles.PREFILL_TILES[prefill_bucket(routed_rows, routed_experts)]
        options = dict(block_m=chosen.block_m, block_n=chosen.block_n, num_warps=chosen.num_warps,
                       num_stages=chosen.num_stages, group_m=chosen.group_m)
        down_options = options | dict(block_n=chosen.down_block_n)
        w8a16 = False if w8a16 is None else w8a16
    overrides = {key: value for key, value in dict(block_m=block_m, block_n=block_n).items() if value} | tile
    options, down_options = options | overrides, down_options | overrides
    if token_scales:  # per-channel experts at decode: x and h per token, scaled once (`DECODE_TOKEN_SCALES`)
        options, down_options = options | dict(scale_once=True), down_options | dict(scale_once=True)

    def quantized(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if w8a16:
            return t, None
        return triton_quant.quantize_rows(t) if token_scales else triton_quant.quantize_groups(t, bk)

    if experts.shared and token_scales and DECODE_PROLOGUE and SHARED_SORT and prologue_fits(x, top_ids, num_experts):
        order, counts, top_weights, a, a_scale = shared_prologue(x, top_weights, top_ids, shared_gate, num_experts)
    else:
        if experts.shared and SHARED_SORT:  # the routed picks alone, the shared run appended
            order, counts = sort_pairs(top_ids, num_experts, shared=True)
            top_weights = with_shared(top_weights, top_ids, shared_gate, routed_experts)[0]
        elif experts.shared:
            top_weights, ids = with_shared(top_weights, top_ids, shared_gate, routed_experts)
            order, counts = sort_pairs(ids, num_experts)
        else:
            order, counts = sort_pairs(top_ids, num_experts)
        if rowwise:
            rows = pair_rows(order)
            return combine(rowwise_expert_rows(x, order, counts, top_k, experts, rows), top_weights, rows)
        a, a_scale = quantized(x)
    gated = experts.activation == SILU_GATED
    h = fp8_expert_gemm(a, a_scale, order, top_k, experts.gate_up, experts.gate_up_scale, counts, experts.block,
                        x.dtype, gather=True, scatter=False, swiglu=gated, relu2=not gated, **options)
    a, a_scale = quantized(h)
    y = fp8_expert_gemm(a, a_scale, order, top_k, experts.down, experts.down_scale, counts, experts.block,
                        x.dtype, gather=False, scatter=True, swiglu=False, **down_options)
    return combine(y, top_weights)


def fp8_exact(x: torch.Tensor) -> bool:
    """Whether FP8 experts on x run the exact path: fp32 x, which the CUDA backend's `moe` hands
    `fp8_grouped_experts` as W8A16 (`w8a16=True`: x and h stay fp32, each weight tile is converted to fp32 in the
    kernel and multiplied in IEEE fp32) on the checkpoint's own scales (`Fp8ExpertWeights.share(...,
    per_channel=False)`): the reference backend's dequantised experts but for fp32 summation order, as fp32's dense
    FP8 linears (`triton_backend`: the dequantising GEMM). W8A8's activation quantisation is a step function of x:
    two runs whose x differ in the last fp32 bits (another chunking of a scan: a cached and an uncached run) may
    round an element to neighbouring e4m3 values, 1/16 of it apart, which an fp32 engine's exactness cannot absorb.
    The fast paths (W8A8, the row-wise grouped GEMM) are bf16 / fp16's."""
    return x.dtype == torch.float32


def decode_launch(weights: torch.Tensor, block_m: int) -> dict:
    """`fp8_expert_gemm`'s launch settings for stacked weights [E, N_w, K] at decode sizes, `tile_rows` having
    chosen block_m: `fp8_tiles.DECODE_TILES`' entry, else the `DECODE_*` launch. From shapes alone."""
    tile = fp8_tiles.DECODE_TILES.get((weights.shape[1], weights.shape[2], block_m))
    if tile is None:
        return dict(block_m=block_m, block_n=DECODE_BLOCK_N, swap_ab=DECODE_SWAP_AB, num_warps=DECODE_NUM_WARPS,
                    num_stages=DECODE_NUM_STAGES)
    return dataclasses.asdict(tile)


def prologue_fits(x: torch.Tensor, top_ids: torch.Tensor, num_experts: int) -> bool:
    """Whether `fp8_grouped_experts` runs a decode step's sort, shared weights and x quantisation as one launch
    (`shared_prologue`): on CUDA (as `moe.grouped.sort_pairs`' Triton sort), within the sort's limits, x with unit
    stride on H, top_ids contiguous."""
    from hybridcache.kernels.moe.triton_sort import MAX_EXPERTS, MAX_PAIRS

    return (x.is_cuda and 0 < top_ids.numel() <= MAX_PAIRS and num_experts <= MAX_EXPERTS and x.stride(1) == 1
            and top_ids.is_contiguous())


def compile_tiles(x: torch.Tensor, experts: Fp8ExpertWeights, top_k: int, w8a16: bool | None = None) -> None:
    """Run every expert-GEMM variant `fp8_grouped_experts` can launch for this block's shapes once, on one token of
    x's dtype and device, so that they compile when the engine starts (its profiling forward stacks the experts)
    and not inside the first request that needs one: the one-launch sort at each of its pair-count buckets (as
    `moe.grouped.compile_tiles`; with the shared expert, the decode prologue too), the decode launch of each tile
    `moe.grouped.tile_rows` can pick (at a token count that picks it), the W8A8 prefill path
    with its quantisation at each `fp8_tiles.PREFILL_TILES` tile, and the row-wise path's two quantisations
    where it runs; with the shared expert in the stack, `with_shared` and the combine of k + 1 picks. `w8a16`: what
    the backend passes `fp8_grouped_experts` (True on fp32 x, `fp8_exact`: the W8A16 variants of those tiles)."""
    from hybridcache.kernels.moe.triton_sort import MAX_EXPERTS, block_size, block_sizes, sort_pairs_triton
    from hybridcache.kernels.parallel_compile import compiles_only

    num_experts = experts.gate_up.shape[0]
    routed = num_experts - experts.shared
    if x.is_cuda and num_experts <= MAX_EXPERTS:
        with compiles_only():  # one launch each: side by side on the start-up's pool, nothing run
            for pairs in block_sizes():
                sort_pairs_triton(torch.arange(pairs, device=x.device).remainder(routed)[:, None], num_experts,
                                  experts.shared)
                tokens = max(1, pairs // top_k)
                if experts.shared and not w8a16 and block_size(tokens * top_k) == pairs:  # the decode prologue
                    ids = torch.arange(tokens * top_k, device=x.device).remainder(routed).view(tokens, top_k)
                    shared_prologue(torch.zeros((tokens, experts.gate_up.shape[2]), dtype=x.dtype, device=x.device),
                                    torch.ones((tokens, top_k), dtype=x.dtype, device=x.device), ids,
                                    torch.zeros((tokens, num_experts), dtype=x.dtype, device=x.device)[:, -1:],
                                    num_experts)  # the gate: a column of the router's output, as in the block
    from hybridcache.kernels.moe.grouped import tile_rows

    def tokens_of(count: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(x, top_weights, top_ids, shared_gate) of `count` tokens: zeros, each token picking experts 0 .. k-1."""
        ids = torch.arange(top_k, device=x.device).remainder(routed)[None, :].expand(count, -1).contiguous()
        gate = torch.zeros((count, 1), dtype=x.dtype, device=x.device) if experts.shared else None
        return (torch.zeros((count, experts.gate_up.shape[2]), dtype=x.dtype, device=x.device),
                torch.ones((count, top_k), dtype=x.dtype, device=x.device), ids, gate)

    # each decode bucket `tile_rows` can pick (16, 32, 64 rows) at a token count in it, so the launch chosen there
    # (`decode_launch`: `fp8_tiles.DECODE_TILES` or the DECODE_* launch) compiles
    for rows, most_per_expert in ((16, 8), (32, 16), (64, 64)):
        count = max(1, most_per_expert * routed // top_k)
        if tile_rows(count * top_k, routed) == rows:
            token, weights, ids, gate = tokens_of(count)
            fp8_grouped_experts(token, weights, ids, experts, w8a16=w8a16, shared_gate=gate)
    token, weights, ids, gate = tokens_of(1)
    for prefill in dict.fromkeys(fp8_tiles.PREFILL_TILES.values()):
        fp8_grouped_experts(token, weights, ids, experts, w8a16=w8a16, prefill=prefill, shared_gate=gate)
    if rowwise_fits(token, experts) and not w8a16:
        fp8_grouped_experts(token, weights, ids, experts, rowwise=True, shared_gate=gate)
