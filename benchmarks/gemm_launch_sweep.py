"""The decode step's GEMM launches (issue 32): dense projections at 16-64 rows against cuBLAS; the routed experts.

    PYTHONPATH=. python benchmarks/gemm_launch_sweep.py [--model next-1b] [--model next-16b] [--rows 64,16,32,48]
        [--no-experts] [--no-main-candidates] [--workers 14]

Dense: for each dense linear of one decode step of a `gpu_bench.py` model (`dense_gemm_sweep.step_linears`: the MoE
block's input GEMM zero-padded to a multiple of 8 weight rows, as the engine loads it) and each row count: cuBLAS
(`F.linear`), cuBLASLt's bias epilogue (`F.linear` with a zero bias: another heuristic query), both also with x 16
bytes past a 256-byte boundary ("x+16B": cuBLAS picks kernels by the operands' alignment), and the skinny GEMM
(`kernels/gemm/triton_skinny.py`) over `dense.candidates` (the tiles of `dense.TILES`, each by pointer loads and by
TMA descriptors, unsplit and split-K) and main's candidates. Each launch is timed as `dense.replay_us` does (a CUDA
graph of 20 GEMMs over weight copies beyond L2, the median of 5 replays) and checked against `F.linear` in fp32 (max
|diff| / max |ref|). "main" is the launch main's `dense.decide` would choose (its two tiles, unsplit and split;
cuBLAS unless 5 % faster); per model and row count, one step's dense GEMMs (each shape's time x its count) by cuBLAS,
main's choice and the fastest launch, against the floor (the weights read at 4.3 TB/s).

Experts: the routed experts' gate/up (gather + SiLU gate) and down (scatter) GEMMs (`moe/triton_experts.expert_gemm`)
at next-1b's and next-16b's expert shapes, 64 tokens routed at random, by launch (`EXPERT_LAUNCHES`: swap-AB tiles)
against the engine's (`grouped.launch_tile`), the weights rotated over two copies; rate = every touched expert's
weights once / time; max |diff| / max |ref| against an fp32 torch reference.

Every variant is compiled first by `--workers` processes in parallel (the Triton cache is shared), so the timing
compiles nothing. Prints tables; writes DIR/gemm_launch_sweep.json (DIR: --out, else $OUT, else .).
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
from gpu_bench import QWEN_MODELS  # noqa: E402

from hybridcache.kernels.gemm import dense  # noqa: E402
from hybridcache.kernels.gemm.triton_skinny import SkinnyConfig, block_rows, fits, skinny_linear  # noqa: E402

CUBLAS_ONLY_BYTES = 256 << 20  # a weight this large (next-16b's lm_head) is timed on cuBLAS only
EXPERT_SHAPES = {"next-1b": (16, 4, 2048, 512), "next-16b": (32, 8, 4096, 1024)}  # (experts, top-k, hidden, width)
# swap-AB launches of the expert GEMM: (block_n, block_k, num_warps, num_stages)
EXPERT_LAUNCHES = ((64, 64, 4, 6), (64, 64, 4, 4), (64, 64, 4, 3), (128, 64, 4, 4), (128, 64, 4, 3),
                   (64, 128, 4, 4), (64, 128, 4, 3), (128, 128, 4, 2))
SEQS = 64


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


MAIN = {"on": True}  # --no-main-candidates: main's launches are not timed ("main" is then cuBLAS)


def configs(n: int, k: int, m: int, sms: int) -> list[SkinnyConfig]:
    """This branch's `dense.candidates` and main's."""
    found = dense.candidates(n, k, m, sms)
    return found + [c for c in main_candidates(n, k, m, sms) if c not in found and MAIN["on"]]


def shapes(models: list[str]) -> list[tuple[str, str, int, int, int]]:
    out = []
    for model in models:
        out += [(model, what, n, k, count) for what, n, k, count in step_linears(model)]
    return out


def _compile_jobs(models: list[str], rows: list[int], sms: int) -> list[tuple[int, int, int, SkinnyConfig]]:
    """One (n, k, m, config) per distinct compile (tile, split count, TMA, the strides' alignment)."""
    seen, jobs = set(), []
    for _, _, n, k, _ in shapes(models):
        if 2 * n * k > CUBLAS_ONLY_BYTES:
            continue
        for m in rows:
            for c in configs(n, k, m, sms):
                key = (block_rows(m), c.block_n, c.block_k, c.num_stages, c.num_warps, c.split_k, c.tma,
                       n % 16 == 0, k % 16 == 0)
                if key not in seen:
                    seen.add(key)
                    jobs.append((n, k, m, c))
    return jobs


def _compile_one(job) -> str | None:
    if job[0] == "experts":
        _, model, launch = job
        try:
            inputs = expert_inputs(model, copies=1)
            for second in (False, True):
                expert_run(inputs, second, launch)(0)
            torch.cuda.synchronize()
            return None
        except Exception as e:  # noqa: BLE001
            return f"experts {model} {launch}: {type(e).__name__}: {str(e)[:200]}"
    n, k, m, c = job
    try:
        x = torch.zeros(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.zeros(n, k, device="cuda", dtype=torch.bfloat16)
        skinny_linear(x, w, None, c)
        torch.cuda.synchronize()
        return None
    except Exception as e:  # noqa: BLE001 (a variant that does not compile is reported, the sweep goes on)
        return f"{c.describe()} m={m} n={n} k={k}: {type(e).__name__}: {str(e)[:200]}"


def expert_launches(model: str) -> list[dict]:
    """The engine's launch (`grouped.launch_tile` for each GEMM: None here, resolved per GEMM) then the grid."""
    found: list[dict | None] = [None]
    for block_n, block_k, warps, stages in EXPERT_LAUNCHES:
        found.append(dict(block_n=block_n, block_k=block_k, num_warps=warps, num_stages=stages, swap_ab=True))
    return found


def expert_inputs(model: str, copies: int = 2) -> dict:
    """Routed experts of `model`'s shape at SEQS tokens: x, order, counts, weights (copies), fp32 references."""
    from hybridcache.kernels.moe.grouped import sort_pairs_torch, tile_rows

    experts, top_k, hidden, width = EXPERT_SHAPES[model]
    gen = torch.Generator().manual_seed(0)
    ids = torch.rand(SEQS, experts, generator=gen).argsort(dim=-1)[:, :top_k].cuda()
    order, counts = sort_pairs_torch(ids, experts)
    x = (torch.randn(SEQS, hidden, generator=gen) * 0.5).cuda().to(torch.bfloat16)
    gate_up = [(torch.randn(experts, 2 * width, hidden, device="cuda") / hidden**0.5).to(torch.bfloat16)
               for _ in range(copies)]
    down = [(torch.randn(experts, hidden, width, device="cuda") / width**0.5).to(torch.bfloat16)
            for _ in range(copies)]
    expert_of = ids.reshape(-1)[order]
    h_ref = torch.empty(order.numel(), width, device="cuda")
    y_ref = torch.empty(order.numel(), hidden, device="cuda")
    h = torch.empty(order.numel(), width, device="cuda", dtype=torch.bfloat16)
    for e in range(experts):  # one expert at a time (a gathered [R, 2N, H] fp32 stack would take 17 GB)
        sel = (expert_of == e).nonzero().squeeze(1)
        g, u = (x[order[sel] // top_k].float() @ gate_up[0][e].float().T).chunk(2, dim=-1)
        h_ref[sel] = torch.nn.functional.silu(g) * u
        h[sel] = h_ref[sel].to(torch.bfloat16)
        y_ref[order[sel]] = h[sel].float() @ down[0][e].float().T
    return dict(ids=ids, order=order, counts=counts, x=x, h=h, gate_up=gate_up, down=down, h_ref=h_ref, y_ref=y_ref,
                top_k=top_k, block_m=tile_rows(order.numel(), experts), touched=int(torch.unique(ids).numel()),
                experts=experts, hidden=hidden, width=width)


def expert_run(inputs: dict, second: bool, launch: dict | None):
    """A callable i -> the gate/up (second False) or down GEMM on weight copy i, with `launch`'s settings (None:
    the engine's `launch_tile`)."""
    from hybridcache.kernels.moe.grouped import launch_tile
    from hybridcache.kernels.moe.triton_experts import expert_gemm

    weights = inputs["down" if second else "gate_up"]
    tile = launch if launch is not None else launch_tile(weights[0], inputs["block_m"])
    a = inputs["h" if second else "x"]

    def run(i: int) -> torch.Tensor:
        return expert_gemm(a, inputs["order"], inputs["top_k"], weights[i], inputs["counts"], gather=not second,
                           scatter=second, swiglu=not second, block_m=inputs["block_m"], **tile)
    return run


def sweep_experts(model: str) -> list[dict]:
    inputs = expert_inputs(model)
    device = torch.device("cuda", torch.cuda.current_device())
    rows = []
    for second, kind in ((False, "gate/up + SiLU gate"), (True, "down")):
        nbytes = inputs["touched"] * inputs["hidden"] * inputs["width"] * 2 * (1 if second else 2)
        ref = inputs["y_ref" if second else "h_ref"]
        for launch in expert_launches(model):
            name = "engine's" if launch is None else (
                f"{inputs['block_m']}x{launch['block_n']}x{launch['block_k']} w{launch['num_warps']} "
                f"st{launch['num_stages']}")
            run = expert_run(inputs, second, launch)
            try:
                out = run(0).float()
                err = float((out - ref).abs().max() / ref.abs().max())
                us = dense.replay_us(run, [0, 1], device)
                rows.append({"model": model, "gemm": kind, "launch": name, "us": us, "tb_s": nbytes / us / 1e6,
                             "err": err})
            except Exception as e:  # noqa: BLE001
                rows.append({"model": model, "gemm": kind, "launch": name, "failed": f"{type(e).__name__}: "
                             f"{str(e)[:120]}"})
        done = sorted((r for r in rows if r["gemm"] == kind and "us" in r), key=lambda r: r["us"])
        engine = next((r for r in done if r["launch"] == "engine's"), None)
        print(f"| {model} experts {kind} | engine's {engine['us'] if engine else float('nan'):.2f} us | " +
              "; ".join(f"{r['launch']} {r['us']:.2f} ({r['tb_s']:.2f} TB/s, {r['err']:.1e})" for r in done[:5]) +
              f" | {sum('failed' in r for r in rows if r['gemm'] == kind)} failed |", flush=True)
    return rows


def precompile(models: list[str], rows: list[int], workers: int, sms: int, experts: bool) -> list[str]:
    jobs = [("experts", model, launch) for model in models if experts and model in EXPERT_SHAPES
            for launch in expert_launches(model)]
    jobs += _compile_jobs(models, sorted({16, 32, 64} | set(rows)), sms)  # the engine's buckets too (`dense`)
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
        shifted = torch.empty(m * k + 8, device=device, dtype=torch.bfloat16)[8:].view(m, k)  # 16 B past 256 B
        shifted.copy_(x)
        runs = {"cublas": lambda w, x=x: F.linear(x, w), "cublaslt bias0": lambda w, x=x: F.linear(x, w, zero),
                "cublas x+16B": lambda w, x=shifted: F.linear(x, w),
                "cublaslt bias0 x+16B": lambda w, x=shifted: F.linear(x, w, zero)}
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
        best = min((name for name in times if not name.endswith("x+16B")), key=times.get)
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
    nan = float("nan")
    print(f"| {row['model']} {row['what']} | {row['n']} x {row['k']} | {m} | {t['cublas']:.2f} | "
          f"{t.get('cublaslt bias0', nan):.2f} | {t.get('cublas x+16B', nan):.2f} / "
          f"{t.get('cublaslt bias0 x+16B', nan):.2f} | {t[r['main']]:.2f} | {ptr[0]:.2f} {ptr[1][7:]} | "
          f"{tma[0]:.2f} {tma[1][11:]} | **{t[r['best']]:.2f}** {rate:.2f} TB/s | "
          f"{r['err'].get(r['best'], float('nan')):.1e} | {len(r['failed'])} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", choices=QWEN_MODELS, help="repeatable (default next-1b)")
    parser.add_argument("--rows", default="64,16,32,48", help="the first is measured on every shape before the others")
    parser.add_argument("--workers", type=int, default=min(14, os.cpu_count() or 1))
    parser.add_argument("--no-experts", dest="experts", action="store_false")
    parser.add_argument("--no-main-candidates", dest="main_candidates", action="store_false")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    models = args.model or ["next-1b"]
    MAIN["on"] = args.main_candidates
    rows = [int(r) for r in args.rows.split(",")]
    out_dir = Path(args.out or os.environ.get("OUT") or ".")
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "gemm_launch_sweep.json"
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    result = {"compile_errors": precompile(models, rows, args.workers, sms, args.experts) if args.workers > 0
              else [], "linears": [], "experts": []}
    print("| linear | N x K | rows | cuBLAS | cuBLASLt bias0 | both, x+16B | main's choice | best pointer tile | "
          "best TMA tile | best, rate | err | failed |\n" + "| --- " * 12 + "|", flush=True)
    linears = {}
    for group in ([rows[0]], rows[1:]):  # every shape at the first row count first (a run cut short keeps those)
        for model, what, n, k, count in shapes(models):
            if group:
                row = measure(model, what, n, k, count, group, sms)
                if (model, what) in linears:
                    linears[(model, what)]["rows"].update(row["rows"])
                else:
                    linears[(model, what)] = row
                    result["linears"].append(row)
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
    if args.experts:
        for model in models:
            if model in EXPERT_SHAPES:
                result["experts"] += sweep_experts(model)
                path.write_text(json.dumps(result, indent=1))



if __name__ == "__main__":
    main()
