"""Routed experts of a sparse MoE block on CUDA without a host sync: one grouped GEMM per projection over
all experts (`torch._grouped_mm`), or the Triton expert GEMM when each expert has few rows. Same contract as
`moe/reference.py::routed_experts` (the layer routes and adds the shared expert).

Steps for T tokens, E experts, top-k (every tensor stays on the device; nothing is read back):
    order = stable sort of the T*k (token, pick) pairs by expert, counts per expert (`sort_pairs`: one Triton
        launch up to 1,024 pairs, triton_sort.py; else an int16 radix argsort and a scatter_add)
    few rows per expert (decode): the Triton expert GEMM (`triton_experts.expert_gemm`) reads x's rows through
        the sort and applies the activation in its epilogue (silu(gate) * up, or relu(up)^2 for ungated experts;
        h [T*k, I], sorted), then the down projection, written back in pair order (y [T*k, H])
    many rows (prefill): ends = cumsum(counts) (int32 group ends); pos = each pair's sorted row; xs = x[token
        of each sorted pair] (`triton_experts.spread`: each token row read once, written to its k sorted rows);
        h = silu(gate) * up of grouped_mm(xs, W_gate_up^T, ends) (`activation.triton.silu_mul` on its two column
        halves), or relu(.)^2 of grouped_mm(xs, W_up^T, ends) (`activation.triton.relu_square`);
        y = grouped_mm(h, W_down^T, ends), sorted
    out[t] = sum over its k picks of weight * y[row of the pick]  (`triton_experts.combine`: fp32 sum)

`torch._grouped_mm` runs CUTLASS's Hopper grouped GEMM for bf16 (sm90); other dtypes take torch's
fallback, which loops over the groups after copying `ends` to the host (a sync): fp32 is the exactness
path, not the fast one (the Triton expert GEMM multiplies fp32 in IEEE fp32 without a sync). Where each path
is faster was measured (`benchmarks/moe_bench.py`, docs/kernels.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from hybridcache.kernels.activation.triton import relu_square, silu_mul
from hybridcache.kernels.moe.reference import RELU2, SILU_GATED, check_activation
from hybridcache.kernels.moe.triton_experts import combine, expert_gemm, spread
from hybridcache.kernels.moe.triton_sort import MAX_EXPERTS, MAX_PAIRS, block_sizes, sort_pairs_triton
from hybridcache.kernels.parallel_compile import compiles_only
from hybridcache.kernels.streams import Pending, joined


@dataclass(frozen=True)
class ExpertWeights:
    """Expert weights stacked for the grouped GEMM, and the experts' activation (`reference.EXPERT_ACTIVATIONS`).

    gate_up [E, 2I, H]: rows [0, I) of expert e are gate_proj.weight, rows [I, 2I) up_proj.weight ("silu_gated");
            [E, I, H]: up_proj.weight alone ("relu2": ungated experts have no gate_proj)
    down    [E, H, I]: down_proj.weight
    """

    gate_up: torch.Tensor
    down: torch.Tensor
    activation: str = SILU_GATED

    @classmethod
    def stack(
        cls, gate: Sequence[torch.Tensor], up: Sequence[torch.Tensor], down: Sequence[torch.Tensor]
    ) -> ExpertWeights:
        """From per-expert nn.Linear weights: gate[e], up[e] [I, H]; down[e] [H, I] (copies)."""
        gate_up = torch.stack([torch.cat([g, u], dim=0) for g, u in zip(gate, up, strict=True)])
        return cls(gate_up=gate_up.contiguous(), down=torch.stack(list(down)).contiguous())

    @classmethod
    @torch.no_grad()
    def share(cls, experts: Sequence[nn.Module], activation: str = SILU_GATED) -> ExpertWeights:
        """Stack the experts' weights and re-point each expert's parameters at its slices of the stack, so
        the modules and the grouped GEMM share one copy of the weights (no doubled memory). "relu2" experts have
        `up_proj` and `down_proj` only."""
        check_activation(activation)
        if activation == RELU2:
            stacked = cls(gate_up=torch.stack([e.up_proj.weight for e in experts]).contiguous(),
                          down=torch.stack([e.down_proj.weight for e in experts]).contiguous(), activation=RELU2)
            for e, expert in enumerate(experts):
                expert.up_proj.weight.data = stacked.gate_up[e]
                expert.down_proj.weight.data = stacked.down[e]
            return stacked
        stacked = cls.stack([e.gate_proj.weight for e in experts], [e.up_proj.weight for e in experts],
                            [e.down_proj.weight for e in experts])
        inter = stacked.gate_up.shape[1] // 2
        for e, expert in enumerate(experts):
            expert.gate_proj.weight.data = stacked.gate_up[e, :inter]
            expert.up_proj.weight.data = stacked.gate_up[e, inter:]
            expert.down_proj.weight.data = stacked.down[e]
        return stacked


def sort_pairs(top_ids: torch.Tensor, num_experts: int, shared: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """top_ids [T, k] int64 -> (order [T*k]: the (token, pick) pairs stably sorted by expert, counts [E] int32),
    both on the device. Up to `triton_sort.MAX_PAIRS` pairs over at most `MAX_EXPERTS` experts on CUDA: one
    Triton launch; else torch's radix sort (the same result, exactly). `shared`: top_ids are routed picks and
    expert E - 1 is every token's pick k + 1 (a stack holding the shared expert): the sort of the [T, k + 1] ids
    with that last column, order [T*(k + 1)] (`triton_sort`'s module docstring), the Triton launch as wide as the
    routed picks."""
    if num_experts > torch.iinfo(torch.int16).max:
        raise ValueError(f"{num_experts} experts: the grouped MoE sorts expert ids as int16 (at most 32,767)")
    if top_ids.is_cuda and 0 < top_ids.numel() <= MAX_PAIRS and num_experts <= MAX_EXPERTS:
        return sort_pairs_triton(top_ids, num_experts, shared)
    if shared:
        top_ids = torch.cat([top_ids, top_ids.new_full((top_ids.shape[0], 1), num_experts - 1)], dim=1)
    return sort_pairs_torch(top_ids, num_experts)


def sort_pairs_torch(top_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`sort_pairs` in torch: an int16 radix argsort and a scatter_add (any device, any number of pairs)."""
    flat_ids = top_ids.reshape(-1)
    # int16 keys (E <= 32,767): the radix sort makes 4x fewer passes than over int64 (docs/bench.md, "Kernels")
    order = torch.argsort(flat_ids.to(torch.int16), stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int32, device=top_ids.device)
    counts.scatter_add_(0, flat_ids, torch.ones_like(flat_ids, dtype=torch.int32))
    return order, counts


TRITON_MAX_ROWS_PER_EXPERT = 64


def tile_rows(num_rows: int, num_experts: int) -> int | None:
    """BLOCK_M of the Triton expert GEMM for R = T*k rows over E experts, or None when the grouped GEMM is the
    faster choice. Decided from shapes alone, so a captured decode graph and an eager run of the same batch take
    the same path. The tile is about twice the mean rows per expert (16 to 64), so most experts fit one tile and
    their weights are read once; above 64 rows per expert mean the grouped GEMM wins (`benchmarks/moe_bench.py`;
    measured figures in docs/bench.md, "Figures behind the code's choices")."""
    per_expert = num_rows / num_experts
    if per_expert > TRITON_MAX_ROWS_PER_EXPERT:
        return None
    return 16 if per_expert <= 8 else 32 if per_expert <= 16 else 64


DEFAULT_TILE = dict(block_n=64, block_k=128, num_warps=4, num_stages=3, swap_ab=False)
# Launches measured faster than DEFAULT_TILE, by (the GEMM's weight rows N_w and depth K per expert, block_m): the
# routed experts of a 64-sequence decode step (`benchmarks/decode_kernel_sweep.py --only experts`; figures in
# docs/bench.md, "issue 32, seventh pass"). Others run DEFAULT_TILE.
MEASURED_TILES = {
    (1024, 2048, 32): dict(block_n=64, block_k=64, num_warps=4, num_stages=6, swap_ab=True),  # next-1b gate/up
    (2048, 512, 32): dict(block_n=128, block_k=64, num_warps=4, num_stages=4, swap_ab=True),  # next-1b down
}


def launch_tile(weights: torch.Tensor, block_m: int) -> dict:
    """The expert GEMM's launch settings (expert_gemm's keywords but block_m) for stacked weights [E, N_w, K] at
    tiles of block_m rows: `MEASURED_TILES`' entry, else `DEFAULT_TILE`. From shapes alone (a captured graph and
    an eager run of one batch launch the same kernels)."""
    return MEASURED_TILES.get((weights.shape[1], weights.shape[2], block_m), DEFAULT_TILE)


def expert_rows_triton(x: torch.Tensor, order: torch.Tensor, counts: torch.Tensor, top_k: int,
                       experts: ExpertWeights, block_m: int, **tile: int) -> torch.Tensor:
    """y [T*k, H] in pair order (row t*k + j): each pair's expert output, by the Triton expert GEMM (gather,
    activation and un-permutation fused). `tile`: expert_gemm's other tile settings for both GEMMs (benchmarks
    sweep them); by default each GEMM's `launch_tile`."""
    gated = experts.activation == SILU_GATED
    h = expert_gemm(x, order, top_k, experts.gate_up, counts, gather=True, scatter=False, swiglu=gated,
                    relu2=not gated, block_m=block_m, **(tile or launch_tile(experts.gate_up, block_m)))
    return expert_gemm(h, order, top_k, experts.down, counts, gather=False, scatter=True, swiglu=False,
                       block_m=block_m, **(tile or launch_tile(experts.down, block_m)))


def expert_rows_grouped(x: torch.Tensor, pos: torch.Tensor, ends: torch.Tensor, top_k: int,
                        experts: ExpertWeights) -> torch.Tensor:
    """y [T*k, H] in sorted order: each sorted row's expert output, by two grouped GEMMs with the token rows
    spread to their sorted rows (pos: `pair_rows`) and the activation between them (module docstring)."""
    h = torch._grouped_mm(spread(x, pos, top_k), experts.gate_up.transpose(1, 2), offs=ends)
    h = relu_square(h) if experts.activation == RELU2 else silu_mul(*h.chunk(2, dim=-1))
    return torch._grouped_mm(h, experts.down.transpose(1, 2), offs=ends)


def grouped_experts(
    x: torch.Tensor, top_weights: torch.Tensor, top_ids: torch.Tensor, experts: ExpertWeights,
    shared: tuple[torch.Tensor | None, torch.Tensor | Pending] | None = None,
) -> torch.Tensor:
    """x [T, H], top_weights [T, k] (x's dtype), top_ids [T, k] int64 -> [T, H] in x's dtype:
    out[t] = sum_j top_weights[t, j] * expert_{top_ids[t, j]}(x[t]), plus sigmoid(gate[t]) * shared[t] in the
    combine's launch when `shared` = (gate [T, 1], shared [T, H]) is given (`triton_experts.combine`; gate None:
    plus shared[t]). A shared
    output pending on the side stream (`kernels/streams.py`) is joined after the sort and the expert GEMMs were
    launched, right before the combine: the side stream's work overlaps all of them."""
    top_k = top_ids.shape[1]
    num_experts = experts.gate_up.shape[0]
    order, counts = sort_pairs(top_ids, num_experts)
    block_m = tile_rows(order.numel(), num_experts)
    if block_m is None:
        ends, pos = counts.cumsum(0, dtype=torch.int32), pair_rows(order)
        rows = expert_rows_grouped(x, pos, ends, top_k, experts)
    else:
        rows, pos = expert_rows_triton(x, order, counts, top_k, experts, block_m), None
    return combine(rows, top_weights, pos, None if shared is None else (shared[0], joined(shared[1])))


def compile_tiles(x: torch.Tensor, experts: ExpertWeights, top_k: int) -> None:
    """Compile every Triton variant the routed experts can launch for this block's shapes (each launched once on
    x's dtype and device under `parallel_compile.compiles_only`: side by side, nothing run), so that they compile
    when the engine starts (its profiling forward stacks the experts) and not inside the first request that needs
    one (what that costs: docs/bench.md, "Start-up compiles"): the one-launch sort at each of its pair-count
    buckets (`triton_sort.block_sizes`), the expert GEMM with each tile `tile_rows` can pick (each with its
    `launch_tile`), and the combine of its output (alone, with the shared expert's gated add and with an ungated
    one)."""
    num_experts = experts.gate_up.shape[0]
    if x.is_cuda and num_experts <= MAX_EXPERTS:
        with compiles_only():
            for block_n in block_sizes():
                sort_pairs_triton(torch.arange(block_n, device=x.device).remainder(num_experts)[:, None],
                                  num_experts)
    ids = torch.arange(top_k, device=x.device).remainder(num_experts)[None, :]
    order, counts = sort_pairs(ids, num_experts)  # run: the launches below take its output
    token = torch.zeros((1, experts.gate_up.shape[2]), dtype=x.dtype, device=x.device)
    weights = torch.ones((1, top_k), dtype=x.dtype, device=x.device)
    with compiles_only():
        for block_m in (16, 32, 64):
            combine(expert_rows_triton(token, order, counts, top_k, experts, block_m), weights)
        combine(token.repeat(top_k, 1), weights, shared=(token[:, :1], token))  # the shared expert's gated add
        combine(token.repeat(top_k, 1), weights, shared=(None, token))  # an ungated one (Granite's shared MLP)


def pair_rows(order: torch.Tensor) -> torch.Tensor:
    """The inverse of the sort: pos [T*k], pos[order[r]] = r (the sorted row of each (token, pick) pair)."""
    return torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
