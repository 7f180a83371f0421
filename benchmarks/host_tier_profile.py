"""Where a request that hits the host tier spends its milliseconds (issue 30): phase A of `gpu_bench.py` on a
small device pool with a host tier, then one more turn with every part of the step timed, then one request under
torch.profiler.

    PYTHONUNBUFFERED=1 PYTHONPATH=. python benchmarks/host_tier_profile.py [--model next-1b] [--num-blocks 1000]
        [--host-cache-gib 16] [--device cuda] [--out DIR]
    PYTHONPATH=. python benchmarks/host_tier_profile.py --device cpu --scale 0.05 --num-blocks 200 --host-cache-gib 0.05

1. Phase A's sessions (4 system prompts of 2,000 tokens, 16 sessions, 4 turns; `gpu_bench.phase_a`'s workload),
   each request timed: the p50 of turns 1-3 (most of their prefix comes back from the host) against turn 0's.
   Then phase CH's + 200 request with its 16,000-token prefix pushed to the host by three unrelated 16,000-token
   prompts (the pool of `--num-blocks 1000` holds three such prompts with their states, not four), against the
   cold prompt (recomputing it).
2. Turn 4 with each part of `LLMEngine.step` (schedule, build inputs, execute, sample, postprocess) and each copy
   kind inside execute (HOST_SAVE, HOST_LOAD, KV_RESTORE, ...; and the forward) timed with a device
   synchronisation around it (`step_profile.instrument`), so each row is that part's own cost (host + device).
3. Turn 5 of session 0 under torch.profiler (CUDA only; the synchronisations of step 2 still in place): the top
   operators by host and by device time.

Prints the tables; writes DIR/host_tier_profile_<model>.json (DIR: --out, else $OUT, else .).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_bench import MODELS, SCALE, letters, model_folder, timed, warm_up  # noqa: E402
from step_profile import instrument, print_operators, sync  # noqa: E402

from hybridcache import LLM  # noqa: E402


def time_copies(runner, times: dict[str, list[float]]) -> None:
    """Time each copy op by kind (and the forward) with a device synchronisation around it."""
    device = runner.device

    def wrap(name: str, key) -> None:
        inner = getattr(runner, name)

        def timed_call(*args, **kwargs):
            sync(device)
            start = time.perf_counter()
            result = inner(*args, **kwargs)
            sync(device)
            times.setdefault(key(*args), []).append(time.perf_counter() - start)
            return result

        setattr(runner, name, timed_call)

    wrap("_copy", lambda op: f"copy {op.kind.name}")
    wrap("_forward", lambda batch: "forward")


HOST_COUNTERS = ("num_host_hits", "num_host_hit_tokens", "num_promoted_checkpoints", "num_promoted_blocks",
                 "num_demoted_checkpoints", "num_demoted_blocks", "num_promotions_skipped", "num_host_dropped")


def host_counters(llm: LLM) -> dict[str, int]:
    stats = llm.engine.stats()["cache"]
    return {name: getattr(stats, name) for name in HOST_COUNTERS}


def phase_ch(llm: LLM, rng: random.Random, fillers: int = 3) -> dict:
    """A cold 16,000-token prompt, `fillers` unrelated ones, then the prompt + 200 tokens (module docstring)."""
    prompt = letters(rng, 16000)
    cold, _ = timed(llm, [prompt], 1)
    for _ in range(fillers):
        timed(llm, [letters(rng, 16000)], 1)
    before = host_counters(llm)
    warm, out = timed(llm, [prompt + letters(rng, 200)], 1)
    after = host_counters(llm)
    moved = {name: after[name] - before[name] for name in HOST_COUNTERS}
    result = {"cold_ms": 1000 * cold, "warm_ms": 1000 * warm, "warm_cached_tokens": out[0].cached_tokens,
              "warm_host": moved}
    print(f"CH: cold 16,000 {result['cold_ms']:.1f} ms; + 200 after {fillers} fillers {result['warm_ms']:.1f} ms, "
          f"cached {out[0].cached_tokens} (from the host: {moved['num_host_hit_tokens']} tokens, "
          f"{moved['num_promoted_blocks']} blocks and {moved['num_promoted_checkpoints']} checkpoints promoted)",
          flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="next-1b", choices=list(MODELS))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--num-blocks", type=int, default=1000)
    parser.add_argument("--host-cache-gib", type=float, default=16.0)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every prompt length (smoke tests)")
    parser.add_argument("--model-dir", default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    SCALE["value"] = args.scale
    device = torch.device(args.device)
    folder = model_folder(args.model, args.model_dir)
    start = time.perf_counter()
    llm = LLM(folder, dtype="bfloat16" if device.type == "cuda" else "float32", device=args.device, block_size=64,
              max_num_seqs=64, num_blocks=args.num_blocks, host_cache_gib=args.host_cache_gib,
              max_model_len=args.max_model_len)
    result: dict = {"model": args.model, "num_blocks": args.num_blocks, "host_cache_gib": args.host_cache_gib,
                    "engine_init_s": time.perf_counter() - start, "memory": llm.engine.memory_plan.describe()}
    print(f"engine start-up {result['engine_init_s']:.1f} s; {result['memory']}", flush=True)
    warm_up(llm, random.Random(99))

    rng = random.Random(0)
    systems = [letters(rng, 2000) for _ in range(4)]
    history = [systems[i % 4] for i in range(16)]
    times: dict[str, list[float]] = {}
    by_turn: list[list[float]] = []
    cached: list[list[int]] = []
    for turn in range(5):
        if turn == 4:
            result["ch"] = phase_ch(llm, rng)
            instrument(llm.engine, times)  # step 2: every part timed from here on
            time_copies(llm.engine.runner, times)
        latencies, hits = [], []
        for session in range(16):
            prompt = history[session] + letters(rng, rng.randint(200, 600))
            seconds, out = timed(llm, [prompt], 1)
            latencies.append(1000 * seconds)
            hits.append(out[0].cached_tokens)
            history[session] = prompt + letters(rng, rng.randint(100, 300))
        by_turn.append(latencies)
        cached.append(hits)
        print(f"turn {turn}: p50 {statistics.median(latencies):.1f} ms, cached tokens p50 "
              f"{statistics.median(hits):.0f}", flush=True)
    result["turn_p50_ms"] = [statistics.median(t) for t in by_turn]
    result["turn_latencies_ms"] = by_turn
    result["turn_cached_tokens"] = cached
    result["host"] = host_counters(llm)
    print(f"host tier: {result['host']}")
    parts = {key: (len(v), 1000 * sum(v) / 16, 1000 * statistics.median(v)) for key, v in times.items()}
    result["turn4_parts_ms"] = {key: {"calls": n, "per_request": per, "p50": p50} for key, (n, per, p50) in
                                parts.items()}
    print("\n| turn 4 part (synchronised) | calls | ms per request | p50 ms per call |\n| --- | --- | --- | --- |")
    for key, (n, per, p50) in sorted(parts.items(), key=lambda item: -item[1][1]):
        print(f"| {key} | {n} | {per:.2f} | {p50:.2f} |")
    sys.stdout.flush()
    if device.type == "cuda":  # step 3
        from torch.profiler import ProfilerActivity, profile

        prompt = history[0] + letters(rng, 400)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            seconds, out = timed(llm, [prompt], 1)
        print(f"\nturn 5, session 0 under torch.profiler: {1000 * seconds:.1f} ms, cached {out[0].cached_tokens}")
        print_operators(prof)
    out_dir = Path(args.out or os.environ.get("OUT") or ".")
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"host_tier_profile_{args.model}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
