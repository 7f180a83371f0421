"""An engine's start-up on CUDA, the way a fresh machine meets it (issue 32): seconds to `LLM(...)`, Triton's
compiles in it by kernel, and the first request after it.

    PYTHONUNBUFFERED=1 PYTHONPATH=. python benchmarks/startup_bench.py --model next-1b [--empty-triton-cache]
        [--serial-compiles] [--out DIR]

One engine of `--model` (a `gpu_bench.MODELS` name) with dummy weights drawn on the GPU and gpu_bench's engine
options (bf16, blocks of 64, 64 sequences, 16,384 batched tokens). `--empty-triton-cache` points
`TRITON_CACHE_DIR` at a new empty folder first (a fresh machine); without it the environment's cache is used (a
restart that kept it). `--serial-compiles` starts the engine without `kernels/parallel_compile.parallel_compiles`
(an autotuned kernel's candidates compiled one by one, as before it), for an A/B in one tree: run each in a
process of its own, each on an empty cache. Prints and writes DIR/startup_bench_<model>[_serial].json (DIR:
--out, else $OUT, else .): the start-up seconds, Triton's compiles (`fp8_bench.CompileTimes`: kernels compiled
and loaded from disk, their compile seconds summed over threads, the top kernels), and a 3,000-token prompt's
first request (ms, and its 8 greedy tokens: the same in both modes, the weights being drawn from one seed), and
where the start-up's seconds went (`PHASES`: wall seconds inside each, summed over calls; they nest, e.g. the
skinny GEMM's `decide` runs inside the profiling forward's `_cuda_budget` and the graph captures).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

# (module, owner attribute or None, function): the start-up's phases timed (`timed`)
PHASES = (
    ("hybridcache.engine.rank_runner", None, "load_model"),
    ("hybridcache.engine.rank_runner", None, "_cuda_budget"),
    ("hybridcache.kernels.gemm.dense", None, "decide"),
    ("hybridcache.engine.runner", "ModelRunner", "_compile_on_pools"),
    ("hybridcache.engine.runner", "ModelRunner", "_compile_copies"),
    ("hybridcache.engine.runner", "ModelRunner", "_capture_prefill"),
    ("hybridcache.engine.runner", "ModelRunner", "_capture_sequence"),
    ("hybridcache.engine.runner", "ModelRunner", "_capture"),
)


def timed(phases: dict[str, float]) -> None:
    """Wrap each of `PHASES` (where it exists) to add its wall seconds per call to `phases[name]`."""
    for module_name, owner_name, name in PHASES:
        owner = importlib.import_module(module_name)
        owner = getattr(owner, owner_name) if owner_name else owner
        original = getattr(owner, name, None)
        if original is None:
            continue

        @functools.wraps(original)
        def wrapper(*args, _original=original, _name=name, **kwargs):
            start = time.perf_counter()
            try:
                return _original(*args, **kwargs)
            finally:
                phases[_name] = phases.get(_name, 0.0) + time.perf_counter() - start

        setattr(owner, name, wrapper)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="next-1b")
    parser.add_argument("--empty-triton-cache", action="store_true")
    parser.add_argument("--serial-compiles", action="store_true")
    parser.add_argument("--model-dir", default=None, help="the config folder (built there when missing)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.empty_triton_cache:  # before Triton is imported: it reads the folder from the environment
        os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton_cache_")
    sys.path[:0] = [str(Path(__file__).resolve().parent)]
    import torch
    from fp8_bench import CompileTimes
    from gpu_bench import MODELS, letters
    from tp_bench import config_folder

    from hybridcache import LLM
    from hybridcache.engine import rank_runner
    from hybridcache.sampling import SamplingParams

    if args.model not in MODELS:
        parser.error(f"--model {args.model!r}: one of {', '.join(MODELS)}")
    if args.serial_compiles:
        rank_runner.parallel_compiles = contextlib.nullcontext
    cache = os.environ.get("TRITON_CACHE_DIR", str(Path.home() / ".triton" / "cache"))
    folder = config_folder(args.model, args.model_dir)
    result: dict = {"model": args.model, "serial_compiles": args.serial_compiles, "triton_cache": cache,
                    "cache_entries_at_start": len(os.listdir(cache)) if os.path.isdir(cache) else 0}
    phases: dict[str, float] = {}
    timed(phases)
    start = time.perf_counter()
    with CompileTimes(top=15) as compiled:
        llm = LLM(folder, device="cuda", dtype="bfloat16", block_size=64, max_num_seqs=64,
                  max_num_batched_tokens=16384, load_format="dummy")
    result["startup_s"] = round(time.perf_counter() - start, 2)
    result["device"] = torch.cuda.get_device_name()
    result["compiles"] = compiled.summary()
    result["phases_s"] = {name: round(seconds, 2) for name, seconds in phases.items()}
    prompt = letters(random.Random(0), 3000)
    start = time.perf_counter()
    output = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0))[0]
    result["first_request_ms"] = round(1e3 * (time.perf_counter() - start), 1)
    result["first_request_tokens"] = list(output.outputs[0].token_ids)
    mode = "serial" if args.serial_compiles else "parallel"
    c = result["compiles"]
    print(f"{args.model} on {result['device']}, {mode} compiles, Triton cache of "
          f"{result['cache_entries_at_start']} entries at start: start-up {result['startup_s']:.1f} s; "
          f"{c.get('compiled')} kernels compiled ({c.get('s')} s of compile time summed over threads), "
          f"{c.get('disk_hits')} loaded from disk; first request {result['first_request_ms']:.0f} ms, "
          f"tokens {result['first_request_tokens']}", flush=True)
    print("  phases (s, nested): " + ", ".join(f"{name} {s}" for name, s in result["phases_s"].items()), flush=True)
    for name, entry in c.get("top", {}).items():
        print(f"  {name}: {entry}", flush=True)
    out = Path(args.out or os.environ.get("OUT") or ".")
    out.mkdir(parents=True, exist_ok=True)
    suffix = "_serial" if args.serial_compiles else ""
    (out / f"startup_bench_{args.model}{suffix}.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
