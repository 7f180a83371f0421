"""Every launch of a decode step's dense GEMMs at 16-64 rows: cuBLAS against a grid of skinny Triton tiles (issue 32).

PYTHONPATH=. python benchmarks/skinny_launch_sweep.py [--model next-1b] [--model next-16b] [--rows 16,32,48,64]

For each dense linear of one decode step of a `gpu_bench.py` model (`dense_gemm_sweep.step_linears`; the MoE block's
input GEMM zero-padded to a multiple of 8 weight rows, as the engine loads it) and each row count: cuBLAS
(`F.linear`), cuBLASLt's bias epilogue (`F.linear` with a zero bias: another heuristic query), and the skinny GEMM
(`kernels/gemm/triton_skinny.py`) over a grid of tiles (`dense.TILES`: weight rows and depth per tile, stages, warps),
each by pointer loads and by TMA descriptors, unsplit and split-K at 1/2x, 1x and 2x the slices that fill the SMs.
Each launch is timed as `dense.replay_us` does (a CUDA graph of 20 GEMMs over weight copies beyond L2, the median of 5
replays) and checked against `F.linear` in fp32 (max |diff| / max |ref|). Every variant is compiled first by
`--workers` processes in parallel (the Triton cache is shared), so the sweep itself compiles nothing. "main" is the
launch main's `dense.decide` would choose (its two tiles, unsplit and split; cuBLAS unless 5 % faster). Prints one row
per (linear, rows); writes DIR/skinny_launch_sweep.json (DIR: --out, else $OUT, else .).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dense_gemm_sweep import COPY_RATE, step_linears  # noqa: E402
from gpu_bench import MODELS  # noqa: E402

from hybridcache.kernels.gemm import dense  # noqa: E402
from hybridcache.kernels.gemm.triton_skinny import SkinnyConfig, block_rows, fits, skinny_linear  # noqa: E402

CUBLAS_ONLY_BYTES = 256 << 20  # a weight this large (next-16b's lm_head) is timed on cuBLAS only


def main_candidates(n: int, k: int, m: int, sms: int) -> list[SkinnyConfig]:
    """main's (0c00ffa) `dense.candidates`: 64 x 128 (4 stages) and 128 x 128 (3 stages) pointer tiles, unsplit and
    at the smallest power of two of slices that fills the SMs and twice that."""
    found = []
    most = max(1, k // 128)
    for block_n, stages in ((64, 4), (128, 3)):
        tiles = -(-n // block_n)
        split = 1
        while tiles * split < sms and 2 * split <= most:
            split *= 2
        for s in sorted({1, split, min(2 * split, most)}):
            config = SkinnyConfig(block_n=block_n, split_k=s, num_stages=stages)
            if fits(n, k, m, config):
                found.append(config)
    return found


def configs(n: int, k: int, m: int, sms: int) -> list[SkinnyConfig]:
    """This branch's `dense.candidates` and main's."""
    found = dense.candidates(n, k, m, sms)
    return found + [c for c in main_candidates(n, k, m, sms) if c not in found]


def shapes(models: list[str]) -> list[tuple[str, str, int, int, int]]:
    out = []
    for model in models:
        for what, n, k, count in step_linears(model):
            if what.startswith("moe:"):
                n = -(-n // 8) * 8
            out.append((model, what, n, k, count))
    return out


def _compile_jobs(models: list[str], rows: list[int], sms: int) -> list[tuple[int, int, int, SkinnyConfig]]:
    """One (n, k, m, config) per distinct compile (tile, split or not, TMA, the output stride's alignment)."""
    seen, jobs = set(), []
    for _, _, n, k, _ in shapes(models):
        if 2 * n * k > CUBLAS_ONLY_BYTES:
            continue
        for m in rows:
            for c in configs(n, k, m, sms):
                key = (block_rows(m), c.block_n, c.block_k, c.num_stages, c.num_warps, c.split_k > 1, c.tma,
                       n % 16 == 0, k % 16 == 0)
                if key not in seen:
                    seen.add(key)
                    jobs.append((n, k, m, c))
    return jobs


def _compile_one(job) -> str | None:
    n, k, m, c = job
    try:
        x = torch.zeros(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.zeros(n, k, device="cuda", dtype=torch.bfloat16)
        skinny_linear(x, w, None, c)
        torch.cuda.synchronize()
        return None
    except Exception as e:  # noqa: BLE001 (a variant that does not compile is reported, the sweep goes on)
        return f"{c.describe()} m={m} n={n} k={k}: {type(e).__name__}: {str(e)[:200]}"


def precompile(models: list[str], rows: list[int], workers: int, sms: int) -> list[str]:
    jobs = _compile_jobs(models, rows, sms)
    start = time.perf_counter()
    with mp.get_context("spawn").Pool(workers) as pool:
        errors = [e for e in pool.map(_compile_one, jobs, chunksize=1) if e]
    print(f"compiled {len(jobs)} variants in {time.perf_counter() - start:.1f} s with {workers} processes; "
          f"{len(errors)} failed", flush=True)
    for e in errors[:20]:
        print("  compile failed:", e, flush=True)
    return errors


def measure(model: str, what: str, n: int, k: int, count: int, rows: list[int], sms: int) -> dict:
    device = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator(device=device).manual_seed(0)
    size = 2 * n * k
    extra = min(63, -(-dense.COLD_BYTES // size) - 1)
    weights = [(torch.randn(n, k, generator=gen, device=device) * k**-0.5).to(torch.bfloat16)
               for _ in range(1 + extra)]
    zero = torch.zeros(n, device=device, dtype=torch.bfloat16)
    row = {"model": model, "what": what, "n": n, "k": k, "count": count, "rows": {}}
    for m in rows:
        x = torch.randn(m, k, generator=gen, device=device).to(torch.bfloat16)
        ref = F.linear(x.float(), weights[0].float())
        runs = {"cublas": lambda w, x=x: F.linear(x, w), "cublaslt bias0": lambda w, x=x: F.linear(x, w, zero)}
        if size <= CUBLAS_ONLY_BYTES:
            for c in configs(n, k, m, sms):
                runs[c.describe()] = lambda w, x=x, c=c: skinny_linear(x, w, None, c)
        times, errors, failed = {}, {}, {}
        for name, run in runs.items():
            try:
                out = run(weights[0]).float()
                errors[name] = ((out - ref).abs().max() / ref.abs().max()).item()
                times[name] = dense.replay_us(run, weights, device)
            except Exception as e:  # noqa: BLE001
                failed[name] = f"{type(e).__name__}: {str(e)[:120]}"
        main_pick = "cublas"
        main_skinny = {c.describe(): times[c.describe()] for c in main_candidates(n, k, m, sms)
                       if c.describe() in times}
        if main_skinny:
            best_main = min(main_skinny, key=main_skinny.get)
            if main_skinny[best_main] <= dense.MARGIN * times["cublas"]:
                main_pick = best_main
        best = min(times, key=times.get)
        row["rows"][m] = {"us": times, "err": errors, "failed": failed, "best": best, "main": main_pick}
        line(row, m)
    del weights
    torch.cuda.empty_cache()
    return row


def line(row: dict, m: int) -> None:
    r = row["rows"][m]
    t = r["us"]
    size = 2 * row["n"] * row["k"]
    best_of = lambda pre: min((v, nm) for nm, v in t.items() if nm.startswith(pre)) if any(  # noqa: E731
        nm.startswith(pre) for nm in t) else (float("nan"), "-")
    ptr, tma = best_of("skinny n"), best_of("skinny tma")
    rate = size / (t[r["best"]] * 1e-6) / 1e12
    print(f"| {row['model']} {row['what']} | {row['n']} x {row['k']} | {m} | {t['cublas']:.2f} | "
          f"{t.get('cublaslt bias0', float('nan')):.2f} | {t[r['main']]:.2f} | {ptr[0]:.2f} {ptr[1][7:]} | "
          f"{tma[0]:.2f} {tma[1][11:]} | **{t[r['best']]:.2f}** {rate:.2f} TB/s | "
          f"{r['err'].get(r['best'], float('nan')):.1e} | {len(r['failed'])} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", choices=list(MODELS), help="repeatable (default next-1b)")
    parser.add_argument("--rows", default="16,32,48,64")
    parser.add_argument("--workers", type=int, default=min(14, os.cpu_count() or 1))
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    models = args.model or ["next-1b"]
    rows = [int(r) for r in args.rows.split(",")]
    out_dir = Path(args.out or os.environ.get("OUT") or ".")
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "skinny_launch_sweep.json"
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    result = {"compile_errors": precompile(models, rows, args.workers, sms) if args.workers > 0 else [],
              "linears": []}
    print("| linear | N x K | rows | cuBLAS | cuBLASLt bias0 | main's choice | best pointer tile | best TMA tile | "
          "best, rate | err | failed |\n" + "| --- " * 11 + "|", flush=True)
    for model, what, n, k, count in shapes(models):
        result["linears"].append(measure(model, what, n, k, count, rows, sms))
        path.write_text(json.dumps(result, indent=1))
    for model in models:
        for m in rows:
            picked = {"cublas": 0.0, "main": 0.0, "best": 0.0, "floor": 0.0}
            for row in result["linears"]:
                if row["model"] == model and m in row["rows"]:
                    r = row["rows"][m]
                    picked["cublas"] += row["count"] * r["us"]["cublas"]
                    picked["main"] += row["count"] * r["us"][r["main"]]
                    picked["best"] += row["count"] * r["us"][r["best"]]
                    picked["floor"] += row["count"] * 2 * row["n"] * row["k"] / COPY_RATE * 1e6
            print(f"{model}, {m} rows, one step's dense GEMMs (us): cuBLAS {picked['cublas']:.0f}, main "
                  f"{picked['main']:.0f}, best {picked['best']:.0f}, floor {picked['floor']:.0f}", flush=True)
    path.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
