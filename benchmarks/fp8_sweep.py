"""Tile sweep of the FP8 GEMMs on the GPU (issue 29): which configuration of `triton_block_fp8` (W8A16 for decode,
W8A8 for prefill) and of `triton_fp8_moe` to pick per shape, each with its error against the reference.

    PYTHONPATH=. python benchmarks/fp8_sweep.py [--out DIR] [--budget-s S] [--quick | --rowwise | --splitk |
        --prefill] [--smoke]

Dense shapes (N x K): the 80B's o_proj 2,048 x 4,096 and shared gate_up 1,024 x 2,048, next-16b's qkvz
12,288 x 4,096 and 28,672 x 8,192; M = 1 and 64 (W8A16 tiles), 256 to 8,192 (W8A8 tiles, `torch._scaled_mm` with
1x128 / 128x128 block scales (cuBLASLt, sm90), dequantise + bf16, W8A16 at 256). Routed experts: next-16b (32
experts top-8, 4,096 / 1,024) at 1, 64, 128 and 1,024 tokens over W8A16 / W8A8 tiles. Each row: the median ms of
a CUDA graph of back-to-back calls cycling over enough weight copies that they do not sit in L2 (as in a model,
whose every layer has its own weights), and max |err| / max |ref| against the product of the dequantised weights
(W8A16: the bf16 activations; W8A8: the quantised ones). Also whether `triton_quant.quantize_groups` equals torch's
`quantize_groups` bit for bit. Items run in priority order and the sweep stops starting new ones after --budget-s
(Triton compiles each new tile on first use). Prints a table and writes DIR/fp8_sweep.json (DIR: --out, $OUT, .).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

from hybridcache.fp8_format import BLOCK, FP8_DTYPE
from hybridcache.kernels.gemm import reference, triton_quant
from hybridcache.kernels.gemm.fp8_tiles import PrefillTile
from hybridcache.kernels.gemm.triton_block_fp8 import TileConfig, fp8_gemm
from hybridcache.kernels.gemm.triton_fp8_moe import Fp8ExpertWeights, fp8_expert_gemm, fp8_grouped_experts

DEVICE = "cuda"  # --smoke: "cpu" (TRITON_INTERPRET=1), tiny shapes, one eager timing
L2_BYTES = 3 * 2**27  # cycle over weight copies adding up to more than the H200's 50 MiB L2
# decode (M <= 64): (mode, swap-AB, BLOCK_N); BLOCK_M from M (16, 32, 64)
DECODE_TILES = [("w8a16", True, 64), ("w8a8", True, 64), ("w8a16", False, 32), ("w8a16", False, 64)]
DECODE_CUBLAS = True
W8A8_TILES = [TileConfig(64, 128), TileConfig(128, 128, num_warps=8), TileConfig(128, 256, num_warps=8, num_stages=3)]


def timed(calls: list) -> float:
    if DEVICE == "cpu":
        begin = time.perf_counter()
        calls[0]()
        return (time.perf_counter() - begin) * 1e3
    return timed_cuda(calls)


def timed_cuda(calls: list) -> float:
    """Median ms of one call in a CUDA graph of back-to-back calls cycling over `calls` (about 5 ms of work per
    replay); eager if the calls cannot be captured."""
    for call in calls[:2]:
        call()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    calls[-1]()
    end.record()
    end.synchronize()
    reps = max(2, min(24, round(5.0 / max(start.elapsed_time(end), 1e-3))))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        calls[0]()
    torch.cuda.current_stream().wait_stream(stream)
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for r in range(reps):
                calls[r % len(calls)]()
        replay = graph.replay
    except RuntimeError:
        torch.cuda.synchronize()

        def replay() -> None:
            for r in range(reps):
                calls[r % len(calls)]()
    times = []
    for _ in range(5):
        start.record()
        replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / reps)
    return statistics.median(times)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def copies(nbytes: int) -> int:
    return max(1, min(64, -(-L2_BYTES // nbytes)))


def cublas_block(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`torch._scaled_mm` with 1x128 activation and 128 x 128 weight scales (sm90, K and N multiples of 128)."""
    return F.scaled_mm(xq, weight.t(), x_scale.t().contiguous().t(), F.ScalingType.BlockWise1x128, scale.t(),
                       F.ScalingType.BlockWise128x128, output_dtype=torch.bfloat16)


ROWS = [1, 64, 256, 2048, 8192]
DENSE = {"80b o_proj": (2048, 4096), "80b shared gate_up": (1024, 2048), "next-16b qkvz": (12288, 4096),
         "28672x8192": (28672, 8192)}


def dense_weights(gen: torch.Generator, n: int, k: int):
    """A random [n, k] projection quantised to 128 x 128 blocks: (copies of (FP8 weight, scale) for cache-cold
    timing, bf16 dequantised copies, the fp32 dequantisation the errors are taken against)."""
    dense = torch.randn(n, k, generator=gen, device=DEVICE) / k**0.5
    w, s = reference.quantize(dense, BLOCK)
    del dense
    ws = [(w.clone(), s.clone()) for _ in range(copies(w.numel()))]
    wbf = [reference.dequantize(a, b, BLOCK, torch.bfloat16) for a, b in ws[: copies(2 * w.numel())]]
    w32 = reference.dequantize(w, s, BLOCK, torch.float32)
    return ws, wbf, w32


def dense_items(gen: torch.Generator):
    """(priority-ordered) closures, each returning one result row."""
    items = []
    for name, (n, k) in DENSE.items():
        ws, wbf, w32 = dense_weights(gen, n, k)
        for m in ROWS:
            if name == "80b shared gate_up" and m == 8192 or name == "next-16b qkvz" and m > 64:
                continue
            items.append((1 if m <= 64 else 2, lambda n=n, k=k, m=m, name=name, ws=ws, wbf=wbf, w32=w32:
                          dense_row(gen, name, n, k, m, ws, wbf, w32)))
    return items


def decode_row(x, ws, w32, mode, tile) -> dict:
    """One decode-sized GEMM as the engine runs it: W8A16, W8A8 with its quantisation launch, or cuBLAS's block
    scales with its quantisation launch; error against the product of the activations it multiplies."""
    from hybridcache.kernels.gemm.scaled_mm import block_fp8_linear

    def call(a, b):
        if mode == "w8a16":
            return fp8_gemm(x, None, a, b, BLOCK, torch.bfloat16, tile)
        if mode == "cublas-block":
            return block_fp8_linear(x, a, b)
        return fp8_gemm(*triton_quant.quantize_groups(x), a, b, BLOCK, torch.bfloat16, tile)

    try:
        got = call(*ws[0])
        xq, xs = triton_quant.quantize_groups(x)
        ref = (x.float() if mode == "w8a16" else xq.float() * xs.repeat_interleave(128, 1)) @ w32.T
        return {"kernel": mode, "tile": None if tile is None else tile.__dict__, "err": rel(got, ref),
                "ms": timed([lambda a=a, b=b: call(a, b) for a, b in ws])}
    except Exception as error:
        traceback.print_exc()
        return {"kernel": mode, "error": repr(error)[:300]}


def dense_row(gen, name, n, k, m, ws, wbf, w32) -> list[dict]:
    x = torch.randn(m, k, generator=gen, device=DEVICE).to(torch.bfloat16)
    rows = [{"shape": name, "N": n, "K": k, "M": m, "kernel": "bf16",
             "ms": timed([lambda b=b: F.linear(x, b) for b in wbf])}]
    if m <= 64:
        for mode, swap, block_n in DECODE_TILES:
            tile = TileConfig(16 if m <= 16 else 32 if m <= 32 else 64, block_n, swap_ab=swap)
            rows.append(decode_row(x, ws, w32, mode, tile) | {"shape": name, "N": n, "K": k, "M": m})
        for mode in ("cublas-block",) if DECODE_CUBLAS else ():
            rows.append(decode_row(x, ws, w32, mode, None) | {"shape": name, "N": n, "K": k, "M": m})
    if m >= 256:
        xq, xs = triton_quant.quantize_groups(x)
        ref8 = (xq.float() * xs.repeat_interleave(128, 1)) @ w32.T
        rows.append({"shape": name, "N": n, "K": k, "M": m, "kernel": "quant",
                     "ms": timed([lambda: triton_quant.quantize_groups(x)])})
        for tile in W8A8_TILES:
            got = fp8_gemm(xq, xs, ws[0][0], ws[0][1], BLOCK, torch.bfloat16, tile)
            rows.append({"shape": name, "N": n, "K": k, "M": m, "kernel": "w8a8", "tile": tile.__dict__,
                         "ms": timed([lambda a=a, b=b, t=tile: fp8_gemm(xq, xs, a, b, BLOCK, torch.bfloat16, t)
                                      for a, b in ws]), "err": rel(got, ref8)})
        try:
            got = cublas_block(xq, xs, *ws[0])
            rows.append({"shape": name, "N": n, "K": k, "M": m, "kernel": "cublas-block",
                         "ms": timed([lambda a=a, b=b: cublas_block(xq, xs, a, b) for a, b in ws]),
                         "err": rel(got, ref8)})
        except Exception as error:  # not in this torch build / GPU
            rows.append({"shape": name, "M": m, "kernel": "cublas-block", "error": repr(error)[:300]})
        rows.append({"shape": name, "N": n, "K": k, "M": m, "kernel": "dequant+bf16",
                     "ms": timed([lambda a=a, b=b: F.linear(x, reference.dequantize(a, b, BLOCK, torch.bfloat16))
                                  for a, b in ws[:4]])})
    return rows


def block_experts(gen: torch.Generator) -> tuple[Fp8ExpertWeights, dict[str, torch.Tensor], int]:
    """next-16b's routed experts on the GPU (a small set on the CPU): block-scaled FP8 weights, their fp32
    dequantisation ("gu", "d") and top_k."""
    experts, top_k, hidden, inter = (32, 8, 4096, 1024) if DEVICE == "cuda" else (4, 2, 256, 128)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=gen, device=DEVICE) / hidden**0.5
    down = torch.randn(experts, hidden, inter, generator=gen, device=DEVICE) / inter**0.5
    q_gu = [reference.quantize(w, BLOCK) for w in gate_up]
    q_d = [reference.quantize(w, BLOCK) for w in down]
    del gate_up, down
    fp8 = Fp8ExpertWeights(torch.stack([w for w, _ in q_gu]), torch.stack([s for _, s in q_gu]),
                           torch.stack([w for w, _ in q_d]), torch.stack([s for _, s in q_d]), BLOCK.block)
    deq = {"gu": torch.stack([reference.dequantize(w, s, BLOCK, torch.float32) for w, s in q_gu]),
           "d": torch.stack([reference.dequantize(w, s, BLOCK, torch.float32) for w, s in q_d])}
    del q_gu, q_d
    return fp8, deq, top_k


def expert_items(gen: torch.Generator):
    fp8, deq, top_k = block_experts(gen)
    items = [(0 if p[0] <= 64 else 3, lambda p=p: expert_row(gen, fp8, deq, top_k, *p)) for p in PLANS]
    items += [(4 + i, lambda tokens=tokens, tile=tile: prefill_row(gen, fp8, deq, top_k, tokens, tile))
              for i, tokens in enumerate(PREFILL_TOKENS) for tile in PREFILL_PLANS]
    items += [(4 + i, lambda tokens=tokens: gate_up_rows(gen, fp8, deq, tokens))
              for i, tokens in enumerate(GEMM_TOKENS)]
    return items + [(0 if tokens <= 64 else 3, lambda tokens=tokens: bf16_expert_row(gen, fp8, deq, top_k, tokens))
                    for tokens in BF16_EXPERTS]


# routed experts: (tokens, W8A16, BLOCK_M, BLOCK_N, swap-AB, num_warps, num_stages), in priority order. BLOCK_M at
# decode sizes is `moe.grouped.tile_rows`' (next-16b: 16 at T = 1, 32 at T = 64), the engine's. `--quick` sweeps
# QUICK_PLANS instead: the W8A8 swap-AB decode tile (the engine's) against deeper pipelines and wider weight tiles
# at T = 64 and 1, then the W8A8 prefill tiles at phase A's sizes (256 and 1,024 tokens); "bf16" rows
# (`BF16_EXPERTS`) time bf16's experts (Triton tile or grouped GEMM, as `moe.grouped` picks) at the same sizes
PLANS = [(64, True, 32, 64, True, 4, 3), (64, False, 32, 64, True, 4, 3), (64, True, 32, 64, False, 4, 3),
         (1, True, 16, 64, True, 4, 3), (1, False, 16, 64, True, 4, 3), (1, True, 16, 64, False, 4, 3),
         (1024, False, 64, 128, False, 8, 3), (1024, False, 64, 128, False, 4, 3), (128, True, 64, 64, True, 4, 3),
         (128, False, 64, 64, True, 4, 3), (64, False, 32, 128, True, 4, 3), (1024, False, 128, 128, False, 8, 3)]
QUICK_PLANS = [(tokens, False, 16 if tokens == 1 else 32, block_n, True, warps, stages) for tokens in (64, 1)
               for block_n, warps, stages in ((64, 4, 3), (64, 4, 4), (64, 4, 5), (128, 4, 3), (128, 8, 4))]
QUICK_PLANS += [(tokens, False, block_m, 128, False, warps, 3) for tokens in (256, 1024)
                for block_m, warps in ((64, 8), (64, 4), (128, 8))]
BF16_EXPERTS = [64, 1, 256, 1024]
# `--prefill`: the routed experts' W8A8 prefill tiles (`fp8_tiles.PrefillTile`) at PREFILL_TOKENS (next-16b: 4,096,
# 1,024 and 256 rows per expert; phase D's 16 x 1,024-token step first), bf16's experts at the same sizes, and the
# gate/up GEMM alone (`gate_up_rows`) at GEMM_TOKENS
PREFILL_PLANS: list[PrefillTile] = []
PREFILL_TOKENS: list[int] = []
GEMM_TOKENS: list[int] = []
PREFILL_CASES: dict[int, tuple] = {}
# main's tile first; then the grouped launch order, 128-row tiles (64 gate/up columns per accumulator, so both
# accumulators hold as much as a 128 x 128 tile), a 256-wide down GEMM, and small programs (2 stages, or a 64 x 64
# tile at 4 warps: less shared memory and fewer registers per program, so programs sharing an SM can hide each
# other's wait on the scaled MMA)
SWEEP_PREFILL_PLANS = [PrefillTile(), PrefillTile(group_m=8), PrefillTile(num_stages=2, group_m=8),
                       PrefillTile(128, 64, 128, 8, 3, 8), PrefillTile(128, 64, 128, 8, 2, 8),
                       PrefillTile(64, 128, 256, 8, 3, 8), PrefillTile(64, 128, 128, 4, 2, 8),
                       PrefillTile(64, 64, 128, 4, 3, 8), PrefillTile(num_stages=4, group_m=8)]


def prefill_row(gen, fp8, deq, top_k, tokens, tile: PrefillTile) -> list[dict]:
    """The routed experts at `tokens` with the W8A8 prefill tile `tile` (both GEMMs, quantisation and combine); one
    case (inputs and reference) per token count, shared by the tiles."""
    if tokens not in PREFILL_CASES:
        PREFILL_CASES.clear()  # (the sizes come in order: one case held at a time)
        PREFILL_CASES[tokens] = expert_case(gen, fp8, deq, top_k, tokens)
    x, weights, ids, want = PREFILL_CASES[tokens]

    def call() -> torch.Tensor:
        return fp8_grouped_experts(x, weights, ids, fp8, prefill=tile)

    return [{"experts": "next-16b", "tokens": tokens, "rows_per_expert": tokens * top_k // fp8.gate_up.shape[0],
             "kernel": "w8a8", "swap_ab": False, **tile.__dict__, "err": rel(call(), want), "ms": timed([call])}]


def gate_up_rows(gen, fp8, deq, tokens) -> list[dict]:
    """The gate/up GEMM alone over `tokens` rows split evenly over the experts (rows already sorted, no gather,
    no SwiGLU): bf16's `torch._grouped_mm` (CUTLASS), the Triton W8A8 kernel at each prefill tile's gate/up width
    (as one GEMM of 2I columns), and `F.scaled_grouped_mm` with row-wise scales (the per-channel format: weights
    re-quantised per row) and with 1x128 / 128x128 block scales, where this torch and GPU run them. Error against
    the dequantised block weights on the quantised rows."""
    experts, width, hidden = fp8.gate_up.shape
    per = tokens // experts
    ends = torch.arange(1, experts + 1, device=DEVICE, dtype=torch.int32) * per
    x = torch.randn(per * experts, hidden, generator=gen, device=DEVICE).to(torch.bfloat16)
    xq, xs = triton_quant.quantize_groups(x)
    xdq = (xq.float() * xs.repeat_interleave(128, 1)).view(experts, per, hidden)
    want = torch.bmm(xdq, deq["gu"].transpose(1, 2)).reshape(-1, width)
    base = {"gemm": "next-16b gate_up", "tokens": per * experts, "rows_per_expert": per}
    rows = []
    wbf = deq["gu"].to(torch.bfloat16)

    def bf16_call() -> torch.Tensor:
        return torch._grouped_mm(x, wbf.transpose(1, 2), offs=ends)

    rows.append(base | {"kernel": "bf16 grouped_mm", "err": rel(bf16_call(), want), "ms": timed([bf16_call])})
    order = torch.arange(per * experts, device=DEVICE)
    counts = torch.full((experts,), per, device=DEVICE, dtype=torch.int32)
    for tile in dict.fromkeys(PrefillTile(t.block_m, 2 * t.block_n, 0, t.num_warps, t.num_stages, t.group_m)
                              for t in PREFILL_PLANS[:4]):

        def triton_call(t=tile) -> torch.Tensor:
            return fp8_expert_gemm(xq, xs, order, 1, fp8.gate_up, fp8.gate_up_scale, counts, fp8.block,
                                   torch.bfloat16, gather=False, scatter=False, swiglu=False, block_m=t.block_m,
                                   block_n=t.block_n, num_warps=t.num_warps, num_stages=t.num_stages,
                                   group_m=t.group_m)

        rows.append(base | {"kernel": "w8a8", "tile": tile.__dict__, "err": rel(triton_call(), want),
                            "ms": timed([triton_call])})
    for name, call in scaled_grouped_calls(x, xq, xs, deq["gu"], fp8, ends).items():
        try:
            rows.append(base | {"kernel": name, "err": rel(call(), want), "ms": timed([call])})
        except Exception as error:  # not in this torch build / GPU
            rows.append(base | {"kernel": name, "error": repr(error)[:300]})
    return rows


def scaled_grouped_calls(x, xq, xs, w32, fp8, ends) -> dict:
    """`F.scaled_grouped_mm` closures over the gate/up weights: row-wise (x per token, weights per row, as the
    per-channel format) and block-wise (1x128 activations, 128x128 weights, as the block format)."""
    experts = w32.shape[0]
    amax = w32.abs().amax(dim=2, keepdim=True).clamp(min=1e-12)
    wq_row = (w32 * (448.0 / amax)).to(FP8_DTYPE)  # [E, N, K]
    w_row_scale = (amax / 448.0).reshape(experts, -1)  # [E, N]
    x_amax = x.float().abs().amax(dim=1).clamp(min=1e-12)
    xq_row = (x.float() * (448.0 / x_amax)[:, None]).to(FP8_DTYPE)
    x_row_scale = x_amax / 448.0

    def rowwise() -> torch.Tensor:
        return F.scaled_grouped_mm(xq_row, wq_row.transpose(1, 2), x_row_scale, F.ScalingType.RowWise,
                                   w_row_scale, F.ScalingType.RowWise, offs=ends, output_dtype=torch.bfloat16)

    def blockwise() -> torch.Tensor:
        return F.scaled_grouped_mm(xq, fp8.gate_up.transpose(1, 2), xs.t().contiguous().t(),
                                   F.ScalingType.BlockWise1x128, fp8.gate_up_scale.transpose(1, 2),
                                   F.ScalingType.BlockWise128x128, offs=ends, output_dtype=torch.bfloat16)

    return {"scaled_grouped_mm rowwise": rowwise, "scaled_grouped_mm block": blockwise}


def expert_row(gen, fp8, deq, top_k, tokens, w8a16, block_m, block_n, swap, warps, stages) -> list[dict]:
    x, weights, ids, want = expert_case(gen, fp8, deq, top_k, tokens)

    def call() -> torch.Tensor:
        return fp8_grouped_experts(x, weights, ids, fp8, block_m=block_m, w8a16=w8a16, block_n=block_n,
                                   swap_ab=swap, num_warps=warps, num_stages=stages)

    return [{"experts": "next-16b", "tokens": tokens, "rows_per_expert": tokens * top_k // fp8.gate_up.shape[0],
             "kernel": "w8a16" if w8a16 else "w8a8", "block_m": block_m,
             "block_n": block_n, "swap_ab": swap, "num_warps": warps, "num_stages": stages, "err": rel(call(), want),
             "ms": timed([call])}]


def expert_case(gen, fp8, deq, top_k, tokens):
    """(x, top weights, top ids, the dequantised experts' fp32 output on x) of `tokens` random tokens."""
    experts, hidden = fp8.gate_up.shape[0], fp8.gate_up.shape[2]
    x = torch.randn(tokens, hidden, generator=gen, device=DEVICE).to(torch.bfloat16)
    ids = torch.rand(tokens, experts, generator=gen, device=DEVICE).argsort(dim=1)[:, :top_k]  # k distinct each
    weights = torch.rand(tokens, top_k, generator=gen, device=DEVICE).to(torch.bfloat16)
    want = torch.zeros(tokens, hidden, device=DEVICE)
    inter = deq["d"].shape[2]
    for e in range(experts):  # the dequantised experts in fp32 on the bf16 activations
        t, j = (ids == e).nonzero(as_tuple=True)
        gu = x[t].float() @ deq["gu"][e].T
        y = (F.silu(gu[:, :inter]) * gu[:, inter:]) @ deq["d"][e].T
        want.index_add_(0, t, weights[t, j, None].float() * y)
    return x, weights, ids, want


def bf16_expert_row(gen, fp8, deq, top_k, tokens) -> list[dict]:
    """bf16's routed experts (the dequantised weights in bf16, `moe.grouped.grouped_experts`) at `tokens`."""
    from hybridcache.kernels.moe.grouped import ExpertWeights, grouped_experts

    x, weights, ids, want = expert_case(gen, fp8, deq, top_k, tokens)
    bf16 = ExpertWeights(deq["gu"].to(torch.bfloat16), deq["d"].to(torch.bfloat16))

    def call() -> torch.Tensor:
        return grouped_experts(x, weights, ids, bf16)

    return [{"experts": "next-16b", "tokens": tokens, "rows_per_expert": tokens * top_k // fp8.gate_up.shape[0],
             "kernel": "bf16", "err": rel(call(), want), "ms": timed([call])}]


# `--rowwise`: the routed experts re-quantised per output channel (`reference.requantize_rows`, what
# `Fp8ExpertWeights.share` does with `fp8_tiles.EXPERTS_PER_CHANNEL`) against the block-scaled ones, each as the
# engine runs it at ROWWISE_TOKENS (prefill: `F.scaled_grouped_mm` row-wise with the library's accumulation, and
# with the other one (`fp8_tiles.ROWWISE_FAST_ACCUM`), against the Triton W8A8 prefill tile; decode: the Triton
# decode tile with (1, 128) scale blocks), bf16's experts at each; errors of both against the block-scaled
# experts dequantised (the checkpoint's weights); then the dense projections of a next-16b decode step at
# DECODE_SHAPE_ROWS rows, cuBLAS's block-scaled GEMM against the Triton W8A8 swap-AB tile
# (`triton_block_fp8.decode_config`), each with its quantisation launch
ROWWISE_TOKENS = [16384, 4096, 1024, 256, 64, 1]
ROWWISE_PRIORITY = {16384: 0, 64: 1, 4096: 3, 1: 4, 1024: 5, 256: 6}  # the dense shapes: 2
NEXT16B_DENSE = {"qkvz": (12288, 4096), "attn q+gate": (8192, 4096), "out_proj / o_proj": (4096, 4096),
                 "shared gate_up": (2048, 4096), "shared gate / up": (1024, 4096), "attn k / v": (512, 4096),
                 "shared down": (4096, 1024)}
DECODE_SHAPE_ROWS = [64, 16]


def per_channel_experts(fp8: Fp8ExpertWeights) -> Fp8ExpertWeights:
    """`fp8` re-quantised per output channel as `Fp8ExpertWeights.share` does (`fp8_tiles.EXPERTS_PER_CHANNEL`)."""
    gate_up, gate_up_rows = reference.requantize_rows(fp8.gate_up, fp8.gate_up_scale, fp8.block)
    down, down_rows = reference.requantize_rows(fp8.down, fp8.down_scale, fp8.block)
    bk = fp8.block[1]

    def blocks(rows: torch.Tensor, depth: int) -> torch.Tensor:
        return rows[:, :, None].expand(-1, -1, -(-depth // bk))  # as `Fp8ExpertWeights.share`: a K stride of 0

    return Fp8ExpertWeights(gate_up, blocks(gate_up_rows, gate_up.shape[2]), down, blocks(down_rows, down.shape[2]),
                            (1, bk), gate_up_rows, down_rows)


def rowwise_items(gen: torch.Generator):
    """(priority, closure) items of `--rowwise` (above)."""
    fp8, deq, top_k = block_experts(gen)
    channel = per_channel_experts(fp8)
    items = [(ROWWISE_PRIORITY.get(tokens, 9), lambda tokens=tokens: rowwise_row(gen, fp8, channel, deq, top_k,
                                                                                tokens)) for tokens in ROWWISE_TOKENS]
    items += [(2, lambda name=name, shape=shape: decode_shape_rows(gen, name, *shape))
              for name, shape in NEXT16B_DENSE.items()]
    return sorted(items, key=lambda item: item[0])


def rowwise_row(gen, fp8, channel, deq, top_k, tokens) -> list[dict]:
    from hybridcache.kernels.gemm import fp8_tiles
    from hybridcache.kernels.moe.grouped import ExpertWeights, grouped_experts

    x, weights, ids, want = expert_case(gen, fp8, deq, top_k, tokens)
    base = {"experts": "next-16b", "tokens": tokens, "rows_per_expert": tokens * top_k // fp8.gate_up.shape[0]}
    bf16 = ExpertWeights(deq["gu"].to(torch.bfloat16), deq["d"].to(torch.bfloat16))
    calls = {"block (engine's)": lambda: fp8_grouped_experts(x, weights, ids, fp8),
             "per-channel (engine's)": lambda: fp8_grouped_experts(x, weights, ids, channel),
             "bf16": lambda: grouped_experts(x, weights, ids, bf16)}
    if tokens * top_k > 64 * fp8.gate_up.shape[0] and DEVICE == "cuda":
        library = fp8_tiles.ROWWISE_FAST_ACCUM

        def other() -> torch.Tensor:  # the row-wise GEMMs with the accumulation the library does not choose
            fp8_tiles.ROWWISE_FAST_ACCUM = not library
            try:
                return fp8_grouped_experts(x, weights, ids, channel, rowwise=True)
            finally:
                fp8_tiles.ROWWISE_FAST_ACCUM = library

        calls["per-channel row-wise, " + ("full" if library else "fast") + " accumulation"] = other
    rows = []
    for name, call in calls.items():
        try:
            rows.append(base | {"kernel": name, "err": rel(call(), want), "ms": timed([call])})
        except Exception as error:
            traceback.print_exc()
            rows.append(base | {"kernel": name, "error": repr(error)[:300]})
    return rows


def decode_shape_rows(gen, name, n, k) -> list[dict]:
    """One next-16b dense FP8 projection at `DECODE_SHAPE_ROWS` rows: cuBLAS block scales vs the Triton W8A8
    swap-AB decode tile (both with their quantisation launch), bf16's `F.linear` beside them."""
    from hybridcache.kernels.gemm.triton_block_fp8 import decode_config

    ws, wbf, w32 = dense_weights(gen, n, k)
    rows = []
    for m in DECODE_SHAPE_ROWS:
        x = torch.randn(m, k, generator=gen, device=DEVICE).to(torch.bfloat16)
        base = {"shape": f"next-16b {name}", "N": n, "K": k, "M": m}
        rows.append(base | {"kernel": "bf16", "ms": timed([lambda b=b, x=x: F.linear(x, b) for b in wbf])})
        rows.append(decode_row(x, ws, w32, "w8a8", decode_config(m)) | base)
        if DECODE_CUBLAS:
            rows.append(decode_row(x, ws, w32, "cublas-block", None) | base)
    return rows


# `--splitk`: the dense FP8 projections a next-16b decode step runs once the shared expert is one of the routed
# experts (`fp8_tiles.SHARED_AS_EXPERT`; the attention's q + gate, k and v fused), at SPLITK_ROWS rows: the
# library's choice without split-K ("library": `fp8_linear` with `DECODE_SPLIT_K` empty, cuBLAS or the Triton
# swap-AB tile) against the split-K W8A8 tile at each SPLITK_CONFIGS launch, bf16's `F.linear` beside them;
# `fp8_bench.py --decode-kernels-from` takes a shape's fastest split-K launch where it beats the library's
SPLITK_SHAPES = {"qkvz": (12288, 4096), "attn q+gate, k, v": (9216, 4096), "out_proj / o_proj": (4096, 4096)}
SPLITK_ROWS = [64, 16]
SPLITK_CONFIGS = [(64, 2, 4), (64, 4, 4), (64, 8, 4), (128, 2, 8), (128, 4, 8)]  # block_n, split, warps


def splitk_items(gen: torch.Generator):
    """(priority, closure) items of `--splitk` (above): a shape's rows at every M, shapes in order."""
    return [(i, lambda name=name, shape=shape: splitk_rows(gen, name, *shape))
            for i, (name, shape) in enumerate(SPLITK_SHAPES.items())]


def splitk_rows(gen, name, n, k) -> list[dict]:
    from hybridcache.kernels.gemm import triton_block_fp8
    from hybridcache.kernels.gemm.triton_block_fp8 import SplitK, fp8_gemm_splitk, fp8_linear

    ws, wbf, w32 = dense_weights(gen, n, k)
    rows = []
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32  # (the interpreter's bf16 is wrong)
    for m in SPLITK_ROWS:
        x = torch.randn(m, k, generator=gen, device=DEVICE).to(dtype)
        xq, xs = triton_quant.quantize_groups(x)
        ref = (xq.float() * xs.repeat_interleave(128, 1)) @ w32.T
        base = {"shape": f"next-16b {name}", "N": n, "K": k, "M": m, "splitk_sweep": True}
        rows.append(base | {"kernel": "bf16", "ms": timed([lambda b=b, x=x: F.linear(x, b.to(x.dtype)) for b in wbf])})
        saved, triton_block_fp8.DECODE_SPLIT_K = triton_block_fp8.DECODE_SPLIT_K, {}
        try:
            rows.append(base | {"kernel": "library", "err": rel(fp8_linear(x, *ws[0], BLOCK), ref),
                                "ms": timed([lambda a=a, b=b, x=x: fp8_linear(x, a, b, BLOCK) for a, b in ws])})
        finally:
            triton_block_fp8.DECODE_SPLIT_K = saved
        for block_n, split, warps in SPLITK_CONFIGS:
            config = SplitK(block_n, split, warps)

            def call(a, b, x=x, config=config) -> torch.Tensor:  # with its quantisation launch, as the engine
                return fp8_gemm_splitk(*triton_quant.quantize_groups(x), a, b, BLOCK, dtype, config)

            try:
                rows.append(base | {"kernel": "w8a8-splitk", "tile": config.__dict__, "err": rel(call(*ws[0]), ref),
                                    "ms": timed([lambda a=a, b=b: call(a, b) for a, b in ws])})
            except Exception as error:
                traceback.print_exc()
                rows.append(base | {"kernel": "w8a8-splitk", "tile": config.__dict__, "error": repr(error)[:300]})
    return rows


def quant_check(gen: torch.Generator) -> dict:
    x = (torch.randn(300, 4096, generator=gen, device=DEVICE) * torch.logspace(-3, 3, 4096, device=DEVICE))
    x = x.to(torch.bfloat16)
    got_q, got_s = triton_quant.quantize_groups(x)
    want_q, want_s = reference.quantize_groups(x)
    return {"quant_scales_equal": bool(torch.equal(got_s, want_s)),
            "quant_values_equal": bool(torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8))),
            "quant_dtype_ok": got_q.dtype == FP8_DTYPE}


def tile_text(tile: dict) -> str:
    """A row's tile in the table: BLOCK_M x BLOCK_N, warps, stages, swap-AB; a prefill tile's group_m and down
    GEMM width; a split-K launch's width, parts and warps; "-" for a row without one."""
    if "split_k" in tile:
        return f"split-K {tile['block_n']} x {tile['split_k']} w{tile['num_warps']} s{tile['num_stages']}"
    if "block_m" not in tile:
        return "-"
    text = f"{tile['block_m']}x{tile['block_n']} w{tile['num_warps']} s{tile['num_stages']}"
    text += " swap-ab" if tile.get("swap_ab") else ""
    if "group_m" in tile:
        text += f" g{tile['group_m']}" + (f" down {tile['down_block_n']}" if tile.get("down_block_n") else "")
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--budget-s", type=float, default=40.0)
    parser.add_argument("--smoke", action="store_true", help="on the CPU under TRITON_INTERPRET=1, tiny shapes")
    parser.add_argument("--quick", action="store_true", help="next-16b's experts: W8A8 swap-AB decode tiles at "
                        "T = 64 and 1, W8A8 prefill tiles at 256 and 1,024, bf16 at each; then qkvz and 28,672 x "
                        "8,192 at M = 64 and 1 (swap-AB tiles and cuBLAS)")
    parser.add_argument("--rowwise", action="store_true", help="the routed experts re-quantised per channel (row-wise "
                        "scaled grouped GEMM for prefill) against the block-scaled ones and bf16 at 16,384 to 1 "
                        "tokens; then next-16b's dense FP8 projections at 64 and 16 rows, cuBLAS against Triton")
    parser.add_argument("--splitk", action="store_true", help="next-16b's dense FP8 decode projections at 64 and 16 "
                        "rows: the split-K W8A8 tile's launches against the library's kernel (cuBLAS or Triton)")
    parser.add_argument("--splitk-rows", default=None, help="--splitk's row counts, comma-separated (default 64,16)")
    parser.add_argument("--prefill", action="store_true", help="only the routed experts' W8A8 prefill tiles at "
                        "16,384 / 4,096 / 1,024 tokens (next-16b: 4,096 / 1,024 / 256 rows per expert), bf16's "
                        "experts there, and the gate/up GEMM alone against torch's grouped GEMMs")
    args = parser.parse_args()
    global DECODE_CUBLAS
    if args.splitk_rows:
        SPLITK_ROWS[:] = [int(m) for m in args.splitk_rows.split(",")]
    if args.prefill:
        DENSE.clear()
        PLANS[:] = []
        PREFILL_PLANS[:] = SWEEP_PREFILL_PLANS
        PREFILL_TOKENS[:] = [16384, 4096, 1024]
        GEMM_TOKENS[:] = [16384 * 8, 4096 * 8]
        BF16_EXPERTS[:] = [16384, 4096, 1024]
    if args.quick:
        for name in ("80b o_proj", "80b shared gate_up"):
            del DENSE[name]
        ROWS[:] = [64, 1]
        DECODE_TILES[:] = DECODE_TILES[:2]
        PLANS[:] = QUICK_PLANS
    if args.smoke:
        global DEVICE
        DEVICE = "cpu"
        for name in list(DENSE)[1:]:
            del DENSE[name]
        for name in DENSE:  # none with --prefill
            DENSE[name] = (96, 256)
        ROWS[:] = ROWS[:3]
        DECODE_TILES[:] = DECODE_TILES[:2]
        DECODE_CUBLAS = False
        W8A8_TILES[:] = W8A8_TILES[:1]
        BF16_EXPERTS[:] = [1, 64]  # more rows per expert take the grouped GEMM: CUDA only
        PREFILL_TOKENS[:] = [64] if PREFILL_TOKENS else []
        GEMM_TOKENS[:] = [64] if GEMM_TOKENS else []
        PREFILL_PLANS[:] = PREFILL_PLANS[:2] + [PrefillTile(32, 32, 64, 4, 3, 2)] if PREFILL_PLANS else []
        ROWWISE_TOKENS[:] = [64, 1]
        for name in list(NEXT16B_DENSE)[1:]:
            del NEXT16B_DENSE[name]
        NEXT16B_DENSE[next(iter(NEXT16B_DENSE))] = (96, 256)
        for name in list(SPLITK_SHAPES)[1:]:
            del SPLITK_SHAPES[name]
        SPLITK_SHAPES[next(iter(SPLITK_SHAPES))] = (256, 512)
        SPLITK_ROWS[:] = [5]
        SPLITK_CONFIGS[:] = [(32, 2, 4), (64, 3, 4)]
    start = time.perf_counter()
    gen = torch.Generator(DEVICE).manual_seed(0)
    out = Path(args.out or os.environ.get("OUT") or ".") / "fp8_sweep.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"device": torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE, "quant": quant_check(gen),
              "rows": [], "skipped": 0}
    print(result["quant"], flush=True)
    if args.rowwise:
        items = rowwise_items(gen)
    elif args.splitk:
        items = splitk_items(gen)
    else:
        items = sorted(dense_items(gen) + expert_items(gen), key=lambda item: item[0])
    for _, item in items:
        if time.perf_counter() - start > args.budget_s:
            result["skipped"] += 1
            continue
        try:
            rows = item()
        except Exception as error:
            traceback.print_exc()
            rows = [{"error": repr(error)[:300]}]
        for row in rows:
            print(json.dumps(row), flush=True)
        result["rows"] += rows
        out.write_text(json.dumps(result, indent=1))
    result["wall_s"] = time.perf_counter() - start
    out.write_text(json.dumps(result, indent=1))
    print(f"| what | M/T | kernel | tile | ms | err |  (skipped {result['skipped']}, {result['wall_s']:.0f} s)")
    for r in result["rows"]:
        if "error" in r:
            print(f"| {r.get('shape', '-')} | {r.get('M', '-')} | {r.get('kernel', '-')} | error {r['error'][:80]}")
            continue
        what = r.get("shape", r.get("experts", r.get("gemm")))
        print(f"| {what} | {r.get('M', r.get('tokens'))} | {r['kernel']} | {tile_text(r.get('tile') or r)} | "
              f"{r['ms']:.4f} | {r.get('err', float('nan')):.1e} |")


if __name__ == "__main__":
    main()
