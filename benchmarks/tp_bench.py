"""Tensor parallelism against one device: the GPU benchmark's phases C and D with TP=1, then TP=2 (issue 15).

    PYTHONUNBUFFERED=1 PYTHONPATH=. python benchmarks/tp_bench.py [--model dense-9b] [--tp-sizes 1,2]
        [--phases C,D] [--tp1-graphs] [--out DIR]
    PYTHONPATH=. python benchmarks/tp_bench.py --device cpu --model tiny --scale 0.02   (a CPU smoke run)

The models, the warm-up and the phases are `benchmarks/gpu_bench.py`'s (C: latency of a cold 16,000-token
prompt, then of it + 200 tokens; D: 64 prompts of 1,024 tokens x 128 new tokens submitted together: output
tokens/s and the decode step time). One engine per TP size, one after the other in this process (rank 0 here,
ranks 1.. spawned on cuda:1..), each after the same warm-up, each phase with the same random prompts. Every run is
eager (no CUDA graphs: they are off under tensor parallelism, so TP=1 is eager too for a like-for-like
comparison); `--tp1-graphs` adds a TP=1 run with graphs. After the phases each run decodes 8 prompts x 32 greedy
tokens; "same tokens" counts the completions equal to the first run's (bf16 reductions differ across TP sizes, so
a random model's flat logits may diverge late; a sharding bug shows as ~0/8). Prints one table and writes
DIR/tp_bench_<model>.json (DIR: --out, else $OUT, else .).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import random
import sys
import time
from pathlib import Path

import torch
from gpu_bench import MODELS, SCALE, letters, model_folder, phase_c, phase_d, timed, warm_up

from hybridcache import LLM

PHASES = {"C": phase_c, "D": phase_d}


def run(folder: Path, options: dict, phases: list[str]) -> dict:
    """One engine with `options`: warm-up, then each phase; the engine is shut down after."""
    start = time.perf_counter()
    llm = LLM(folder, **options)
    result = {"options": {k: v for k, v in options.items() if k != "device"}, "init_s": time.perf_counter() - start,
              "memory": llm.engine.memory_plan.describe(), "cuda_graphs": list(llm.engine.runner.graph_batch_sizes),
              "phases": {}}
    try:
        warm_up(llm, random.Random(99))
        for phase in phases:
            result["phases"][phase] = PHASES[phase](llm, random.Random(0))
        rng = random.Random(1)  # a sanity check across runs: greedy tokens of 8 prompts (cache cleared first)
        llm.engine.clear_cache()
        _, outputs = timed(llm, [letters(rng, 500) for _ in range(8)], 32)
        result["check_tokens"] = [list(o.outputs[0].token_ids) for o in outputs]
    finally:
        shutdown = getattr(llm.engine.runner, "shutdown", None)
        if shutdown is not None:
            shutdown()
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return result


def row(name: str, r: dict) -> str:
    c, d = r["phases"].get("C"), r["phases"].get("D")
    cold, warm = (f"{c['latencies_ms'][0]:.0f}", f"{c['latencies_ms'][1]:.0f}") if c else ("-", "-")
    tok_s = f"{d['output_tok_per_s']:.0f}" if d else "-"
    step = f"{d['decode_step_ms_p50']:.2f}" if d and d.get("decode_step_ms_p50") else "-"
    prefill = f"{d['prefill_s']:.2f}" if d else "-"
    return (f"| {name} | {cold} | {warm} | {tok_s} | {step} | {prefill} | {r['init_s']:.0f} | {r['check_identical']} "
            f"| {r['memory']} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="dense-9b", choices=list(MODELS))
    parser.add_argument("--tp-sizes", default="1,2", help="comma-separated tensor_parallel_size values, run in order")
    parser.add_argument("--phases", default="C,D", help="comma-separated, of C and D")
    parser.add_argument("--tp1-graphs", action="store_true", help="also run TP=1 with CUDA graphs")
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    parser.add_argument("--gpu-memory-utilization", type=float, default=None)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every workload length (smoke tests)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--model-dir", default=None, help="reuse the model folder there, or build it there")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    phases = [p.strip().upper() for p in args.phases.split(",") if p.strip()]
    if set(phases) - set(PHASES):
        parser.error(f"unknown phases {sorted(set(phases) - set(PHASES))}; choose from C, D")
    sizes = [int(s) for s in args.tp_sizes.split(",") if s.strip()]
    SCALE["value"] = args.scale
    out_dir = Path(args.out or os.environ.get("OUT") or ".")
    start = time.perf_counter()
    folder = model_folder(args.model, args.model_dir)
    on_cuda = args.device.startswith("cuda")
    result: dict = {"model": args.model, "date": time.strftime("%Y-%m-%d"), "build_s": time.perf_counter() - start,
                    "device": torch.cuda.get_device_name() if on_cuda else args.device,
                    "devices": torch.cuda.device_count() if on_cuda else 1, "runs": {}}
    print(f"built {args.model} in {result['build_s']:.1f} s", flush=True)
    base = dict(dtype="bfloat16" if on_cuda else "float32", device=args.device, block_size=64, max_num_seqs=64,
                max_num_batched_tokens=args.max_num_batched_tokens, gpu_memory_utilization=args.gpu_memory_utilization)
    runs = [(f"TP={n}", {**base, "tensor_parallel_size": n, "enforce_eager": True}) for n in sizes]
    if args.tp1_graphs:
        runs.append(("TP=1 graphs", {**base, "tensor_parallel_size": 1, "enforce_eager": False}))
    for name, options in runs:
        print(f"--- {name}", flush=True)
        try:
            result["runs"][name] = run(folder, options, phases)
        except Exception as error:  # noqa: BLE001 (one failed run must not cost the others' figures)
            logging.exception("run %s failed", name)
            result.setdefault("errors", {})[name] = repr(error)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / f"tp_bench_{args.model}.json").write_text(json.dumps(result, indent=1))
    runs_done = list(result["runs"].values())
    for r in runs_done:  # how many of the 8 check completions equal the first run's
        pairs = list(zip(runs_done[0]["check_tokens"], r["check_tokens"]))
        r["check_identical"] = f"{sum(a == b for a, b in pairs)}/{len(pairs)}"
    (out_dir / f"tp_bench_{args.model}.json").write_text(json.dumps(result, indent=1))
    print(f"\n{args.model} on {result['device']} x {result['devices']}")
    print("| run | C cold ms | C +200 ms | D out tok/s | D decode step ms (p50) | D prefill s | init s | same tokens "
          "| memory |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, r in result["runs"].items():
        print(row(name, r))


if __name__ == "__main__":
    main()
