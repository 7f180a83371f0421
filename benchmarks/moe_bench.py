"""The routed experts on CUDA: the grouped GEMM path against the Triton expert GEMM, by tokens per step.

    PYTHONPATH=. python benchmarks/moe_bench.py [--out DIR]

For the expert shapes of the benchmark models (next-1b: 16 experts top-4, hidden 2048, width 512; next-16b:
32 top-8, 4096, 1024; and Qwen3-Next-80B's 512 top-10, 2048, 512) and T tokens from one decode row to a 16k
prefill chunk, times (the median of CUDA-graph replays) the routed-expert computation:
- `before`: last stop's path (gather, two grouped GEMMs, F.silu * up, index_copy_ un-permutation, bmm combine)
- `grouped`: the grouped GEMMs (token rows spread to their sorted rows, the Triton SiLU gate) and the Triton combine
- `triton bm/bn/bk/w[/s]`: the Triton expert GEMM (tile rows bm, columns bn, depth bk, warps w, pipeline stages s,
  3 when not named) and the combine
and `auto` (what `grouped_experts` picks). Prints one table per model (ms, and GB/s of the weights read for
decode sizes: each touched expert once) and the max relative difference of each variant against `before`;
writes DIR/moe_bench.json (DIR: --out, else $OUT, else .). `--sort`: instead, the pair sort alone
(`sort_pairs_torch`, five torch kernels, against `sort_pairs_triton`, one launch) for every T whose pairs one
program sorts.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

from hybridcache.kernels.moe import grouped
from hybridcache.kernels.moe.grouped import (
    ExpertWeights,
    expert_rows_grouped,
    expert_rows_triton,
    pair_rows,
    sort_pairs,
    sort_pairs_torch,
)
from hybridcache.kernels.moe.triton_experts import combine
from hybridcache.kernels.moe.triton_sort import MAX_PAIRS, sort_pairs_triton
from tests.kernels.cuda_checks import routing

SHAPES = {"next-1b": (16, 4, 2048, 512), "next-16b": (32, 8, 4096, 1024), "next-80b": (512, 10, 2048, 512)}
TOKENS = (1, 8, 32, 64, 128, 256, 1024, 4096, 16384)
TILES = [(16, 64, 128, 4), (32, 64, 128, 4), (64, 64, 128, 4), (16, 128, 64, 4), (32, 128, 64, 4),
         (64, 128, 64, 8), (128, 128, 64, 8), (16, 32, 128, 4),
         # decode-sized tiles for memory-bound expert reads: deeper K, more pipeline stages (5th field: num_stages)
         (16, 64, 256, 4, 3), (16, 64, 128, 4, 5), (16, 128, 128, 4, 4), (16, 128, 128, 8, 4), (16, 32, 256, 4, 4),
         (16, 64, 256, 8, 4)]


def before(x, weights, ids, experts):
    top_k = ids.shape[1]
    order, counts = sort_pairs(ids, experts.gate_up.shape[0])
    ends = counts.cumsum(0, dtype=torch.int32)
    xs = x.index_select(0, order // top_k)
    gate, up = torch._grouped_mm(xs, experts.gate_up.transpose(1, 2), offs=ends).chunk(2, dim=-1)
    y = torch._grouped_mm(F.silu(gate) * up, experts.down.transpose(1, 2), offs=ends)
    unsorted = torch.empty_like(y).index_copy_(0, order, y).view(ids.shape[0], top_k, -1)
    return torch.bmm(weights.to(y.dtype).unsqueeze(1), unsorted).squeeze(1)


def with_grouped(x, weights, ids, experts):
    order, counts = sort_pairs(ids, experts.gate_up.shape[0])
    pos = pair_rows(order)
    ends = counts.cumsum(0, dtype=torch.int32)
    return combine(expert_rows_grouped(x, pos, ends, ids.shape[1], experts), weights, pos)


def with_triton(tile):
    block_m, block_n, block_k, warps, stages = (*tile, 3)[:5]

    def run(x, weights, ids, experts):
        order, counts = sort_pairs(ids, experts.gate_up.shape[0])
        y = expert_rows_triton(x, order, counts, ids.shape[1], experts, block_m, block_n=block_n, block_k=block_k,
                               num_warps=warps, num_stages=stages)
        return combine(y, weights)

    return run


def timed(fn, *args) -> float:
    """Median ms of CUDA-graph replays of one call (`triton.testing.do_bench_cudagraph`): the device time, as a
    captured decode step runs it (timing eager calls at small T measures the host's ~10 kernel launches)."""
    fn(*args)  # compile and stack outside the capture
    return triton.testing.do_bench_cudagraph(lambda: fn(*args), return_mode="median")


def sort_table(models: list[str], device: torch.device, gen: torch.Generator) -> list[dict]:
    """The pair sort alone, torch against Triton (graph-timed ms), per model shape and T; checks they agree."""
    rows = []
    print("| model | T | pairs | torch ms | triton ms | torch / triton |")
    print("| --- | --- | --- | --- | --- | --- |")
    for model in models:
        num_experts, top_k = SHAPES[model][:2]
        for tokens in (1, 8, 32, 64, 128, 256, 512):
            if tokens * top_k > MAX_PAIRS:
                continue
            ids = routing(tokens, num_experts, top_k, torch.bfloat16, device, gen)[1]
            want, got = sort_pairs_torch(ids, num_experts), sort_pairs_triton(ids, num_experts)
            if not all(torch.equal(a, b) for a, b in zip(want, got, strict=True)):
                raise AssertionError(f"{model} T={tokens}: the Triton pair sort differs from torch's")
            row = {"model": model, "tokens": tokens, "pairs": tokens * top_k,
                   "torch_ms": timed(sort_pairs_torch, ids, num_experts),
                   "triton_ms": timed(sort_pairs_triton, ids, num_experts)}
            print(f"| {model} | {tokens} | {row['pairs']} | {row['torch_ms']:.4f} | {row['triton_ms']:.4f} | "
                  f"{row['torch_ms'] / row['triton_ms']:.2f} |", flush=True)
            rows.append(row)
    return rows


def expert_tables(models: list[str], device: torch.device, dtype: torch.dtype, gen: torch.Generator) -> list[dict]:
    """One table per model: every variant's graph-timed ms per token count, and its error against `before`."""
    rows = []
    variants = {"before": before, "grouped": with_grouped, "auto": grouped.grouped_experts}
    variants.update({"triton " + "/".join(map(str, tile)): with_triton(tile) for tile in TILES})
    for model in models:
        num_experts, top_k, hidden, inter = SHAPES[model]
        experts = ExpertWeights(
            (torch.randn(num_experts, 2 * inter, hidden, device=device) / hidden**0.5).to(dtype),
            (torch.randn(num_experts, hidden, inter, device=device) / inter**0.5).to(dtype))
        print(f"\n{model}: {num_experts} experts top-{top_k}, hidden {hidden}, width {inter}")
        print("| T | " + " | ".join(variants) + " | best |")
        print("| --- " * (len(variants) + 2) + "|")
        for tokens in TOKENS:
            x = torch.randn(tokens, hidden, generator=gen).to(device, dtype)
            weights, ids = routing(tokens, num_experts, top_k, dtype, device, gen)
            ref = before(x, weights, ids, experts).float()
            touched = int(torch.unique(ids).numel())
            weight_bytes = touched * 3 * inter * hidden * 2
            row = {"model": model, "tokens": tokens, "touched_experts": touched, "ms": {}, "max_rel": {}}
            for name, fn in variants.items():
                try:
                    out = fn(x, weights, ids, experts)
                    row["max_rel"][name] = float((out.float() - ref).abs().max() / ref.abs().max())
                    row["ms"][name] = timed(fn, x, weights, ids, experts)
                except Exception as error:  # one failing tile config must not cost the table
                    row["ms"][name] = float("nan")
                    row.setdefault("errors", {})[name] = repr(error)[:200]
            best = min((ms, name) for name, ms in row["ms"].items() if ms == ms)
            cells = [f"{row['ms'][n]:.3f}" + ("" if row["max_rel"].get(n, 1) < 3e-2 else "!") for n in variants]
            gbs = weight_bytes / best[0] / 1e6
            print(f"| {tokens} | " + " | ".join(cells) + f" | {best[1]} ({gbs:.0f} GB/s of weights) |", flush=True)
            rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--models", default=",".join(SHAPES))
    parser.add_argument("--sort", action="store_true", help="time only the pair sort, torch against Triton")
    args = parser.parse_args()
    device, dtype = torch.device("cuda"), torch.bfloat16
    gen = torch.Generator().manual_seed(0)
    result = {"device": torch.cuda.get_device_name()}
    if args.sort:
        result["sort"] = sort_table(args.models.split(","), device, gen)
    else:
        result["rows"] = expert_tables(args.models.split(","), device, dtype, gen)
    out_dir = Path(args.out or os.environ.get("OUT") or ".")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "moe_bench.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
