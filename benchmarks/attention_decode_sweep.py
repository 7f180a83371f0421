"""The split-KV decode attention kernel's launch (key block, warps, pipeline stages, grid coverage), timed on CUDA at
the decode step's shapes (issue 32).

    PYTHONPATH=. python benchmarks/attention_decode_sweep.py [--max-model-len 262144] [--heads 16,2,256]

Qwen3-Next's attention (16 query heads, 2 kv heads of 256, pages of 64 tokens, bf16; `--heads Q,KV,D` another
model's: Falcon-H1-1.5B-Deep's 6,2,128, Qwen3.5-9B's 16,4,256) in three cases: 64
sequences of about 1,050 tokens (phase D's decode), 64 of about 4,100, and one sequence of 16,000 (an agent's
long prompt). Splits are sized as a decode CUDA graph sizes them, from `--max-model-len` (the static batch's
first row claims it), and each sequence's own context is cut into them on the device. Per launch: device us per
call (`dense.replay_us`: the median of 5 CUDA-graph replays of 16 calls, block tables rotated over 4 disjoint page
sets so the keys come from memory), the KV bytes read and the rate that gives, and the largest difference from
the torch reference (`reference.paged_decode_attention`, fp32). The default launch is marked. Writes
DIR/attention_decode_sweep_<Q-KV-D>.json (DIR: --out, else $OUT, else .).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
from pathlib import Path

import torch

from hybridcache.kernels.attention import reference, triton_paged
from hybridcache.kernels.attention.triton_paged import DecodeLaunch
from hybridcache.kernels.gemm.dense import replay_us

PAGE = 64
CASES = {"64 x 1,050": (64, 1050), "64 x 4,100": (64, 4100), "1 x 16,000": (1, 16000)}
# (key block, launch): the default first
LAUNCHES = [(64, DecodeLaunch())] + [(64, DecodeLaunch(w, s, c)) for w, s, c in (
    (4, 1, 2), (4, 3, 2), (8, 2, 2), (8, 1, 2), (4, 2, 4), (4, 1, 4), (8, 2, 4), (4, 2, 8))] + [
    (32, DecodeLaunch(w, s, c)) for w, s, c in ((4, 2, 2), (4, 3, 2), (4, 2, 4), (2, 2, 4))] + [
    (128, DecodeLaunch(w, s, c)) for w, s, c in ((4, 2, 2), (8, 2, 2), (4, 2, 4), (8, 2, 4))]  # (for head dims <= 128)


def case_tensors(num_seqs: int, context: int, heads: tuple[int, int, int], device: torch.device,
                 rng: random.Random):
    """q, the pool, 4 block-table copies over disjoint pages, context lengths (each within 2% of `context`);
    heads: (query heads, kv heads, head dim)."""
    q_heads, kv_heads, dim = heads
    lens = [max(1, context + rng.randint(-context // 50, context // 50)) for _ in range(num_seqs)]
    width = -(-max(lens) // PAGE)
    pages = torch.randperm(4 * num_seqs * width, device=device)
    tables = [pages[i * num_seqs * width: (i + 1) * num_seqs * width].view(num_seqs, width).int() for i in range(4)]
    pool = torch.randn(2, 4 * num_seqs * width, PAGE, kv_heads, dim, device=device, dtype=torch.bfloat16)
    q = torch.randn(num_seqs, q_heads, dim, device=device, dtype=torch.bfloat16)
    return q, pool, tables, torch.tensor(lens, dtype=torch.int32, device=device)


def sweep_case(name: str, num_seqs: int, context: int, heads: tuple[int, int, int], max_model_len: int,
               device: torch.device, rng: random.Random) -> list[dict]:
    """Every launch of `LAUNCHES` on one case: a row each (printed as it comes)."""
    _, kv_heads, dim = heads
    q, pool, tables, lens = case_tensors(num_seqs, context, heads, device, rng)
    kv_bytes = int(lens.sum()) * 2 * kv_heads * dim * 2
    want = reference.paged_decode_attention(q.float(), pool.float(), tables[0], lens, scale=dim**-0.5)
    rows = []
    for block_n, launch in LAUNCHES:
        run = functools.partial(lambda table, launch, block_n: triton_paged.paged_decode_attention(
            q, pool, table, lens, max_model_len, scale=dim**-0.5, block_n=block_n, launch=launch), launch=launch,
            block_n=block_n)
        try:
            diff = (run(tables[0]).float() - want).abs().max().item()
            us = replay_us(run, tables, device)
        except Exception as error:  # noqa: BLE001 (a launch that does not compile or fit: named, the rest go on)
            print(f"| {name} | {block_n}, {launch} | failed: {error!r} |"[:300], flush=True)
            continue
        label = f"{block_n}, {launch.num_warps}, {launch.num_stages}, {launch.coverage}" + (
            " (default)" if (block_n, launch) == LAUNCHES[0] else "")
        rows.append({"case": name, "heads": list(heads), "block_n": block_n, "num_warps": launch.num_warps,
                     "num_stages": launch.num_stages, "coverage": launch.coverage, "us": us,
                     "gb_s": kv_bytes / us / 1e3, "max_diff": diff})
        print(f"| {name} | {label} | {us:.1f} | {kv_bytes / us / 1e3:.0f} | {diff:.2e} |", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--max-model-len", type=int, default=262144)
    parser.add_argument("--heads", default="16,2,256", help="query heads, kv heads, head dim")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    heads = tuple(int(x) for x in args.heads.split(","))
    if len(heads) != 3 or heads[0] % heads[1]:
        parser.error(f"--heads {args.heads!r}: want Q,KV,D with Q a multiple of KV")
    device = torch.device("cuda")
    rng = random.Random(0)
    records = []
    print("| case | launch (key block, warps, stages, coverage) | us per call | GB/s | max abs diff |\n"
          "| --- | --- | --- | --- | --- |")
    for name, (num_seqs, context) in CASES.items():
        records += sweep_case(f"{name} ({args.heads})", num_seqs, context, heads, args.max_model_len, device, rng)
    out = Path(args.out or os.environ.get("OUT") or ".")
    out.mkdir(parents=True, exist_ok=True)
    (out / f"attention_decode_sweep_{args.heads.replace(',', '-')}.json").write_text(json.dumps(records, indent=1))


if __name__ == "__main__":
    main()
