"""Mamba2 prefill chunks on CUDA: fla's chunked simple-GLA kernels (`mamba2/fla.ssd_chunk_scan_varlen`, what
`CudaBackend.ssd_scan` runs for prefill rows) against the torch reference scan (`mamba2/reference.ssd_chunk_scan`,
what it ran before), on one layer of a model's shapes (default Granite-4.0-H-small: 128 heads of 64, one group,
state 128).

    PYTHONUNBUFFERED=1 PYTHONPATH=. python benchmarks/ssd_prefill_bench.py [--lengths 16,64,200,600,2000,16000]
        [--widths 128,64,1,128] [--dtype bf16|fp32] [--seqs 1]

For each chunk length T, `--seqs` sequences of T tokens each (the first fresh, the others continuing from a
non-zero state row): both paths run on the same inputs (the discretization of dt included); the output's and the
final states' max error and relative error (||fla - reference|| / ||reference||) are printed, then each path is
timed as `--calls` calls back to back followed by one synchronisation, the mean per call (the reference loops over
the sequences on the host, as `backend.mamba2_scan` does). fp32 runs IEEE fp32 dots, as the engine does
(`TRITON_F32_DEFAULT=ieee`). Prints a table, writes DIR/ssd_prefill_bench.json (DIR: --out, else $OUT, else .);
exit status 1 when a relative error passes --max-error (bf16's expected ~2.4e-3: tests/kernels/test_mamba2_cuda.py).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch


def inputs(length: int, num_seqs: int, widths: tuple[int, int, int, int], dtype: torch.dtype,
           gen: torch.Generator, device: str = "cuda") -> dict:
    """`num_seqs` sequences of `length` new tokens; x, B, C column views of one conv output, dt of the projection,
    as the layer passes them; state rows 1.. of an fp32 pool (sequence 0 fresh, the others after 1,000 tokens)."""
    heads, head_dim, groups, state = widths
    total = length * num_seqs
    xbc = torch.randn(total, heads * head_dim + 2 * groups * state, generator=gen).to(device, dtype)
    x, B, C = xbc.split([heads * head_dim, groups * state, groups * state], dim=1)  # noqa: N806
    context = [length] + [1000 + length] * (num_seqs - 1)
    return {
        "x": x.view(total, heads, head_dim), "B": B.view(total, groups, state), "C": C.view(total, groups, state),
        "dt": torch.randn(total, heads, generator=gen).to(device, dtype),
        "dt_bias": (torch.rand(heads, generator=gen) - 4.0).to(device),
        "A_log": torch.linspace(0.0, 2.77, heads).to(device),  # A from -1 to -16, as Granite's
        "D": torch.ones(heads).to(device),
        "ssm_pool": (0.1 * torch.randn(num_seqs + 1, heads, head_dim, state, generator=gen)).to(device),
        "slots": torch.arange(1, num_seqs + 1, device=device),
        "cu": torch.arange(0, total + 1, length, device=device),
        "context_lens": torch.tensor(context, device=device, dtype=torch.int32),
        "lengths": [length] * num_seqs, "context": context,
    }


def reference_scan(x: dict) -> torch.Tensor:
    """What `CudaBackend.ssd_scan` ran before on CUDA: the torch chunked scan per sequence (`backend.mamba2_scan`)."""
    from hybridcache.kernels.mamba2 import reference as mamba2_ref

    A = -torch.exp(x["A_log"].float())  # noqa: N806
    dt = mamba2_ref.discretized_dt(x["dt"], x["dt_bias"], (0.0, float("inf")))
    out = torch.empty(x["x"].shape, dtype=torch.float32, device=x["x"].device)
    start = 0
    for i, (length, context) in enumerate(zip(x["lengths"], x["context"], strict=True)):
        rows, start = slice(start, start + length), start + length
        slot = x["slots"][i : i + 1]
        initial = None if length == context else x["ssm_pool"].index_select(0, slot)[0]
        out[rows], final = mamba2_ref.ssd_chunk_scan(x["x"][rows], dt[rows], A, x["B"][rows], x["C"][rows], x["D"],
                                                     initial)
        x["ssm_pool"].index_copy_(0, slot, final[None])
    return out


def fla_scan(x: dict, chunks: torch.Tensor) -> torch.Tensor:
    from hybridcache.kernels.mamba2 import fla as mamba2_fla
    from hybridcache.kernels.mamba2 import reference as mamba2_ref

    A = -torch.exp(x["A_log"].float())  # noqa: N806
    dt = mamba2_ref.discretized_dt(x["dt"], x["dt_bias"], (0.0, float("inf")))
    return mamba2_fla.ssd_chunk_scan_varlen(x["x"], dt, A, x["B"], x["C"], x["D"], x["ssm_pool"], x["slots"], x["cu"],
                                            x["context_lens"], x["lengths"], chunk_indices=chunks,
                                            context_lens_cpu=x["context"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", default="16,64,200,600,2000,16000")
    parser.add_argument("--widths", default="128,64,1,128", help="heads, head dim, groups, state size")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--seqs", type=int, default=1)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--max-error", type=float, default=1e-2)
    parser.add_argument("--out", default=None)
    parser.add_argument("--device", default="cuda", help="cuda (cpu: smoke runs of this script only)")
    args = parser.parse_args()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    if dtype == torch.float32:
        os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")  # before any kernel compiles, as the engine does

    from hybridcache.kernels.mamba2.fla import CHUNK_SIZE
    from hybridcache.kernels.varlen import chunk_indices as make_chunk_indices

    widths = tuple(int(w) for w in args.widths.split(","))
    on_cuda = torch.device(args.device).type == "cuda"
    sync = torch.cuda.synchronize if on_cuda else (lambda: None)
    device_name = torch.cuda.get_device_name() if on_cuda else args.device
    gen = torch.Generator().manual_seed(0)
    rows, within = [], True
    for length in (int(n) for n in args.lengths.split(",")):
        x = inputs(length, args.seqs, widths, dtype, gen, args.device)
        chunks = make_chunk_indices(x["cu"], x["lengths"], CHUNK_SIZE)
        paths = {"reference": lambda x=x: reference_scan(x), "fla": lambda x=x, chunks=chunks: fla_scan(x, chunks)}
        before = x["ssm_pool"].clone()
        results = {}
        for name, fn in paths.items():
            x["ssm_pool"].copy_(before)
            results[name] = (fn().clone(), x["ssm_pool"].clone())
        row = {"length": length, "seqs": args.seqs}
        for what, index in (("out", 0), ("state", 1)):
            got, want = results["fla"][index], results["reference"][index]
            row[f"{what}_max_error"] = (got - want).abs().max().item()
            row[f"{what}_rel_error"] = ((got - want).norm() / want.norm()).item()
            within &= row[f"{what}_rel_error"] <= args.max_error
        for name, fn in paths.items():
            for _ in range(3):
                fn()
            sync()
            start = time.perf_counter()
            for _ in range(args.calls):
                fn()
            sync()
            row[f"{name}_ms"] = 1000 * (time.perf_counter() - start) / args.calls
        rows.append(row)
        print(row, flush=True)
    print(f"\n{device_name}, widths {widths}, {args.dtype}, {args.seqs} sequence(s) per row")
    print("| tokens per sequence | reference ms/call | fla ms/call | speed-up | out rel error | state rel error |\n"
          "| --- | --- | --- | --- | --- | --- |")
    for row in rows:
        speedup = row["reference_ms"] / row["fla_ms"]
        print(f"| {row['length']} | {row['reference_ms']:.3f} | {row['fla_ms']:.3f} | {speedup:.1f}x | "
              f"{row['out_rel_error']:.2e} | {row['state_rel_error']:.2e} |")
    out_dir = Path(args.out or os.environ.get("OUT") or ".")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "ssd_prefill_bench.json").write_text(json.dumps(
        {"device": device_name, "widths": widths, "dtype": args.dtype, "rows": rows}, indent=1))
    raise SystemExit(0 if within else 1)


if __name__ == "__main__":
    main()
