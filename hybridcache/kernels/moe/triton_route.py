"""Top-k MoE routing in one Triton launch (same math as `moe/reference.route`, which takes torch five or six
kernels: softmax, topk's select and sort, the renormalising sum and division, the cast).

One program of one warp per row in a decode step (`launch`): a row's reductions over the experts stay in its warp
(lane shuffles), where a program of 16 rows and 4 warps reduces through shared memory in each of the k rounds; a
prefill's thousands of rows over a few experts take the 16-row programs (one program a row is then as many
programs as rows). Each
row's probabilities p = softmax(logits) in fp32; the k picks are made by k rounds of "take the largest, then mask
it out" (ties go to the lowest expert id; torch.topk leaves their order unspecified), so they come out in
descending order as torch.topk's do. Weights: the picked p, divided by their sum when renormalising, rounded once
to the logits' dtype. A row whose logits hold a NaN or an inf (its p all NaN) ranks NaN above every probability,
as torch.topk does: its ids stay distinct experts in range, its weights NaN. (Picking "the largest" of a NaN row
matched no expert and gave id BLOCK_E to every pick, which the pair sort then indexed past its counts with.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridcache.kernels import pdl


def launch(num_rows: int, num_experts: int) -> tuple[int, int]:
    """(rows per program, warps) of the routing of `num_rows` rows over `num_experts`: one row and one warp up to 1,024
    rows or from 128 experts, else 16 rows and 4 warps. From `benchmarks/decode_kernel_sweep.py --only moe_route`
    on an H100 (docs/bench.md, session 71): 64 rows over 512 experts top-10 (Qwen3-Next-80B) 4.6 us against 39 with
    16 rows a program, over next-16b's 32 top-8 2.3 against 4.9, next-1b's 16 top-4 2.0 against 1.9; 16,384 rows
    20 us against 3.4 (16 experts) and 8.5 (32), but 64 against 180 (512). Two compiled variants at most: the
    engine's start-up runs both (its profiling forward fills the token budget, its decode graphs are small)."""
    return (1, 1) if num_rows <= 1024 or num_experts >= 128 else (16, 4)


@triton.jit(do_not_specialize=["num_rows"])  # the step's token count: one compiled variant for all
def _route_kernel(logits_ptr, weights_ptr, ids_ptr, num_rows, num_experts, stride_l,
                  TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
                  BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    pdl.start(PDL)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    experts = tl.arange(0, BLOCK_E)
    row_ok = rows < num_rows
    ok = row_ok[:, None] & (experts[None, :] < num_experts)
    x = tl.load(logits_ptr + rows[:, None] * stride_l + experts[None, :], mask=ok, other=float("-inf"))
    x = x.to(tl.float32)
    x = tl.where(row_ok[:, None], x, 0.0)  # padding rows: finite, never stored
    p = tl.exp(x - tl.max(x, axis=1)[:, None])
    p = p / tl.sum(p, axis=1)[:, None]
    p = tl.where(ok, p, -1.0)  # padding experts are never picked
    rank = tl.where(p != p, float("inf"), p)  # NaN above every probability, as torch.topk ranks it
    slots = tl.arange(0, BLOCK_K)
    picked_w = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.float32)
    picked_i = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.int64)
    for j in tl.static_range(TOP_K):
        best = tl.max(rank, axis=1)
        first = tl.min(tl.where(rank == best[:, None], experts[None, :], BLOCK_E), axis=1)
        hit = experts[None, :] == first[:, None]
        picked_w = tl.where(slots[None, :] == j, tl.sum(tl.where(hit, p, 0.0), axis=1)[:, None], picked_w)
        picked_i = tl.where(slots[None, :] == j, first[:, None].to(tl.int64), picked_i)
        rank = tl.where(hit, -1.0, rank)
    if RENORMALIZE:
        picked_w = picked_w / tl.sum(tl.where(slots[None, :] < TOP_K, picked_w, 0.0), axis=1)[:, None]
    out = rows[:, None] * TOP_K + slots[None, :]
    keep = row_ok[:, None] & (slots[None, :] < TOP_K)
    tl.store(weights_ptr + out, picked_w.to(weights_ptr.dtype.element_ty), mask=keep)
    tl.store(ids_ptr + out, picked_i, mask=keep)


def route(logits: torch.Tensor, top_k: int, renormalize: bool, block_t: int | None = None,
          num_warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] (unit stride on E) -> (weights [T, top_k] in logits' dtype, ids [T, top_k] int64).
    block_t (rows per program), num_warps: the launch, by default `launch`'s (benchmarks sweep them)."""
    num_rows, num_experts = logits.shape
    rows, warps = launch(num_rows, num_experts)
    block_t, num_warps = block_t or rows, num_warps or warps
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    weights = torch.empty((num_rows, top_k), dtype=logits.dtype, device=logits.device)
    ids = torch.empty((num_rows, top_k), dtype=torch.int64, device=logits.device)
    if num_rows:
        _route_kernel[(triton.cdiv(num_rows, block_t),)](
            logits, weights, ids, num_rows, num_experts, logits.stride(0), TOP_K=top_k, RENORMALIZE=renormalize,
            BLOCK_T=block_t, num_warps=num_warps, BLOCK_E=triton.next_power_of_2(num_experts),
            BLOCK_K=triton.next_power_of_2(top_k),
            **pdl.options(logits),
        )
    return weights, ids
