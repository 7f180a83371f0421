"""The paged attention prefill kernel on short chunks over long contexts: one program per (query block, head) against
its keys split across programs (`triton_paged.prefill_splits`, issue 32).

    PYTHONUNBUFFERED=1 PYTHONPATH=. python benchmarks/attention_prefill_bench.py [--page 64] [--reps 50] [--out DIR]

One sequence of N new tokens over C keys (its cached context plus itself) in a bf16 pool of pages of `--page`,
Qwen3-Next's attention (Hq 16, Hkv 2, D 256): the kernel alone, median device ms of `--reps` launches (CUDA events,
after warm-up), with 1 split and with the count `prefill_splits` picks, and the largest difference of the two
outputs (bf16 rounding of sums taken in another order); for the first shape, every split count from 2 to
MAX_PREFILL_SPLITS. Shapes: phase C's + 200 request (200 over 16,200), phase A's
prefix hits (300-960 over 2,400-3,900), a 16-token step over 16,016, a 1,024-token chunk over 16,000.
Prints a table; writes DIR/attention_prefill_bench.json (DIR: --out, else $OUT, else .).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
from rollback_bench import median_ms  # a sibling script: CUDA-event median after 3 warm-ups

from hybridcache.kernels.attention import triton_paged
from hybridcache.kernels.varlen import chunk_indices, num_chunks

SHAPES = ((200, 16_200), (960, 3_900), (300, 2_400), (16, 16_016), (1024, 16_000), (200, 4_200))
HEADS, KV_HEADS, HEAD_DIM = 16, 2, 256


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--page", type=int, default=64)
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device("cuda")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    gen = torch.Generator(device=device).manual_seed(0)
    config = triton_paged.default_prefill_config(HEAD_DIM, torch.bfloat16)
    rows = []
    print(f"{torch.cuda.get_device_name()}, {sms} SMs, pages of {args.page}, Hq {HEADS}, Hkv {KV_HEADS}, D {HEAD_DIM}")
    print("| new tokens | keys | programs | splits | 1 split ms | split ms | speed-up | max abs diff |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for new, context in SHAPES:
        pages = -(-context // args.page)
        pool = torch.randn(2, pages + 1, args.page, KV_HEADS, HEAD_DIM, generator=gen, device=device,
                           dtype=torch.bfloat16)
        table = torch.randperm(pages, generator=gen, device=device).to(torch.int32)[None, :]
        q = torch.randn(new, HEADS, HEAD_DIM, generator=gen, device=device, dtype=torch.bfloat16)
        cu = torch.tensor([0, new], dtype=torch.int32, device=device)
        ctx = torch.tensor([context], dtype=torch.int32, device=device)
        chunks = chunk_indices(cu.long(), (new,), config.block_m)
        programs = num_chunks((new,), config.block_m) * HEADS
        splits = triton_paged.prefill_splits(programs, context, sms)

        def run(num_splits: int, q=q, pool=pool, table=table, cu=cu, ctx=ctx, chunks=chunks, new=new) -> torch.Tensor:
            return triton_paged.paged_prefill_attention(q, pool, table, cu, ctx, (new,), scale=HEAD_DIM**-0.5,
                                                        config=config, chunk_indices=chunks, num_splits=num_splits)

        one, split = median_ms(lambda: run(1), args.reps), median_ms(lambda fn=run, s=splits: fn(s), args.reps)
        diff = (run(1).float() - run(splits).float()).abs().max().item()
        sweep = {}
        if (new, context) == SHAPES[0]:  # the + 200 request: every split count up to the most
            sweep = {n: median_ms(lambda fn=run, n=n: fn(n), args.reps)
                     for n in range(2, triton_paged.MAX_PREFILL_SPLITS + 1)}
        rows.append({"new": new, "keys": context, "programs": programs, "splits": splits, "one_ms": one,
                     "split_ms": split, "max_abs_diff": diff, "sweep_ms": sweep})
        print(f"| {new} | {context:,} | {programs} | {splits} | {one:.3f} | {split:.3f} | {one / split:.2f}x | "
              f"{diff:.2e} |")
        if sweep:
            print("  ms by split count: " + ", ".join(f"{n}: {ms:.3f}" for n, ms in sweep.items()))
    out_dir = Path(args.out or os.environ.get("OUT") or ".")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "attention_prefill_bench.json").write_text(json.dumps({"sms": sms, "page": args.page, "rows": rows},
                                                                     indent=1))


if __name__ == "__main__":
    main()
