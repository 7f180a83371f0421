"""Gated DeltaNet prefill chunks on CUDA: our call of fla's forward (`gated_delta/fla.chunk_gated_delta_rule_varlen`)
against fla's public `chunk_gated_delta_rule`, on one layer of a model's shapes (next-1b: 16 key heads, 32 value
heads, 128 x 128).

    PYTHONUNBUFFERED=1 PYTHONPATH=. python benchmarks/gdn_prefill_bench.py [--lengths 16,64,200,600,2000,16000]

For each chunk length T (one sequence continuing from a non-zero state): both paths on the same inputs must give
bit-identical outputs and final states (printed; exit status 1 otherwise), then each is timed as `--calls` calls back
to back followed by one synchronisation, the mean per call: where the device work is shorter than the host's
(short chunks), that is the host cost of one layer's call. Prints a table, writes DIR/gdn_prefill_bench.json
(DIR: --out, else $OUT, else .).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch


def public_fla(q, k, v, g, beta, ssm_pool, slots, cu, context_lens, chunk_indices):
    """What `chunk_gated_delta_rule_varlen` did before it called fla's forward directly: fla's public entry point."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    from hybridcache.kernels.norm.triton import l2norm
    from hybridcache.kernels.varlen import fresh_mask

    initial = ssm_pool.index_select(0, slots).float()
    initial = initial.masked_fill(fresh_mask(cu, context_lens)[:, None, None, None], 0.0)
    q, k = l2norm(q), l2norm(k)
    out, final = chunk_gated_delta_rule(
        q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), g.float().unsqueeze(0), beta.unsqueeze(0),
        scale=q.shape[-1] ** -0.5, initial_state=initial, output_final_state=True, use_qk_l2norm_in_kernel=False,
        cu_seqlens=cu, chunk_indices=chunk_indices,
    )
    ssm_pool.index_copy_(0, slots, final.to(ssm_pool.dtype))
    return out[0]


def inputs(length: int, heads: tuple[int, int], dim: int, gen: torch.Generator) -> dict:
    """One sequence of `length` new tokens after 1,000 cached ones, in slot 1 of a 3-slot fp32 state pool; q, k, v
    are column views of one projection output, as the model passes them."""
    hk, hv = heads
    mixed = torch.randn(length, (2 * hk + hv) * dim, generator=gen).to("cuda", torch.bfloat16)
    q, k, v = mixed.split([hk * dim, hk * dim, hv * dim], dim=1)
    return {
        "q": q.view(length, hk, dim), "k": k.view(length, hk, dim), "v": v.view(length, hv, dim),
        "g": (-torch.rand(length, hv, generator=gen) * 0.1).cuda(),
        "beta": torch.rand(length, hv, generator=gen).to("cuda", torch.bfloat16),
        "ssm_pool": (0.1 * torch.randn(3, hv, dim, dim, generator=gen)).cuda(),
        "slots": torch.tensor([1], device="cuda"),
        "cu": torch.tensor([0, length], device="cuda"),
        "context_lens": torch.tensor([1000 + length], device="cuda", dtype=torch.int32),
    }


def main() -> None:
    from hybridcache.kernels.gated_delta.fla import CHUNK_SIZE, chunk_gated_delta_rule_varlen, fla_chunk_forward
    from hybridcache.kernels.varlen import chunk_indices as make_chunk_indices

    fla_chunk_forward()  # fla's solve in IEEE for both paths, before either compiles it

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", default="16,64,200,600,2000,16000")
    parser.add_argument("--heads", default="16,32", help="key heads, value heads")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    heads = tuple(int(h) for h in args.heads.split(","))
    gen = torch.Generator().manual_seed(0)
    rows, identical = [], True
    for length in (int(n) for n in args.lengths.split(",")):
        x = inputs(length, heads, args.dim, gen)
        table = make_chunk_indices(x["cu"], [length], CHUNK_SIZE)

        def ours(x=x, table=table, length=length):
            return chunk_gated_delta_rule_varlen(x["q"], x["k"], x["v"], x["g"], x["beta"], x["ssm_pool"], x["slots"],
                                                 x["cu"], x["context_lens"], [length], chunk_indices=table)

        def public(x=x, table=table):
            return public_fla(x["q"], x["k"], x["v"], x["g"], x["beta"], x["ssm_pool"], x["slots"], x["cu"],
                              x["context_lens"], table)

        before = x["ssm_pool"].clone()
        results = {}
        for name, fn in (("public", public), ("ours", ours)):
            x["ssm_pool"].copy_(before)
            out = fn()
            results[name] = (out.clone(), x["ssm_pool"].clone())
        same = all(torch.equal(a, b) for a, b in zip(results["public"], results["ours"]))
        identical &= same
        row = {"length": length, "identical": same}
        for name, fn in (("public", public), ("ours", ours)):
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(args.calls):
                fn()
            torch.cuda.synchronize()
            row[f"{name}_ms"] = 1000 * (time.perf_counter() - start) / args.calls
        rows.append(row)
        print(row, flush=True)
    print("\n| chunk tokens | fla public ms/call | ours ms/call | identical |\n| --- | --- | --- | --- |")
    for row in rows:
        print(f"| {row['length']} | {row['public_ms']:.3f} | {row['ours_ms']:.3f} | {row['identical']} |")
    out_dir = Path(args.out or os.environ.get("OUT") or ".")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "gdn_prefill_bench.json").write_text(json.dumps({"heads": heads, "dim": args.dim, "rows": rows},
                                                               indent=1))
    raise SystemExit(0 if identical else 1)


if __name__ == "__main__":
    main()
