"""Top-k MoE routing in one Triton launch (same math as `moe/reference.route`, which takes torch five or six
kernels: softmax, topk's select and sort, the renormalising sum and division, the cast).

One program per block of rows. Each row's probabilities p = softmax(logits) in fp32; the k picks are made by k
rounds of "take the largest, then mask it out" (ties go to the lowest expert id; torch.topk leaves their order
unspecified), so they come out in descending order as torch.topk's do. Weights: the picked p, divided by their
sum when renormalising, rounded once to the logits' dtype.

`route_sorted`: the routing and the pair sort of `triton_sort` in one launch, for a decode step's few rows (at most
`triton_sort.MAX_PAIRS` pairs, `MAX_ROUTE_EXPERTS` experts): one program routes every row, block by block, stores
the weights and ids, waits at a barrier for all its threads' stores, then sorts the ids it stored.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridcache.kernels import pdl
from hybridcache.kernels.moe.triton_sort import MAX_PAIRS, block_size, block_sizes, sort_block

_BLOCK_T = 16
MAX_ROUTE_EXPERTS = 256  # `route_sorted`'s limit: one program routes every row, [16, E] at a time


@triton.jit
def route_rows(logits_ptr, weights_ptr, ids_ptr, rows, num_rows, num_experts, stride_l, TOP_K: tl.constexpr,
               RENORMALIZE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    """Route rows [BLOCK_T] (int64; those >= num_rows are padding): their weights and ids stored (module
    docstring)."""
    experts = tl.arange(0, BLOCK_E)
    row_ok = rows < num_rows
    ok = row_ok[:, None] & (experts[None, :] < num_experts)
    x = tl.load(logits_ptr + rows[:, None] * stride_l + experts[None, :], mask=ok, other=float("-inf"))
    x = x.to(tl.float32)
    x = tl.where(row_ok[:, None], x, 0.0)  # padding rows: finite, never stored
    p = tl.exp(x - tl.max(x, axis=1)[:, None])
    p = p / tl.sum(p, axis=1)[:, None]
    p = tl.where(ok, p, -1.0)  # padding experts are never picked
    slots = tl.arange(0, BLOCK_K)
    picked_w = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.float32)
    picked_i = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.int64)
    for j in tl.static_range(TOP_K):
        best = tl.max(p, axis=1)
        first = tl.min(tl.where(p == best[:, None], experts[None, :], BLOCK_E), axis=1)
        picked_w = tl.where(slots[None, :] == j, best[:, None], picked_w)
        picked_i = tl.where(slots[None, :] == j, first[:, None].to(tl.int64), picked_i)
        p = tl.where(experts[None, :] == first[:, None], -1.0, p)
    if RENORMALIZE:
        picked_w = picked_w / tl.sum(tl.where(slots[None, :] < TOP_K, picked_w, 0.0), axis=1)[:, None]
    out = rows[:, None] * TOP_K + slots[None, :]
    keep = row_ok[:, None] & (slots[None, :] < TOP_K)
    tl.store(weights_ptr + out, picked_w.to(weights_ptr.dtype.element_ty), mask=keep)
    tl.store(ids_ptr + out, picked_i, mask=keep)


@triton.jit(do_not_specialize=["num_rows"])  # the step's token count: one compiled variant for all
def _route_kernel(logits_ptr, weights_ptr, ids_ptr, num_rows, num_experts, stride_l,
                  TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
                  BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    pdl.start(PDL)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    route_rows(logits_ptr, weights_ptr, ids_ptr, rows, num_rows, num_experts, stride_l, TOP_K, RENORMALIZE, BLOCK_T,
               BLOCK_E, BLOCK_K)


@triton.jit(do_not_specialize=["num_rows"])  # BLOCK_N (the pairs' bucket) tells the variants apart
def _route_sort_kernel(logits_ptr, weights_ptr, ids_ptr, order_ptr, counts_ptr, num_rows, num_experts, stride_l,
                       TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
                       BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, SORT_E: tl.constexpr, PDL: tl.constexpr):
    pdl.start(PDL)
    for start in range(0, num_rows, BLOCK_T):
        rows = start + tl.arange(0, BLOCK_T).to(tl.int64)
        route_rows(logits_ptr, weights_ptr, ids_ptr, rows, num_rows, num_experts, stride_l, TOP_K, RENORMALIZE,
                   BLOCK_T, BLOCK_E, BLOCK_K)
    tl.debug_barrier()  # every thread's ids stored (and visible to the block) before any is read back
    sort_block(ids_ptr, order_ptr, counts_ptr, num_rows * TOP_K, num_experts, TOP_K, BLOCK_N, SORT_E, False)


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] (unit stride on E) -> (weights [T, top_k] in logits' dtype, ids [T, top_k] int64)."""
    num_rows, num_experts = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    weights = torch.empty((num_rows, top_k), dtype=logits.dtype, device=logits.device)
    ids = torch.empty((num_rows, top_k), dtype=torch.int64, device=logits.device)
    if num_rows:
        _route_kernel[(triton.cdiv(num_rows, _BLOCK_T),)](
            logits, weights, ids, num_rows, num_experts, logits.stride(0), TOP_K=top_k, RENORMALIZE=renormalize,
            BLOCK_T=_BLOCK_T, BLOCK_E=triton.next_power_of_2(num_experts), BLOCK_K=triton.next_power_of_2(top_k),
            **pdl.options(logits),
        )
    return weights, ids


def fits_route_sorted(num_rows: int, top_k: int, num_experts: int) -> bool:
    """Whether `route_sorted` takes a step of `num_rows` tokens (1 to MAX_PAIRS pairs, at most MAX_ROUTE_EXPERTS
    experts); shapes alone decide, so a captured graph and an eager run of one batch launch the same kernels."""
    return 0 < num_rows * top_k <= MAX_PAIRS and num_experts <= MAX_ROUTE_EXPERTS


def route_sorted(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, ...]:
    """`route` and `grouped.sort_pairs` of its ids in one launch (module docstring): logits [T, E] (unit stride on
    E; `fits_route_sorted`) -> (weights [T, k] in logits' dtype, ids [T, k] int64, order [T*k] int64, counts [E]
    int32), each equal to what the two launches give."""
    num_rows, num_experts = logits.shape
    if not fits_route_sorted(num_rows, top_k, num_experts):
        raise ValueError(f"route_sorted routes 1 to {MAX_PAIRS} pairs over at most {MAX_ROUTE_EXPERTS} experts, got "
                         f"{num_rows} x top-{top_k} over {num_experts}")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    device = logits.device
    weights = torch.empty((num_rows, top_k), dtype=logits.dtype, device=device)
    ids = torch.empty((num_rows, top_k), dtype=torch.int64, device=device)
    order = torch.empty(num_rows * top_k, dtype=torch.int64, device=device)
    counts = torch.empty(num_experts, dtype=torch.int32, device=device)
    block_n = block_size(num_rows * top_k)
    _route_sort_kernel[(1,)](
        logits, weights, ids, order, counts, num_rows, num_experts, logits.stride(0), TOP_K=top_k,
        RENORMALIZE=renormalize, BLOCK_T=_BLOCK_T, BLOCK_E=triton.next_power_of_2(num_experts),
        BLOCK_K=triton.next_power_of_2(top_k), BLOCK_N=block_n, SORT_E=triton.next_power_of_2(num_experts + 1),
        num_warps=4, **pdl.options(logits),
    )
    return weights, ids, order, counts


def compile_route_sorted(logits: torch.Tensor, top_k: int, renormalize: bool) -> None:
    """Run `route_sorted` once at each of its pair-count buckets (`triton_sort.block_sizes`) on logits' dtype,
    device and expert count, so that every variant a step can launch compiles when the engine starts (the first
    forward that stacks the experts) and not inside a request."""
    num_experts = logits.shape[1]
    for block_n in block_sizes():
        rows = block_n // top_k
        if rows and fits_route_sorted(rows, top_k, num_experts) and block_size(rows * top_k) == block_n:
            route_sorted(torch.zeros((rows, num_experts), dtype=logits.dtype, device=logits.device), top_k,
                         renormalize)
