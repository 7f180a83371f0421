"""Top-k MoE routing in one Triton launch (same math as `moe/reference.route`, which takes torch five or six
kernels: softmax, topk's select and sort, the renormalising sum and division, the cast), and the one-group sigmoid
routing of Nemotron-H, Kimi Linear and LFM2-MoE (`route_sigmoid`, as `moe/reference.route_sigmoid`: eight or nine).

One program of one warp per row in a decode step (`launch_rows`): a row's reductions over the experts stay in its
warp (lane shuffles), where a program of 16 rows and 4 warps reduces through shared memory in each of the k rounds; a
prefill's thousands of rows over a few experts take the 16-row programs (one program a row is then as many
programs as rows). Each row's scores p in fp32 (softmax(logits), or sigmoid(logits) ranked as p + bias); the k
picks are made by k rounds of "take the largest rank, then mask it out" (ties go to the lowest expert id;
torch.topk leaves their order unspecified), so they come out in descending order as torch.topk's do. Weights: the
picked p, divided by their sum (+ eps with sigmoid) when renormalising, times the scale with sigmoid, rounded once
to the logits' dtype. A row whose logits hold a NaN (or, with softmax, an inf: its p all NaN) ranks NaN above
every other rank, as torch.topk does: its ids stay distinct experts in range, its weights NaN. (Picking "the
largest" of a NaN row matched no expert and gave id BLOCK_E to every pick, which the pair sort then indexed past
its counts with.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridcache.kernels import pdl


def launch_rows(num_rows: int, num_experts: int) -> tuple[int, int]:
    """(rows per program, warps) of the routing of `num_rows` rows over `num_experts`: one row and one warp up to 1,024
    rows or from 128 experts, else 16 rows and 4 warps. From `benchmarks/decode_kernel_sweep.py --only moe_route`
    on an H100 (docs/bench.md, session 71): 64 rows over 512 experts top-10 (Qwen3-Next-80B) 4.6 us against 39 with
    16 rows a program, over next-16b's 32 top-8 2.3 against 4.9, next-1b's 16 top-4 2.0 against 1.9; 16,384 rows
    20 us against 3.4 (16 experts) and 8.5 (32), but 64 against 180 (512). Two compiled variants at most: the
    engine's start-up runs both (its profiling forward fills the token budget, its decode graphs are small)."""
    return (1, 1) if num_rows <= 1024 or num_experts >= 128 else (16, 4)


@triton.jit(do_not_specialize=["num_rows"])  # the step's token count: one compiled variant for all
def _route_kernel(logits_ptr, weights_ptr, ids_ptr, bias_ptr, num_rows, num_experts, stride_l, eps, scale,
                  TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
                  BLOCK_K: tl.constexpr, PDL: tl.constexpr, SIGMOID: tl.constexpr = False):
    pdl.start(PDL)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    experts = tl.arange(0, BLOCK_E)
    row_ok = rows < num_rows
    ok = row_ok[:, None] & (experts[None, :] < num_experts)
    x = tl.load(logits_ptr + rows[:, None] * stride_l + experts[None, :], mask=ok, other=float("-inf"))
    x = x.to(tl.float32)
    x = tl.where(row_ok[:, None], x, 0.0)  # padding rows: finite, never stored
    if SIGMOID:  # p = sigmoid(x); the choice ranks p + bias; padding experts rank below every real one
        p = tl.sigmoid(x)
        bias = tl.load(bias_ptr + experts, mask=experts < num_experts, other=0.0).to(tl.float32)
        rank = tl.where(ok, p + bias[None, :], float("-inf"))
        picked_rank = float("-inf")
    else:
        p = tl.exp(x - tl.max(x, axis=1)[:, None])
        p = p / tl.sum(p, axis=1)[:, None]
        p = tl.where(ok, p, -1.0)  # padding experts are never picked
        rank = p
        picked_rank = -1.0
    rank = tl.where(rank != rank, float("inf"), rank)  # NaN above every other rank, as torch.topk ranks it
    slots = tl.arange(0, BLOCK_K)
    picked_w = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.float32)
    picked_i = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.int64)
    for j in tl.static_range(TOP_K):
        best = tl.max(rank, axis=1)
        first = tl.min(tl.where(rank == best[:, None], experts[None, :], BLOCK_E), axis=1)
        hit = experts[None, :] == first[:, None]
        picked_w = tl.where(slots[None, :] == j, tl.sum(tl.where(hit, p, 0.0), axis=1)[:, None], picked_w)
        picked_i = tl.where(slots[None, :] == j, first[:, None].to(tl.int64), picked_i)
        rank = tl.where(hit, picked_rank, rank)
    if RENORMALIZE:
        total = tl.sum(tl.where(slots[None, :] < TOP_K, picked_w, 0.0), axis=1)[:, None]
        if SIGMOID:  # noqa: SIM108 (a constexpr branch)
            picked_w = picked_w / (total + eps)
        else:
            picked_w = picked_w / total
    if SIGMOID:
        picked_w = picked_w * scale
    out = rows[:, None] * TOP_K + slots[None, :]
    keep = row_ok[:, None] & (slots[None, :] < TOP_K)
    tl.store(weights_ptr + out, picked_w.to(weights_ptr.dtype.element_ty), mask=keep)
    tl.store(ids_ptr + out, picked_i, mask=keep)


def route(logits: torch.Tensor, top_k: int, renormalize: bool, block_t: int | None = None,
          num_warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] (unit stride on E) -> (weights [T, top_k] in logits' dtype, ids [T, top_k] int64).
    block_t (rows per program), num_warps: the launch, by default `launch_rows`'s (benchmarks sweep them)."""
    return _launch(logits, top_k, renormalize, None, 0.0, 1.0, block_t, num_warps)


def route_sigmoid(logits: torch.Tensor, bias: torch.Tensor, top_k: int, renormalize: bool, eps: float,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`moe/reference.route_sigmoid` with one group (Nemotron-H's, Kimi Linear's and LFM2-MoE's routers): logits
    [T, E] fp32, bias [E] fp32 -> p = sigmoid(logits); the top_k of p + bias (descending; ties to the lowest id);
    weights the picks' p, divided by their sum + eps when `renormalize`, times `scale`: ([T, top_k] fp32, ids [T,
    top_k] int64)."""
    if logits.dtype != torch.float32 or bias.dtype != torch.float32 or tuple(bias.shape) != (logits.shape[1],):
        raise ValueError(f"route_sigmoid takes fp32 logits [T, E] and an fp32 bias [E], got {logits.dtype} "
                         f"{list(logits.shape)} and {bias.dtype} {list(bias.shape)}")
    return _launch(logits, top_k, renormalize, bias.contiguous(), eps, scale, None, None)


def _launch(logits: torch.Tensor, top_k: int, renormalize: bool, bias: torch.Tensor | None, eps: float,
            scale: float, block_t: int | None, num_warps: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    num_rows, num_experts = logits.shape
    rows, warps = launch_rows(num_rows, num_experts)
    block_t, num_warps = block_t or rows, num_warps or warps
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    weights = torch.empty((num_rows, top_k), dtype=logits.dtype, device=logits.device)
    ids = torch.empty((num_rows, top_k), dtype=torch.int64, device=logits.device)
    if num_rows:
        _route_kernel[(triton.cdiv(num_rows, block_t),)](
            logits, weights, ids, logits if bias is None else bias, num_rows, num_experts, logits.stride(0), eps,
            scale, TOP_K=top_k, RENORMALIZE=renormalize, BLOCK_T=block_t, num_warps=num_warps,
            BLOCK_E=triton.next_power_of_2(num_experts), BLOCK_K=triton.next_power_of_2(top_k),
            SIGMOID=bias is not None, **pdl.options(logits),
        )
    return weights, ids
