"""The FP8 MoE block's small decode launches, timed on CUDA (issue 29: the FP8 decode step's "everything else").

    PYTHONPATH=. python benchmarks/fp8_moe_parts.py [--seqs 64] [--out DIR]

At next-16b's decode shape (32 routed experts top-8 + the shared expert stacked as expert 32, hidden 4,096) and
the 80B-A3B shape (512 top-10 + shared, hidden 2,048), device us per call (the median of 5 CUDA-graph replays of
20 calls, `kernels.gemm.dense.replay_us`) of:

- the pair sort: bf16's (the routed picks over the routed experts), the FP8 stack's before this change (the
  [T, k + 1] ids with the shared column over E + 1 experts: the next power-of-two bucket) and with `shared` (the
  routed picks alone, the shared run appended; `moe/triton_sort.py`);
- `with_shared`, `triton_quant.quantize_rows` of x, the route kernel, and `shared_prologue` (the sort with
  `shared`, the shared pick's weights and x's quantisation in one launch: what the FP8 decode step runs);
- the router and shared-gate GEMM (`SparseMoeBlock.gates`: [T, H] x [E + 1, H]^T in bf16) by cuBLAS at its width
  and padded to 40 / 48 / 64 rows, and the skinny Triton GEMM's candidates (`kernels.gemm.dense.candidates`).

Writes DIR/fp8_moe_parts.json (DIR: --out, else $OUT, else .).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F

from hybridcache.kernels.gemm import dense, triton_quant, triton_skinny
from hybridcache.kernels.gemm.dense import replay_us
from hybridcache.kernels.gemm.triton_fp8_moe import shared_prologue, with_shared
from hybridcache.kernels.moe.triton_route import route
from hybridcache.kernels.moe.triton_sort import sort_pairs_triton

SHAPES = {"next-16b": (32, 8, 4096), "80b": (512, 10, 2048)}  # (routed experts, top-k, hidden)


def timed(run) -> float:
    """Device us per call of `run()` (no weight rotation: these launches read what the step just wrote)."""
    return replay_us(lambda _w: run(), [None], torch.device("cuda"))


def parts(seqs: int, routed: int, top_k: int, hidden: int) -> dict[str, float]:
    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    ids = torch.rand(seqs, routed, generator=gen).argsort(dim=-1)[:, :top_k].contiguous().to(device)
    plus = torch.cat([ids, torch.full((seqs, 1), routed, device=device)], dim=1)
    weights = torch.rand(seqs, top_k, generator=gen).to(device, torch.bfloat16)
    gate = torch.randn(seqs, routed + 1, generator=gen).to(device, torch.bfloat16)[:, -1:]  # the router's column
    x = torch.randn(seqs, hidden, generator=gen).to(device, torch.bfloat16)
    logits = torch.randn(seqs, routed, generator=gen).to(device, torch.bfloat16)
    found = {
        "sort: routed picks, routed experts (bf16's)": timed(lambda: sort_pairs_triton(ids, routed)),
        "sort: [T, k + 1] ids over E + 1 (FP8 before)": timed(lambda: sort_pairs_triton(plus, routed + 1)),
        "sort: shared (routed picks, shared run appended)": timed(lambda: sort_pairs_triton(ids, routed + 1, True)),
        "with_shared": timed(lambda: with_shared(weights, ids, gate, routed)),
        "quantize_rows(x)": timed(lambda: triton_quant.quantize_rows(x)),
        "route": timed(lambda: route(logits, top_k, True)),
        "shared_prologue (sort with shared + weights + quantize_rows(x), one launch)": timed(
            lambda: shared_prologue(x, weights, ids, gate, routed + 1)),
    }
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    copies = [(torch.randn(routed + 1, hidden, generator=gen) * hidden**-0.5).to(device, torch.bfloat16)
              for _ in range(64)]
    for rows in (routed + 1, 40, 48, 64):
        if rows >= routed + 1:
            padded = [torch.cat([w, w.new_zeros(rows - w.shape[0], hidden)]) for w in copies]
            found[f"gates GEMM: cuBLAS, {rows} rows"] = replay_us(lambda w: F.linear(x, w), padded, device)
    for config in dense.candidates(routed + 1, hidden, seqs, sms):
        found[f"gates GEMM: {config.describe()}"] = replay_us(
            lambda w, c=config: triton_skinny.skinny_linear(x, w, None, c), copies, device)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seqs", type=int, default=64)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    results = {}
    for model, shape in SHAPES.items():
        results[model] = parts(args.seqs, *shape)
        print(f"\n| {model}, {args.seqs} tokens | us per call |\n| --- | --- |")
        for name, us in results[model].items():
            print(f"| {name} | {us:.2f} |")
    out_dir = Path(args.out or os.environ.get("OUT") or ".")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "fp8_moe_parts.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
