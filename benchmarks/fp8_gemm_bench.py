"""The FP8 GEMMs on the GPU against bf16, per shape: which kernel to pick (issue 29).

    PYTHONPATH=. python benchmarks/fp8_gemm_bench.py [--out DIR]

Dense linears (weights [N, K] of next-16b and of the Qwen3-Next-80B-A3B shape, M = 1, 16, 64, 128, 256, 2,048,
8,192 rows) and the routed experts (next-16b: 32 experts top-8, 4,096 / 1,024; 80B: 512 top-10, 2,048 / 512; T =
1, 64, 128, 1,024, 16,384 tokens), each timed as the median of CUDA-graph replays (`do_bench_cudagraph`) of:

| kernel | dense | experts |
| --- | --- | --- |
| `bf16` | `F.linear` (cuBLAS) | `moe/grouped.py::grouped_experts` (the engine's bf16 path) |
| `fp8-block` | `triton_block_fp8.fp8_linear` (W8A16 up to 64 rows, else quantisation + W8A8) | `fp8_grouped_experts` |
| `fp8-channel` | `scaled_mm.channel_fp8_linear` (`torch._scaled_mm`, row-wise) | - |
| `fp8-dequant` | dequantise the block weight to bf16, then `F.linear` (what a GEMM without FP8 inputs pays) | - |

Also the error of each FP8 result against the bf16 product of the dequantised weights (max |err| / max |ref|),
and the weight bytes per ms. Prints one table and writes DIR/fp8_gemm_bench.json (DIR: --out, else $OUT, else .).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

from hybridcache.fp8_format import BLOCK, CHANNEL
from hybridcache.kernels.gemm.reference import dequantize, quantize
from hybridcache.kernels.gemm.scaled_mm import channel_fp8_linear
from hybridcache.kernels.gemm.triton_block_fp8 import fp8_linear
from hybridcache.kernels.gemm.triton_fp8_moe import Fp8ExpertWeights, fp8_grouped_experts
from hybridcache.kernels.moe.grouped import ExpertWeights, grouped_experts

DENSE = {  # name: (N, K)
    "next-16b qkvz": (2 * 16 * 128 + 2 * 32 * 128, 4096),
    "next-16b o_proj": (4096, 32 * 256),
    "next-16b shared gate_up": (2 * 1024, 4096),
    "80b qkvz": (2 * 16 * 128 + 2 * 32 * 128, 2048),
    "80b o_proj": (2048, 16 * 256),
    "80b shared gate_up": (2 * 512, 2048),
    "28672 x 8192 (MODEL-FACTS)": (28672, 8192),
}
ROWS = (1, 16, 64, 128, 256, 2048, 8192)
EXPERTS = {"next-16b": (32, 8, 4096, 1024), "80b": (512, 10, 2048, 512)}  # E, k, H, I
TOKENS = (1, 64, 128, 1024, 16384)


def timed(fn) -> float:
    return triton.testing.do_bench_cudagraph(fn, return_mode="median")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def dense_rows(gen: torch.Generator) -> list[dict]:
    rows = []
    for name, (n, k) in DENSE.items():
        dense = torch.randn(n, k, generator=gen, device="cuda") / k**0.5
        wb, sb = quantize(dense, BLOCK)
        wc, sc = quantize(dense, CHANNEL)
        bf16_block = dequantize(wb, sb, BLOCK, torch.bfloat16)
        for m in ROWS:
            x = torch.randn(m, k, generator=gen, device="cuda").to(torch.bfloat16)
            ref = F.linear(x, bf16_block)
            row = {"shape": name, "N": n, "K": k, "M": m,
                   "bf16_ms": timed(lambda: F.linear(x, bf16_block)),  # noqa: B023 (timed at once)
                   "fp8_block_ms": timed(lambda: fp8_linear(x, wb, sb, BLOCK)),  # noqa: B023
                   "fp8_channel_ms": timed(lambda: channel_fp8_linear(x, wc, sc)),  # noqa: B023
                   "fp8_dequant_ms": timed(
                       lambda: F.linear(x, dequantize(wb, sb, BLOCK, torch.bfloat16))),  # noqa: B023
                   "fp8_block_err": rel(fp8_linear(x, wb, sb, BLOCK), ref),
                   "fp8_channel_err": rel(channel_fp8_linear(x, wc, sc), F.linear(x, dequantize(wc, sc, CHANNEL,
                                                                                                 torch.bfloat16)))}
            rows.append(row)
            print(row, flush=True)
    return rows


def expert_rows(gen: torch.Generator) -> list[dict]:
    rows = []
    for name, (experts, top_k, hidden, inter) in EXPERTS.items():
        gate = [torch.randn(inter, hidden, generator=gen, device="cuda") / hidden**0.5 for _ in range(experts)]
        up = [torch.randn(inter, hidden, generator=gen, device="cuda") / hidden**0.5 for _ in range(experts)]
        down = [torch.randn(hidden, inter, generator=gen, device="cuda") / inter**0.5 for _ in range(experts)]
        q = {kind: [quantize(w, BLOCK) for w in ws] for kind, ws in (("gate", gate), ("up", up), ("down", down))}
        fp8 = Fp8ExpertWeights(
            gate_up=torch.stack([torch.cat([g[0], u[0]]) for g, u in zip(q["gate"], q["up"], strict=True)]),
            gate_up_scale=torch.stack([torch.cat([g[1], u[1]]) for g, u in zip(q["gate"], q["up"], strict=True)]),
            down=torch.stack([d[0] for d in q["down"]]), down_scale=torch.stack([d[1] for d in q["down"]]),
            block=BLOCK.block)
        deq = {kind: [dequantize(w, s, BLOCK, torch.bfloat16) for w, s in ws] for kind, ws in q.items()}
        bf16 = ExpertWeights.stack(deq["gate"], deq["up"], deq["down"])
        del gate, up, down
        for tokens in TOKENS:
            x = torch.randn(tokens, hidden, generator=gen, device="cuda").to(torch.bfloat16)
            ids = torch.stack([torch.randperm(experts, generator=gen, device="cuda")[:top_k] for _ in range(tokens)])
            weights = torch.rand(tokens, top_k, generator=gen, device="cuda").to(torch.bfloat16)
            ref = grouped_experts(x, weights, ids, bf16)
            row = {"model": name, "tokens": tokens,
                   "bf16_ms": timed(lambda: grouped_experts(x, weights, ids, bf16)),  # noqa: B023
                   "fp8_block_ms": timed(lambda: fp8_grouped_experts(x, weights, ids, fp8)),  # noqa: B023
                   "fp8_block_err": rel(fp8_grouped_experts(x, weights, ids, fp8), ref)}
            rows.append(row)
            print(row, flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--skip-experts", action="store_true")
    args = parser.parse_args()
    gen = torch.Generator("cuda").manual_seed(0)
    result = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "dense": dense_rows(gen)}
    if not args.skip_experts:
        result["experts"] = expert_rows(gen)
    out = Path(args.out or os.environ.get("OUT") or ".") / "fp8_gemm_bench.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print("| shape | M | bf16 ms | fp8 block ms | fp8 channel ms | dequant + bf16 ms | block err | channel err |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in result["dense"]:
        print(f"| {r['shape']} | {r['M']} | {r['bf16_ms']:.4f} | {r['fp8_block_ms']:.4f} | {r['fp8_channel_ms']:.4f} "
              f"| {r['fp8_dequant_ms']:.4f} | {r['fp8_block_err']:.1e} | {r['fp8_channel_err']:.1e} |")
    for r in result.get("experts", []):
        print(f"| experts {r['model']} | T={r['tokens']} | {r['bf16_ms']:.4f} | {r['fp8_block_ms']:.4f} | - | - "
              f"| {r['fp8_block_err']:.1e} | - |")


if __name__ == "__main__":
    main()
