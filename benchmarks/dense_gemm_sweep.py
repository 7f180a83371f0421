"""The dense projections of a decode step: cuBLAS against the skinny Triton GEMM's tiles (issue 32).

    PYTHONPATH=. python benchmarks/dense_gemm_sweep.py [--model next-1b] [--model next-16b ...] [--out DIR]

For each dense linear of one decode step of a `gpu_bench.py` model (its shapes from the model's transformers config,
nothing built or loaded: DeltaNet in_proj (q|k|v|z|b|a, one GEMM) and out_proj, attention q|k|v and o_proj, a MoE
block's one GEMM of the shared expert's gate|up, the router and the shared-expert gate (zero rows up to a multiple
of 8, `layers/fused.padded_rows`, as the engine loads it), then the shared expert's down, a dense MLP's gate|up and
down, the lm_head), with a random bf16 weight: `kernels/gemm/dense.decide` (what the engine runs at start-up) times
cuBLAS and every candidate tile at 16, 32 and 64 rows (CUDA-graph replays, the weight rotated with copies beyond
L2), and the chosen kernel is checked against `F.linear` (max |diff| / max |ref|). Prints one table (device us per
GEMM, the weight read rate of the best, the choice), then the step's dense GEMM total at 64 rows (each shape times
its count per step) for cuBLAS, the choice and the floor (weight bytes at 4.3 TB/s, the H200's measured copy rate).
Writes DIR/dense_gemm_sweep.json (DIR: --out, else $OUT, else .). `--device cpu` only lists the shapes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_bench import MODELS, QWEN_MODELS  # noqa: E402

from hybridcache.kernels.gemm import dense  # noqa: E402
from hybridcache.layers.fused import padded_rows  # noqa: E402

COPY_RATE = 4.3e12  # bytes/s, the H200's measured device copy rate (docs/bench.md's floors)


def step_linears(name: str) -> list[tuple[str, int, int, int]]:
    """(what, N, K, count per decode step) of every dense linear of model `name` at tensor-parallel size 1."""
    import transformers

    config_class, _, fields = MODELS[name]
    c = getattr(transformers, config_class)(**fields)
    h, types = c.hidden_size, list(c.layer_types)
    delta, attn = types.count("linear_attention"), types.count("full_attention")
    key, value = c.linear_num_key_heads * c.linear_key_head_dim, c.linear_num_value_heads * c.linear_value_head_dim
    q = c.num_attention_heads * c.head_dim
    out = [("deltanet in_proj q|k|v|z|b|a", 2 * key + 2 * value + 2 * c.linear_num_value_heads, h, delta),
           ("deltanet out_proj", h, value, delta),
           ("attention q|k|v", 2 * q + 2 * c.num_key_value_heads * c.head_dim, h, attn),
           ("attention o_proj", h, q, attn)]
    layers = len(types)
    if getattr(c, "num_experts", 0):
        shared = c.shared_expert_intermediate_size
        out += [("moe: shared gate|up, router, gate", padded_rows(2 * shared + c.num_experts + 1), h, layers),
                ("shared expert down", h, shared, layers)]
    else:
        out += [("mlp gate|up", 2 * c.intermediate_size, h, layers), ("mlp down", h, c.intermediate_size, layers)]
    return out + [("lm_head", c.vocab_size, h, 1)]


def sweep(name: str, device: torch.device, result: dict, save) -> None:
    """Measure every dense linear of model `name` into `result` ({"model", "linears": []}), printing each row as it
    is measured and calling `save()` after each (a run cut short keeps what it measured)."""
    print(f"\n{name}: dense linears of one decode step (device us per GEMM, CUDA-graph replays)")
    print(f"{'linear':<30} {'N x K':>13} {'x/step':>6} {'rows':>4} {'cuBLAS':>8} {'skinny':>8} "
          f"{'best tile':<26} {'TB/s':>5} {'chosen':<14} {'err':>8}", flush=True)
    for what, n, k, count in step_linears(name):
        row = {"what": what, "n": n, "k": k, "count": count, "buckets": {}}
        result["linears"].append(row)
        if device.type == "cuda":
            weight = (torch.randn(n, k, device=device) * k**-0.5).to(torch.bfloat16)
            dense.decide(weight, False)
            for block_m in (16, 32, 64):
                choice = dense.choices()[(device, torch.bfloat16, n, k, False, block_m)]
                times = dict(choice.times_us)
                skinny = {key: t for key, t in times.items() if key.startswith("skinny")}
                best = min(skinny, key=skinny.get) if skinny else None
                x = torch.randn(block_m, k, device=device).to(torch.bfloat16)
                ref = F.linear(x.float(), weight.float())
                err = ((dense.linear(x, weight).float() - ref).abs().max() / ref.abs().max()).item()
                row["buckets"][block_m] = {
                    "cublas_us": times["cublas"], "best_skinny": best, "best_skinny_us": skinny.get(best),
                    "chosen": "cublas" if choice.config is None else choice.config.describe(),
                    "chosen_us": times["cublas" if choice.config is None else choice.config.describe()],
                    "all_us": times, "max_rel_err": err,
                }
            del weight
            torch.cuda.empty_cache()
        print_row(row)
        save()
    totals = {"cublas": 0.0, "chosen": 0.0, "floor": 0.0}
    for row in result["linears"]:
        totals["floor"] += row["count"] * 2 * row["n"] * row["k"] / COPY_RATE * 1e6
        if 64 in row["buckets"]:
            totals["cublas"] += row["count"] * row["buckets"][64]["cublas_us"]
            totals["chosen"] += row["count"] * row["buckets"][64]["chosen_us"]
    result["step_us_at_64_rows"] = totals
    print(f"one decode step's dense GEMMs at 64 rows: cuBLAS {totals['cublas']:.0f} us, chosen "
          f"{totals['chosen']:.0f} us, floor {totals['floor']:.0f} us (weights at {COPY_RATE / 1e12} TB/s)")


def print_row(row: dict) -> None:
    n, k, count = row["n"], row["k"], row["count"]
    if not row["buckets"]:
        print(f"{row['what']:<30} {f'{n} x {k}':>13} {count:>6}")
    for block_m, b in row["buckets"].items():
        rate = 2 * n * k / (b["chosen_us"] * 1e-6) / 1e12
        skinny_us = b["best_skinny_us"] if b["best_skinny_us"] is not None else float("nan")
        print(f"{row['what']:<30} {f'{n} x {k}':>13} {count:>6} {block_m:>4} {b['cublas_us']:>8.2f} "
              f"{skinny_us:>8.2f} {str(b['best_skinny']):<26} {rate:>5.2f} "
              f"{b['chosen'].split(' n')[0]:<14} {b['max_rel_err']:>8.1e}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", choices=QWEN_MODELS, help="repeatable (default next-1b)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    out_dir = Path(args.out or os.environ.get("OUT") or ".")
    out_dir.mkdir(parents=True, exist_ok=True)
    results: list[dict] = []
    path = out_dir / "dense_gemm_sweep.json"
    save = lambda: path.write_text(json.dumps(results, indent=1, default=str))  # noqa: E731
    for name in args.model or ["next-1b"]:
        results.append({"model": name, "linears": []})
        sweep(name, device, results[-1], save)
        save()
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
