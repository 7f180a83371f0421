"""Launch shapes of the decode step's memory-bound kernels, timed on CUDA (issue 32: the decode step toward its floor).

    PYTHONPATH=. python benchmarks/decode_kernel_sweep.py [--seqs 64] [--only gdn,conv,norm,argmax,conv_prefill,experts]
    PYTHONPATH=. python benchmarks/decode_kernel_sweep.py --only moe_prefill,prefill_gemm   # phase D's prefill step

Every model of gpu_bench has the same DeltaNet shape (16 key heads, 32 value heads of 128, a conv of 8,192
channels and 4 taps); hidden 2,048 (next-1b) or 4,096 (next-16b, dense-9b); vocabularies 151,936 (next-16b) and
248,320 (dense-9b); `conv_prefill`: the prefill conv of phase D's 16 x 1,024-token steps. For each kernel and
candidate launch (block sizes, warps, the step kernel's streaming hints) it prints device us per call (the median
of 5 CUDA-graph replays of 16 calls), the bytes it must move and the rate that gives, and marks the engine's
current launch. Inputs rotate over copies beyond the L2 cache where the step reads them from memory (the recurrent
and conv states: each layer's own); the norms' inputs come from the GEMM just before in the step, so they stay hot
here too. "same as current": the variant's outputs (and states) equal the current launch's bit for bit (the step
kernel's sums over Dk, and the norms' over the row, run in another order in another tile or warp count: a False
there is fp32 rounding; the norms are compared within 1e-2 relative, their residual sums exactly), the argmax's
tokens equal torch's. `experts`: the routed experts' two GEMMs (`moe/triton_experts.expert_gemm`, gate/up with the
SiLU gate, then down) at next-1b's and next-16b's expert shapes with `--seqs` tokens routed at random, by tile
(columns, depth, warps, stages, swap-AB), the weights rotated over two copies; rate = every touched expert's
weights once / time, and each launch's max difference from an fp32 torch reference (relative to its max).
`moe_prefill` and `prefill_gemm`: next-16b's phase-D prefill step (16 x 1,024 tokens): the routed experts' parts
between their grouped GEMMs by launch, and the dense projections' cuBLAS rates by shape (their docstrings).
Writes DIR/decode_kernel_sweep.json (DIR: --out, else $OUT, else .).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import time
from pathlib import Path

import torch
import triton

from hybridcache.kernels import pdl
from hybridcache.kernels.conv import triton as conv_triton
from hybridcache.kernels.gated_delta import triton_step
from hybridcache.kernels.gemm.dense import replay_us
from hybridcache.kernels.norm import triton as norm_triton
from hybridcache.kernels.sampling import triton_argmax
from hybridcache.kernels.varlen import chunk_indices as make_chunk_indices

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Candidate launches (each compiles once: the sweep must fit a round's two minutes with the profiles after it)
GDN_LAUNCHES = ((16, 1, False), (16, 2, False), (16, 4, False), (32, 1, False), (32, 2, False), (32, 4, False),
                (32, 8, False), (64, 2, False), (64, 4, False), (64, 8, False), (128, 4, False), (128, 8, False),
                (128, 16, False),  # BLOCK_V = Dv: one program per head (what a gated norm inside the kernel needs)
                (16, 2, True), (32, 2, True), (32, 4, True), (64, 4, True))  # (BLOCK_V, num_warps, STREAM)
CONV_LAUNCHES = ((64, 2), (128, 2), (128, 4), (256, 2), (256, 4), (512, 4), (512, 8), (1024, 4))  # (BLOCK_C, warps)
# (kernel, BLOCK_C, num_warps): "tiles" `_conv_varlen_kernel` (K shifted tile loads), "rows" `_conv_varlen_rows_kernel`
# (each row loaded once)
CONV_PREFILL_LAUNCHES = (("tiles", 128, 4), ("tiles", 128, 8), ("tiles", 64, 4), ("tiles", 256, 8), ("rows", 256, 2),
                         ("rows", 512, 4), ("rows", 1024, 4), ("rows", 1024, 8), ("rows", 2048, 8), ("rows", 2048, 16),
                         ("rows", 4096, 16))
NORM_WARPS = (4, 8, 16)
GATED_LAUNCHES = ((4, 1), (8, 2), (16, 2), (16, 4), (32, 4), (32, 8))  # (rows per program, num_warps)
ARGMAX_LAUNCHES = ((8, 4096), (16, 1024), (16, 2048), (32, 1024), (32, 2048))  # (splits, block)
# the expert GEMM: (BLOCK_N, BLOCK_K, num_warps, num_stages, swap-AB); the first is the engine's launch before this
EXPERT_LAUNCHES = ((64, 128, 4, 3, False), (64, 128, 4, 4, False), (32, 128, 4, 4, False), (128, 64, 4, 4, False),
                   (64, 256, 4, 3, False), (64, 128, 4, 3, True), (64, 128, 4, 4, True), (64, 64, 4, 6, True),
                   (128, 64, 4, 4, True), (128, 128, 4, 2, True), (64, 256, 4, 2, True), (64, 64, 4, 4, False),
                   (64, 64, 4, 6, False), (32, 128, 4, 3, False), (64, 128, 8, 3, False), (64, 128, 4, 2, False),
                   (128, 64, 8, 3, True), (32, 128, 4, 4, True))
EXPERT_SHAPES = {"next-1b": (16, 4, 2048, 512), "next-16b": (32, 8, 4096, 1024)}  # (experts, top-k, hidden, width)
HK, HV, DK, DV, CONV_CHANNELS, CONV_TAPS = 16, 32, 128, 128, 8192, 4


def graph_us(launch, copies: int) -> float:
    """Device us per call of `launch(i)` (i: which input copy), timed as the engine times its GEMM choices
    (`kernels.gemm.dense.replay_us`: the median of 5 replays of one graph of many calls); without CUDA, one call
    timed on the host (a dry run of the launches under TRITON_INTERPRET=1)."""
    if not torch.cuda.is_available():
        start = time.perf_counter()
        launch(0)
        return 1e6 * (time.perf_counter() - start)
    return replay_us(launch, list(range(copies)), torch.device("cuda"))


def report(name: str, rows: list[dict], current: str) -> list[dict]:
    print(f"\n| {name} | us per call | GB/s | same as current |\n| --- | --- | --- | --- |")
    for row in sorted(rows, key=lambda r: r["us"]):
        mark = " (current)" if row["launch"] == current else ""
        print(f"| {row['launch']}{mark} | {row['us']:.2f} | {row['bytes'] / row['us'] / 1e3:.0f} | {row['same']} |")
    return rows


def sweep_gdn(seqs: int) -> list[dict]:
    """The gated delta step kernel (`triton_step._gdn_step_kernel`, gates inside): BLOCK_V x num_warps."""
    device = DEVICE
    copies = 4  # 4 x 64 states of 2 MB: 537 MB, past the 50 MB L2
    pool = torch.randn(copies * seqs + 8, HV, DK, DV, device=device) * 0.1
    slots = [torch.arange(c * seqs, (c + 1) * seqs, device=device)[torch.randperm(seqs, device=device)]
             for c in range(copies)]
    ctx = torch.full((seqs,), 100, dtype=torch.int32, device=device)
    qkv = torch.randn(seqs, (2 * HK * DK + HV * DV), device=device, dtype=torch.bfloat16)
    q = qkv[:, : HK * DK].view(seqs, HK, DK)
    k = qkv[:, HK * DK: 2 * HK * DK].view(seqs, HK, DK)
    v = qkv[:, 2 * HK * DK:].view(seqs, HV, DV)
    ba = torch.randn(seqs, 2 * HV, device=device, dtype=torch.bfloat16)
    b, a = ba[:, :HV], ba[:, HV:]
    a_log = torch.randn(HV, device=device) * 0.1
    dt_bias = torch.randn(HV, device=device) * 0.1
    nbytes = 2 * seqs * HV * DK * DV * 4
    results, outputs = [], {}

    def run(block_v: int, warps: int, stream: bool, i: int, out: torch.Tensor) -> None:
        triton_step._gdn_step_kernel[(seqs, HV, DV // block_v)](
            q, k, v, a, b, out, pool, slots[i], ctx, a_log, dt_bias, DK**-0.5,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), a.stride(0), b.stride(0),
            out.stride(0), out.stride(1), pool.stride(0), pool.stride(1), pool.stride(2),
            RATIO=HV // HK, DK=DK, DV=DV, BLOCK_K=DK, BLOCK_V=block_v, L2NORM=True, GATES=True, STREAM=stream,
            num_warps=warps,
            **pdl.options(q))

    snapshot = pool.clone()
    current = f"BLOCK_V {triton_step._BLOCK_V}, 4 warps" + (", streaming hints" if triton_step._STREAM else "")
    for block_v, warps, stream in GDN_LAUNCHES:
        name = f"BLOCK_V {block_v}, {warps} warps" + (", streaming hints" if stream else "")
        out = torch.empty(seqs, HV, DV, device=device, dtype=torch.bfloat16)
        pool.copy_(snapshot)
        run(block_v, warps, stream, 0, out)  # one call from the same start: its output and state for the check
        outputs[name] = (out.clone(), pool[slots[0]].clone())
        pool.copy_(snapshot)
        us = graph_us(lambda i, bv=block_v, w=warps, st=stream, o=out: run(bv, w, st, i, o), copies)
        results.append({"launch": name, "us": us, "bytes": nbytes})
    ref = outputs[current]
    for row in results:
        got = outputs[row["launch"]]
        row["same"] = bool(torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1]))
    # the copy rate: the same bytes read and written by torch's copy (one layer's states into another's place)
    source, dest = pool[: seqs * copies].view(copies, seqs, -1), torch.empty(copies, seqs, HV * DK * DV, device=device)
    results.append({"launch": "torch copy_ of the same bytes (reference)", "same": True, "bytes": nbytes,
                    "us": graph_us(lambda i: dest[i].copy_(source[(i + 1) % copies]), copies)})
    return report(f"gated delta step, {seqs} seqs x {HV} heads, fp32 state read + write", results, current)


def sweep_conv(seqs: int) -> list[dict]:
    """The conv decode step (`conv.triton._conv_step_kernel`): BLOCK_C x num_warps."""
    device = DEVICE
    copies = 8  # 8 x 64 x 48 KB states
    pool = torch.randn(copies * seqs, CONV_CHANNELS, CONV_TAPS - 1, device=device, dtype=torch.bfloat16)
    slots = [torch.arange(c * seqs, (c + 1) * seqs, device=device)[torch.randperm(seqs, device=device)]
             for c in range(copies)]
    ctx = torch.full((seqs,), 100, dtype=torch.int32, device=device)
    x = torch.randn(seqs, CONV_CHANNELS, device=device, dtype=torch.bfloat16)
    weight = torch.randn(CONV_CHANNELS, CONV_TAPS, device=device, dtype=torch.bfloat16)
    nbytes = seqs * CONV_CHANNELS * 2 * (2 * (CONV_TAPS - 1) + 2)
    snapshot = pool.clone()
    results, outputs = [], {}

    def run(block_c: int, warps: int, i: int, out: torch.Tensor) -> None:
        conv_triton._conv_step_kernel[(seqs, triton.cdiv(CONV_CHANNELS, block_c))](
            x, weight, weight, out, pool, slots[i], ctx, x, x, x.stride(0), out.stride(0), x.stride(0),
            *pool.stride(), CONV_CHANNELS, K=CONV_TAPS, BLOCK_W=triton.next_power_of_2(CONV_TAPS - 1), HAS_BIAS=False,
            SILU=True, GATED=False, BLOCK_C=block_c, num_warps=warps, **pdl.options(x))

    current = f"BLOCK_C {conv_triton._STEP_BLOCK_C}, 4 warps"
    for block_c, warps in CONV_LAUNCHES:
        name = f"BLOCK_C {block_c}, {warps} warps"
        out = torch.empty(seqs, CONV_CHANNELS, device=device, dtype=torch.bfloat16)
        pool.copy_(snapshot)
        run(block_c, warps, 0, out)
        outputs[name] = (out.clone(), pool[slots[0]].clone())
        pool.copy_(snapshot)
        us = graph_us(lambda i, bc=block_c, w=warps, o=out: run(bc, w, i, o), copies)
        results.append({"launch": name, "us": us, "bytes": nbytes})
    ref = outputs[current]
    for row in results:
        got = outputs[row["launch"]]
        row["same"] = bool(torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1]))
    return report(f"conv step, {seqs} seqs x {CONV_CHANNELS} channels", results, current)


def sweep_conv_prefill(seqs: int) -> list[dict]:
    """Phase D's prefill conv (`conv.triton`'s two prefill kernels, BLOCK_T 64 as the engine's chunk table): 16
    fresh sequences of 1,024 tokens, x the conv's 8,192 columns of dense-9b's 12,352-wide in_proj output; kernel x
    BLOCK_C x num_warps. (`seqs` unused: the step is phase D's.)"""
    del seqs
    device = DEVICE
    lens = [1024] * 16
    tokens = sum(lens)
    projected = torch.randn(tokens, 12352, device=device, dtype=torch.bfloat16)
    x = projected[:, :CONV_CHANNELS]
    weight = torch.randn(CONV_CHANNELS, CONV_TAPS, device=device, dtype=torch.bfloat16)
    pool = torch.zeros(len(lens), CONV_CHANNELS, CONV_TAPS - 1, device=device, dtype=torch.bfloat16)
    slots = torch.arange(len(lens), device=device)
    cu = torch.tensor([0, *itertools.accumulate(lens)], device=device, dtype=torch.int32)
    ctx = torch.tensor(lens, device=device, dtype=torch.int32)
    chunks = make_chunk_indices(cu, lens, conv_triton._BLOCK_T)
    nbytes = 2 * tokens * CONV_CHANNELS * 2
    results, outputs = [], {}
    current = ("rows", conv_triton._ROWS_BLOCK_C, conv_triton._ROWS_WARPS)
    kernels = {"tiles": conv_triton._conv_varlen_kernel, "rows": conv_triton._conv_varlen_rows_kernel}
    for launch in CONV_PREFILL_LAUNCHES:
        name, block_c, warps = launch
        out = torch.empty(tokens, CONV_CHANNELS, device=device, dtype=torch.bfloat16)

        def run(_i: int, k=kernels[name], bc=block_c, w=warps, o=out) -> None:
            k[(chunks.shape[0], triton.cdiv(CONV_CHANNELS, bc))](
                x, weight, weight, o, pool, slots, cu, ctx, chunks, x.stride(0), o.stride(0), *pool.stride(),
                CONV_CHANNELS, K=CONV_TAPS, HAS_BIAS=False, SILU=True, BLOCK_T=conv_triton._BLOCK_T, BLOCK_C=bc,
                num_warps=w)

        run(0)
        outputs[launch] = out.clone()
        results.append({"launch": "{}, BLOCK_C {}, {} warps".format(*launch), "us": graph_us(run, 1),
                        "bytes": nbytes, "key": launch})
    for row in results:
        row["same"] = bool(torch.equal(outputs[row.pop("key")], outputs[current]))
    return report(f"prefill conv, 16 x 1,024 tokens x {CONV_CHANNELS} channels", results,
                  "{}, BLOCK_C {}, {} warps".format(*current))


def sweep_norms(seqs: int) -> list[dict]:
    """add_rms_norm at hidden 2,048 / 4,096 and gated_rms_norm over DeltaNet's [seqs x 32, 128] rows: warps."""
    device = DEVICE
    results = []
    for hidden in (2048, 4096):
        x = torch.randn(seqs, hidden, device=device, dtype=torch.bfloat16)
        r = torch.randn(seqs, hidden, device=device, dtype=torch.bfloat16)
        w = torch.randn(hidden, device=device, dtype=torch.bfloat16) * 0.1
        total, out = torch.empty_like(x), torch.empty_like(x)
        block = triton.next_power_of_2(hidden)
        rows = max(1, norm_triton._ELEMENTS_PER_PROGRAM // block)
        outputs, part = {}, []

        def run(warps: int, _i: int, o=out, t=total, x=x, r=r, w=w, block=block, rows=rows, hidden=hidden) -> None:
            norm_triton._add_rms_norm_kernel[(triton.cdiv(seqs, rows),)](
                x, o, seqs, x.stride(0), 0, 1, hidden, 1e-6, r, r.stride(0), 0, t, w, 1.0, 0, False, ROWS=rows,
                BLOCK=block,
                num_warps=warps, **pdl.options(x))

        for warps in NORM_WARPS:
            run(warps, 0)
            outputs[warps] = (out.clone(), total.clone())
            us = graph_us(lambda i, w=warps: run(w, i), 1)
            part.append({"launch": f"add_rms_norm {hidden}: {warps} warps", "us": us, "bytes": 4 * x.numel() * 2,
                         "warps": warps})
        for row in part:
            got, ref = outputs[row["warps"]], outputs[4]
            row["same"] = bool(torch.equal(got[1], ref[1])) and float((got[0].float() - ref[0].float()).abs().max()
                                                                      / ref[0].float().abs().max()) < 1e-2
        results += report(f"add_rms_norm, {seqs} x {hidden}", part, f"add_rms_norm {hidden}: 4 warps")
    x = torch.randn(seqs, HV, DV, device=device, dtype=torch.bfloat16)
    gate = torch.randn(seqs, HV * DV, device=device, dtype=torch.bfloat16).view(seqs, HV, DV)
    w = torch.randn(DV, device=device, dtype=torch.bfloat16)
    out = torch.empty(seqs * HV, DV, device=device, dtype=torch.bfloat16)
    part, outputs = [], {}
    for rows, warps in GATED_LAUNCHES:
        def run(_i: int, rows=rows, warps=warps) -> None:
            norm_triton._gated_rms_norm_kernel[(triton.cdiv(seqs * HV, rows),)](
                x, out, seqs * HV, x.stride(0), x.stride(1), HV, DV, 1e-6, gate, gate.stride(0), gate.stride(1),
                w, ROWS=rows, BLOCK=DV, num_warps=warps, **pdl.options(x))

        run(0)
        outputs[(rows, warps)] = out.clone()
        part.append({"launch": f"gated_rms_norm: {rows} rows, {warps} warps", "us": graph_us(run, 1),
                     "bytes": 3 * x.numel() * 2, "key": (rows, warps)})
    for row in part:
        row["same"] = bool(torch.equal(outputs[row.pop("key")], outputs[(16, 4)]))
    results += report(f"gated_rms_norm, {seqs} x {HV} x {DV}", part, "gated_rms_norm: 16 rows, 4 warps")
    return results


def sweep_argmax(seqs: int) -> list[dict]:
    """Greedy tokens over the logits: the sampler's fp32 copy + torch.argmax (what `sample_async` ran), torch.argmax
    alone, and `triton_argmax.argmax_rows` by splits x block."""
    device = DEVICE
    results = []
    for vocab in (151936, 248320):
        results += argmax_vocab(seqs, vocab, device)
    return results


def argmax_vocab(seqs: int, vocab: int, device: str) -> list[dict]:
    copies = 2
    logits = [torch.randn(seqs, vocab, device=device) for _ in range(copies)]
    ref = logits[0].argmax(dim=-1)
    nbytes = seqs * vocab * 4
    part = [{"launch": "clone + torch.argmax", "us": graph_us(lambda i: logits[i].clone().argmax(-1), copies),
             "bytes": nbytes, "same": True},
            {"launch": "torch.argmax", "us": graph_us(lambda i: logits[i].argmax(-1), copies), "bytes": nbytes,
             "same": True}]
    for splits, block in ARGMAX_LAUNCHES:
        got = triton_argmax.argmax_rows(logits[0], splits=splits, block=block)
        us = graph_us(lambda i, s=splits, b=block: triton_argmax.argmax_rows(logits[i], splits=s, block=b), copies)
        part.append({"launch": f"argmax_rows: {splits} splits, block {block}", "us": us, "bytes": nbytes,
                     "same": bool(torch.equal(got, ref))})
    current = f"argmax_rows: {triton_argmax._SPLITS} splits, block {triton_argmax._BLOCK}"
    return report(f"greedy argmax, {seqs} x {vocab} fp32", part, current)


def sweep_experts(seqs: int) -> list[dict]:
    """The routed experts' gate/up (gather + SiLU gate) and down (scatter) GEMMs by launch, per model shape."""
    from hybridcache.kernels.moe.grouped import sort_pairs, tile_rows
    from hybridcache.kernels.moe.triton_experts import expert_gemm

    device = DEVICE
    gen = torch.Generator().manual_seed(0)
    results = []
    for model, (experts, top_k, hidden, width) in EXPERT_SHAPES.items():
        ids = torch.rand(seqs, experts, generator=gen).argsort(dim=-1)[:, :top_k].to(device)
        order, counts = sort_pairs(ids, experts)
        block_m = tile_rows(order.numel(), experts)
        touched = int(torch.unique(ids).numel())
        x = (torch.randn(seqs, hidden, generator=gen) * 0.5).to(device, torch.bfloat16)
        gate_up = [(torch.randn(experts, 2 * width, hidden, generator=gen) / hidden**0.5).to(device, torch.bfloat16)
                   for _ in range(2)]
        down = [(torch.randn(experts, hidden, width, generator=gen) / width**0.5).to(device, torch.bfloat16)
                for _ in range(2)]
        expert_of = ids.reshape(-1)[order]  # each sorted row's expert
        tokens = order // top_k
        g, u = torch.einsum("rh,rnh->rn", x[tokens].float(), gate_up[0][expert_of].float()).chunk(2, dim=-1)
        h_ref = torch.nn.functional.silu(g) * u
        h = h_ref.to(torch.bfloat16)  # the down GEMM's input, in sorted order
        y_ref = torch.empty(order.numel(), hidden, device=device)
        y_ref[order] = torch.einsum("rn,rhn->rh", h.float(), down[0][expert_of].float())
        for kind, weights, nbytes, ref in (("gate/up + SiLU gate", gate_up, touched * 2 * width * hidden * 2, h_ref),
                                           ("down", down, touched * hidden * width * 2, y_ref)):
            part = []
            for block_n, block_k, warps, stages, swap in EXPERT_LAUNCHES:
                name = f"{block_m}x{block_n}x{block_k}, {warps} warps, {stages} stages" + (", swap-AB" if swap else "")

                second = kind == "down"
                launch = functools.partial(expert_gemm, h if second else x, order, top_k, gather=not second,
                                           scatter=second, swiglu=not second, block_m=block_m, block_n=block_n,
                                           block_k=block_k, num_warps=warps, num_stages=stages, swap_ab=swap)

                def run(i: int, launch=launch, weights=weights, counts=counts) -> torch.Tensor:
                    return launch(weights[i], counts)

                try:
                    out = run(0).float()
                    err = float((out - ref).abs().max() / ref.abs().max())
                    part.append({"launch": name, "us": graph_us(run, 2), "bytes": nbytes, "same": f"{err:.1e}",
                                 "model": model, "gemm": kind})
                except Exception as error:  # a launch past the shared memory must not cost the table
                    print(f"{model} {kind} {name}: {type(error).__name__}: {str(error)[:120]}")
            results += report(f"{model} experts ({experts} top-{top_k}, hidden {hidden}, width {width}, {touched} "
                              f"touched): {kind}, {seqs} tokens (last column: max |diff| / max |ref|)", part,
                              part[0]["launch"] if part else "")
    return results


# the MoE routing and pair sort of a decode step: (experts, top-k) by model; route launches (rows per program,
# warps), the first the engine's choice (`triton_route.launch_rows`); sort warps, the first the engine's
# (`triton_sort.sort_warps`)
ROUTE_SHAPES = {"next-1b": (16, 4), "next-16b": (32, 8), "80B-A3B": (512, 10)}
# the one-group sigmoid routers: (experts, top-k, renorm eps, scale)
SIGMOID_ROUTERS = {"nemotron3-nano": (128, 6, 1e-20, 2.5), "kimi-linear": (256, 8, 1e-20, 2.446),
                   "lfm2-8b-a1b": (32, 4, 1e-6, 1.0)}
ROUTE_LAUNCHES = ((None, None), (16, 4), (16, 2), (16, 1), (8, 4), (8, 2), (8, 1), (4, 4), (4, 2), (4, 1), (2, 1),
                  (1, 1))
SORT_WARPS = (None, 2, 4, 8)


def sweep_moe_route(seqs: int) -> list[dict]:
    """The MoE block's routing (`triton_route.route`, logits a strided view of the fused input GEMM's output as in
    the engine) and pair sort by launch, per model shape at `seqs` tokens; each launch's outputs against the
    engine's (route: the same weights and ids bit for bit; sort: torch's stable argsort and counts). Past
    `triton_sort.MAX_PAIRS` pairs (a prefill's tokens) the routing alone. Then the one-group sigmoid routers
    (Nemotron 3 Nano, Kimi Linear, LFM2-MoE): the Triton launch against the torch reference it replaced."""
    from hybridcache.kernels.moe import reference as moe_ref
    from hybridcache.kernels.moe.grouped import sort_pairs_torch
    from hybridcache.kernels.moe.triton_route import route, route_sigmoid
    from hybridcache.kernels.moe.triton_sort import MAX_PAIRS, block_size, sort_pairs_triton, sort_warps

    gen = torch.Generator().manual_seed(0)
    results = []
    for model, (experts, top_k) in ROUTE_SHAPES.items():
        fused = torch.randn(seqs, experts + 2056, generator=gen).to(DEVICE, torch.bfloat16)
        logits = fused[:, :experts]
        want = route(logits, top_k, True)
        part = []
        for block_t, warps in ROUTE_LAUNCHES:
            def run(i: int, block_t=block_t, warps=warps, logits=logits, top_k=top_k):
                return route(logits, top_k, True, block_t=block_t, num_warps=warps)
            got = run(0)
            same = bool(torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]))
            name = "route, the engine's launch" if block_t is None else f"route {block_t} rows, {warps} warps"
            part.append({"launch": name, "us": graph_us(run, 1),
                         "bytes": logits.numel() * 2, "same": same, "model": model, "kernel": "route"})
        results += report(f"{model} routing ({experts} experts, top-{top_k}), {seqs} tokens", part, part[0]["launch"])
        ids = want[1]
        if ids.numel() > MAX_PAIRS:
            continue
        ref = sort_pairs_torch(ids, experts)
        part = []
        for warps in SORT_WARPS:
            warps = warps or sort_warps(block_size(ids.numel()))

            def run(i: int, warps=warps, ids=ids, experts=experts):
                return sort_pairs_triton(ids, experts, num_warps=warps)
            got = run(0)
            same = bool(torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1]))
            part.append({"launch": f"sort, {warps} warps", "us": graph_us(run, 1), "bytes": ids.numel() * 8,
                         "same": same, "model": model, "kernel": "sort"})
        results += report(f"{model} pair sort ({ids.numel()} pairs over {experts} experts)", part, part[0]["launch"])
    for model, (experts, top_k, eps, scale) in SIGMOID_ROUTERS.items():  # the one-group sigmoid routers
        logits = torch.randn(seqs, experts, generator=gen).to(DEVICE)
        bias = (0.5 * torch.randn(experts, generator=gen)).to(DEVICE)
        want = moe_ref.route_sigmoid(logits, bias, top_k, True, eps, scale)
        part = []
        for name, fn in (("sigmoid routing, one Triton launch (engine's)", route_sigmoid),
                         ("sigmoid routing, torch (before)", moe_ref.route_sigmoid)):
            def run(i: int, fn=fn, logits=logits, bias=bias, top_k=top_k, eps=eps, scale=scale):
                return fn(logits, bias, top_k, True, eps, scale)
            got = run(0)
            same = bool(torch.equal(got[1].sort(dim=-1)[0], want[1].sort(dim=-1)[0]))
            part.append({"launch": name, "us": graph_us(run, 1), "bytes": logits.numel() * 4, "same": same,
                         "model": model, "kernel": "route_sigmoid"})
        results += report(f"{model} sigmoid routing ({experts} experts, top-{top_k}), {seqs} tokens (same: the picks)",
                          part, part[0]["launch"])
    return results


# phase D's routed experts between their grouped GEMMs: (BLOCK_H, num_warps) of `triton_experts.spread` and of the
# combine, (num_warps,) of the SiLU gate (one program per row of 1,024 columns)
SPREAD_LAUNCHES = ((512, 4), (1024, 4), (1024, 8), (2048, 4), (2048, 8), (4096, 8), (4096, 16))
COMBINE_LAUNCHES = ((512, 4), (1024, 4), (1024, 8), (2048, 4), (2048, 8), (4096, 8), (4096, 16))
SILU_WARPS = (2, 4, 8)
# next-16b's dense projections at M tokens: (name, N, K); the MoE block's fused input GEMM at its width (2,088:
# the shared expert's gate | up 2 x 1,024, the router's 32 rows, the shared gate's 1, padded) and at widths around it
PREFILL_GEMMS = (("in_proj q|k|v|z|b|a", 12352, 4096), ("attention q|gate|k|v", 9216, 4096),
                 ("out_proj / o_proj", 4096, 4096), ("MoE input (engine's width)", 2088, 4096),
                 ("MoE input, 2,048 wide", 2048, 4096), ("MoE input, 2,176 wide", 2176, 4096),
                 ("MoE input, 2,304 wide", 2304, 4096), ("shared expert down", 4096, 1024))


def sweep_moe_prefill(seqs: int) -> list[dict]:
    """Phase D's prefill step on next-16b (16 x 1,024 tokens, 32 experts top-8 routed at random, hidden 4,096,
    width 1,024): the routed experts' parts between the grouped GEMMs by launch, and the GEMMs themselves. The
    token rows in sorted order (`x.index_select(0, order // k)` against `triton_experts.spread`, each token read
    once), the SiLU gate (fla's `swiglu` against `activation.triton.silu_mul` on the gate/up halves), the combine
    (`triton_experts.combine` through pos); rate = the bytes each must move at least (spread's for the gather)
    / time. (`seqs` unused: the step is phase D's.)"""
    from hybridcache.kernels.activation import triton as act_triton
    from hybridcache.kernels.moe.grouped import pair_rows, sort_pairs_torch
    from hybridcache.kernels.moe.triton_experts import SPREAD_BLOCK_H, SPREAD_WARPS, _combine_kernel, _spread_kernel

    del seqs
    device, bf16 = DEVICE, torch.bfloat16
    tokens, experts, top_k, hidden, width = (16384, 32, 8, 4096, 1024) if device == "cuda" else (64, 8, 2, 256, 64)
    gen = torch.Generator().manual_seed(0)
    ids = torch.rand(tokens, experts, generator=gen).argsort(dim=-1)[:, :top_k].to(device)
    order, counts = sort_pairs_torch(ids, experts)
    pos, ends = pair_rows(order), counts.cumsum(0, dtype=torch.int32)
    rows = tokens * top_k
    x = torch.randn(tokens, hidden, device=device, dtype=bf16)
    results = []

    xs = torch.empty(rows, hidden, device=device, dtype=bf16)
    want = x.index_select(0, order // top_k)
    nbytes = (tokens + rows) * hidden * 2
    part = [{"launch": "x.index_select(0, order // k)", "us": graph_us(
        lambda _i: torch.index_select(x, 0, order // top_k, out=xs), 1), "bytes": nbytes, "same": True}]
    for block_h, warps in SPREAD_LAUNCHES:
        def run(_i: int, b=block_h, w=warps) -> None:
            _spread_kernel[(tokens, triton.cdiv(hidden, b))](x, pos, xs, hidden, x.stride(0), xs.stride(0),
                                                              TOP_K=top_k, BLOCK_H=b, num_warps=w, **pdl.options(x))
        xs.zero_()
        run(0)
        part.append({"launch": f"spread: BLOCK_H {block_h}, {warps} warps", "us": graph_us(run, 1), "bytes": nbytes,
                     "same": bool(torch.equal(xs, want))})
    results += report(f"token rows in sorted order, {tokens} x {hidden} bf16, top-{top_k}", part,
                      f"spread: BLOCK_H {SPREAD_BLOCK_H}, {SPREAD_WARPS} warps")

    gate_up = [(torch.randn(experts, 2 * width, hidden, generator=gen) / hidden**0.5).to(device, bf16)]
    down = [(torch.randn(experts, hidden, width, generator=gen) / width**0.5).to(device, bf16)]
    h2 = torch._grouped_mm(want, gate_up[0].transpose(1, 2), offs=ends)
    gate, up = h2.chunk(2, dim=-1)
    h = torch.empty(rows, width, device=device, dtype=bf16)
    nbytes = rows * 3 * width * 2
    part = []
    if device == "cuda":
        from fla.modules.activations import swiglu
        part.append({"launch": "fla swiglu", "us": graph_us(lambda _i: swiglu(gate, up), 1), "bytes": nbytes,
                     "same": "-"})
    for warps in SILU_WARPS:
        def run(_i: int, w=warps) -> None:
            act_triton._silu_mul_kernel[(rows, 1)](gate, up, h, width, gate.stride(0), up.stride(0), BLOCK=width,
                                                   num_warps=w, **pdl.options(h))
        run(0)
        part.append({"launch": f"silu_mul: {warps} warps", "us": graph_us(run, 1), "bytes": nbytes,
                     "same": bool(torch.equal(h, act_triton.silu_mul(gate, up)))})
    results += report(f"SiLU gate, {rows} x {width} of a {rows} x {2 * width} grouped GEMM output", part,
                      "silu_mul: 4 warps")

    y = torch._grouped_mm(h, down[0].transpose(1, 2), offs=ends)
    weights = torch.rand(tokens, top_k, generator=gen).to(device, bf16)
    out = torch.empty(tokens, hidden, device=device, dtype=bf16)
    nbytes = (rows + tokens) * hidden * 2
    ref = None
    part = []
    for block_h, warps in COMBINE_LAUNCHES:
        def run(_i: int, b=block_h, w=warps) -> None:
            _combine_kernel[(tokens, triton.cdiv(hidden, b))](
                y, pos, weights, out, y, y, hidden, y.stride(0), out.stride(0), 0, 0, TOP_K=top_k, BLOCK_H=b,
                SORTED=True, SHARED=0, num_warps=w, **pdl.options(y))
        run(0)
        ref = out.clone() if ref is None else ref
        part.append({"launch": f"combine: BLOCK_H {block_h}, {warps} warps", "us": graph_us(run, 1),
                     "bytes": nbytes, "same": bool(torch.equal(out, ref))})
    results += report(f"combine through pos, {rows} x {hidden} -> {tokens} x {hidden}", part,
                      "combine: BLOCK_H 1024, 4 warps")

    part = []
    for name, a, w, n, k in (("gate/up", want, gate_up[0], 2 * width, hidden), ("down", h, down[0], hidden, width)):
        us = graph_us(lambda _i, a=a, w=w: torch._grouped_mm(a, w.transpose(1, 2), offs=ends), 1)
        part.append({"launch": f"grouped GEMM {name}: {2 * rows * n * k / us / 1e6:.0f} TFLOP/s", "us": us,
                     "bytes": a.numel() * 2 + w.numel() * 2 + rows * n * 2, "same": "-"})
    results += report("the routed experts' grouped GEMMs (torch._grouped_mm)", part, "")
    return results


def sweep_prefill_gemm(seqs: int) -> list[dict]:
    """next-16b's dense projections at phase D's 16,384 prefill rows in cuBLAS (`F.linear`), TFLOP/s by shape: is
    any shape far below the others (the MoE block's odd 2,088-wide fused input among them)? (`seqs` unused.)"""
    del seqs
    device, rows = DEVICE, 16384 if DEVICE == "cuda" else 64
    x = torch.randn(rows, 4096, device=device, dtype=torch.bfloat16)
    part = []
    for name, n, k in PREFILL_GEMMS:
        w = torch.randn(n, k, device=device, dtype=torch.bfloat16) / k**0.5
        a = x[:, :k]
        us = graph_us(lambda _i, a=a, w=w: torch.nn.functional.linear(a, w), 1)
        part.append({"launch": f"{name}: {n} x {k}, {2 * rows * n * k / us / 1e6:.0f} TFLOP/s", "us": us,
                     "bytes": (rows * k + n * k + rows * n) * 2, "same": "-"})
    return report(f"dense prefill GEMMs (cuBLAS) at {rows} rows", part, "")


# the FP8 expert GEMM at decode (`gemm/triton_fp8_moe.fp8_expert_gemm`, per-channel experts with per-token x: the
# engine's `scale_once` path): (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, swap-AB); the first is the
# engine's launch before this sweep (BLOCK_M from `tile_rows`, the `DECODE_*` settings)
FP8_EXPERT_LAUNCHES = ((32, 64, 128, 4, 4, True), (32, 64, 128, 4, 3, True), (32, 64, 128, 4, 5, True),
                       (32, 64, 128, 4, 6, True), (32, 64, 256, 4, 3, True), (32, 64, 256, 4, 4, True),
                       (32, 128, 128, 4, 4, True), (32, 128, 128, 8, 4, True), (32, 128, 256, 8, 3, True),
                       (32, 64, 128, 8, 4, True), (64, 64, 128, 4, 4, True), (64, 64, 256, 4, 3, True),
                       (64, 128, 128, 8, 4, True), (64, 64, 128, 4, 4, False), (16, 64, 128, 4, 4, True),
                       (16, 64, 256, 4, 3, True), (16, 128, 128, 4, 4, True))
# (routed experts, top-k, hidden, width): the shared expert is one more expert of the stack, every token's pick k + 1
FP8_EXPERT_SHAPES = ({"next-16b": (32, 8, 4096, 1024), "80b": (512, 10, 2048, 512)} if DEVICE == "cuda"
                     else {"small": (8, 2, 256, 128)})  # on the CPU (a dry run under TRITON_INTERPRET=1)


def fp8_rows(experts: int, n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random per-channel FP8 expert weights on gen's device: ([E, n, k] float8_e4m3fn, scales [E, n] fp32)."""
    from hybridcache.fp8_format import FP8_DTYPE

    q = torch.empty(experts, n, k, dtype=FP8_DTYPE, device=gen.device)
    scale = torch.empty(experts, n, device=gen.device)
    for e in range(experts):  # one expert at a time: the 80B stack in fp32 would not fit
        w = torch.randn(n, k, generator=gen, device=gen.device) / k**0.5
        scale[e] = w.abs().amax(dim=1) / 448.0
        q[e] = (w / scale[e, :, None]).to(FP8_DTYPE)
    return q, scale


def per_expert(a: torch.Tensor, expert_of: torch.Tensor, w: torch.Tensor, w_rows: torch.Tensor) -> torch.Tensor:
    """[R, n] fp32: each sorted row a[r] times its expert's (expert_of[r]) dequantised weight, one expert at a time."""
    out = torch.zeros(a.shape[0], w.shape[1], device=a.device)
    for e in torch.unique(expert_of).tolist():
        rows_e = (expert_of == e).nonzero().flatten()
        out[rows_e] = a[rows_e] @ (w[e].float() * w_rows[e, :, None]).T
    return out


def sweep_fp8_experts(seqs: int) -> list[dict]:
    """The FP8 routed experts' gate/up (gather + SiLU gate) and down (scatter) GEMMs by launch, at the engine's
    decode layout: per-channel FP8 weights with the shared expert stacked last, x and h quantised per token, the
    unscaled MMA chain scaled once (`scale_once`); rate = every touched expert's FP8 weights once / time."""
    from hybridcache.kernels.gemm import triton_quant
    from hybridcache.kernels.gemm.triton_fp8_moe import fp8_expert_gemm
    from hybridcache.kernels.moe.grouped import sort_pairs, tile_rows

    device = DEVICE
    gen = torch.Generator().manual_seed(0)
    results = []
    for model, (routed, top_k, hidden, width) in FP8_EXPERT_SHAPES.items():
        experts = routed + 1
        picks = torch.rand(seqs, routed, generator=gen).argsort(dim=-1)[:, :top_k]
        ids = torch.cat([picks, torch.full((seqs, 1), routed)], dim=1).to(device)
        order, counts = sort_pairs(ids, experts)
        engine_m = tile_rows(seqs * top_k, routed)
        touched = int(torch.unique(ids).numel())

        wgen = torch.Generator(device=device).manual_seed(1)
        gate_up, gate_up_rows = fp8_rows(experts, 2 * width, hidden, wgen)
        down, down_rows = fp8_rows(experts, hidden, width, wgen)
        gate_up_copies = [gate_up, gate_up.clone()]
        down_copies = [down, down.clone()]
        x = (torch.randn(seqs, hidden, generator=gen) * 0.5).to(device, torch.bfloat16)
        xq, x_scale = triton_quant.quantize_rows(x)
        expert_of = ids.reshape(-1)[order]
        tokens = order // (top_k + 1)
        g, u = per_expert((xq.float() * x_scale)[tokens], expert_of, gate_up, gate_up_rows).chunk(2, dim=-1)
        h_ref = torch.nn.functional.silu(g) * u
        hq, h_scale = triton_quant.quantize_rows(h_ref.to(torch.bfloat16))
        y_ref = torch.empty(order.numel(), hidden, device=device)
        y_ref[order] = per_expert(hq.float() * h_scale, expert_of, down, down_rows)
        for kind, a, a_scale, copies_, rows, nbytes, ref, first in (
                ("gate/up + SiLU gate", xq, x_scale, gate_up_copies, gate_up_rows, touched * 2 * width * hidden,
                 h_ref, True),
                ("down", hq, h_scale, down_copies, down_rows, touched * hidden * width, y_ref, False)):
            part = []
            for block_m, block_n, block_k, warps, stages, swap in FP8_EXPERT_LAUNCHES:
                # 64 tokens over 32 experts: 16-row tiles read an expert's weights more than once
                if (model, block_m) in (("80b", 64), ("next-16b", 16)) or DEVICE == "cpu" and block_m != engine_m:
                    continue
                depth = copies_[0].shape[2]
                scales = rows[:, :, None].expand(-1, -1, -(-depth // 128))
                name = (f"{block_m}x{block_n}x{block_k}, {warps} warps, {stages} stages" + (", swap-AB" if swap else "")
                        + (" (tile_rows')" if block_m == engine_m else ""))
                settings = dict(w_scale=scales, counts=counts, block=(1, 128), out_dtype=torch.bfloat16,
                                gather=first, scatter=not first, swiglu=first, block_m=block_m, block_n=block_n,
                                block_k=block_k, num_warps=warps, num_stages=stages, swap_ab=swap, scale_once=True)
                launch = functools.partial(fp8_expert_gemm, a, a_scale, order, top_k + 1, **settings)

                def run(i: int, launch=launch, copies_=copies_) -> torch.Tensor:
                    return launch(weights=copies_[i])

                try:
                    out = run(0).float()
                    err = float((out - ref).abs().max() / ref.abs().max())
                    part.append({"launch": name, "us": graph_us(run, 2), "bytes": nbytes, "same": f"{err:.1e}",
                                 "model": model, "gemm": kind, "block_m": block_m, "block_n": block_n,
                                 "block_k": block_k, "num_warps": warps, "num_stages": stages, "swap_ab": swap})
                except Exception as error:  # a launch past the shared memory must not cost the table
                    print(f"{model} FP8 {kind} {name}: {type(error).__name__}: {str(error)[:120]}")
            results += report(f"{model} FP8 experts ({routed} + shared, top-{top_k} + 1, hidden {hidden}, width "
                              f"{width}, {touched} touched, rows per expert max {int(counts.max())}): {kind}, {seqs} "
                              "tokens (last column: max |diff| / max |ref|)", part,
                              f"{engine_m}x64x128, 4 warps, 4 stages, swap-AB (tile_rows')")
        del gate_up_copies, down_copies
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seqs", type=int, default=64)
    parser.add_argument("--only", default="gdn,conv,norm,argmax,conv_prefill")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    sweeps = {"gdn": sweep_gdn, "conv": sweep_conv, "norm": sweep_norms,
              "argmax": sweep_argmax, "conv_prefill": sweep_conv_prefill, "experts": sweep_experts,
              "fp8experts": sweep_fp8_experts, "moe_route": sweep_moe_route,
              "moe_prefill": sweep_moe_prefill, "prefill_gemm": sweep_prefill_gemm}
    found = {}
    for name in args.only.split(","):
        found[name] = sweeps[name](args.seqs)
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (a dry run: host times)"
    print(f"\n{name}, {args.seqs} sequences")
    out_dir = Path(args.out or os.environ.get("OUT") or ".")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "decode_kernel_sweep.json").write_text(json.dumps(found, indent=1))


if __name__ == "__main__":
    main()
