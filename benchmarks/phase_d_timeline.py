"""Where phase D's wall time goes: the device's busy and idle time over the whole phase, by step.

    PYTHONUNBUFFERED=1 PYTHONPATH=. python benchmarks/phase_d_timeline.py [--model next-16b] [--runs 2]
        [--mamba-ssm-cache-dtype auto] [--out DIR]

Builds `gpu_bench`'s engine for `--model` on random weights drawn on the GPU (`load_format="dummy"`: a folder
of config.json and the tokenizer, as `fp8_bench.py`), warms it up as gpu_bench does, then runs gpu_bench's phase D
(64 prompts of 1,024 tokens, 128 new tokens each, submitted together, stepped one `engine.step()` at a time)
`--runs` times untraced (their out tok/s and step lists), and once more under torch.profiler (device activity and
a range per `step()` call). From the traced run's kernels it computes the union of the device's busy intervals
and prints:
- the Triton kernels compiled (or loaded from the disk cache) after the engine's start-up, in the warm-up and in
  the phase's runs (`gpu_bench.CompileLog`: the engine means to compile none);
- the phase's wall time, the device's busy time and its idle time, before the first kernel, between kernels and
  after the last, and the traced run's wall against the untraced runs' (the profiler's own cost);
- per step call (its range on the host): the call's wall ms, the prefill tokens it postprocessed, and the device
  idle time that falls inside it; summed over prefill and decode calls;
- the longest idle gaps with the kernels on either side and the step call they fall in;
- for each call of `--kernels-of-calls` (default 4,5,6: the last full prefill, the short mixed step after it and
  the first decode step), the kernels that start inside it by device time (summed per name; a call's window holds
  the step it launches and the end of the one before, so compare calls with each other, not with a step's time).
A device that idles while the host plans, copies or samples shows here as idle time inside the calls; a phase
bound by its kernels shows almost none. Writes DIR/phase_d_timeline_<model>.json (DIR: --out, else $OUT, else .).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_bench  # noqa: E402
from fp8_bench import run_folder  # noqa: E402

from hybridcache import LLM  # noqa: E402


def busy_union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Merge [start, end) intervals (any order) into disjoint ones, sorted."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def idle_within(busy: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Time in [lo, hi) that no busy interval covers."""
    covered = sum(max(0.0, min(end, hi) - max(start, lo)) for start, end in busy if end > lo and start < hi)
    return (hi - lo) - covered


def traced_phase_d(llm: LLM, rng: random.Random) -> tuple[dict, list, list]:
    """Phase D under torch.profiler: (its result, the device kernels as (start, end, name) in us, the step calls
    as (start, end, prefill tokens postprocessed) in us)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, record_function

    engine = llm.engine
    calls: list[int] = []
    step = engine.step

    def marked() -> list:
        prefilled = engine.num_prefill_tokens
        with record_function(f"step_call_{len(calls)}"):
            out = step()
        calls.append(engine.num_prefill_tokens - prefilled)
        return out

    engine.step = marked
    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            result = gpu_bench.phase_d(llm, rng)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
    finally:
        del engine.step
    events = prof.events()
    # the device activity, less the `step_call_*` ranges the profiler also draws on the device's timeline (a range
    # spans a call's kernels and the gaps between them: counted as busy, it would hide those gaps)
    kernels = [(e.time_range.start, e.time_range.end, e.name) for e in events
               if e.device_type == DeviceType.CUDA and not e.name.startswith("step_call_")]
    ranges = {e.name: (e.time_range.start, e.time_range.end) for e in events
              if e.device_type == DeviceType.CPU and e.name.startswith("step_call_")}
    steps = [(*ranges[f"step_call_{i}"], tokens) for i, tokens in enumerate(calls) if f"step_call_{i}" in ranges]
    return result, kernels, steps


def analyse(kernels: list, steps: list, top: int = 15) -> dict:
    busy = busy_union([(start, end) for start, end, _ in kernels])
    first, last = steps[0][0], steps[-1][1]
    wall = last - first
    busy_us = sum(min(end, last) - max(start, first) for start, end in busy if end > first and start < last)
    per_step = [{"call": i, "prefill_tokens": tokens, "wall_ms": (end - start) / 1e3,
                 "idle_ms": idle_within(busy, start, end) / 1e3} for i, (start, end, tokens) in enumerate(steps)]
    ordered = sorted(kernels)
    gaps = []
    for (_, end_a, name_a), (start_b, _, name_b) in zip(ordered, ordered[1:]):
        if start_b > end_a and first <= end_a <= last:
            call = next((i for i, (s, e, _) in enumerate(steps) if s <= end_a < e), None)
            gaps.append({"us": start_b - end_a, "after": name_a[:60], "before": name_b[:60], "call": call})
    gaps.sort(key=lambda g: -g["us"])

    def total(rows: list[dict]) -> dict:
        return {"n": len(rows), "wall_ms": round(sum(r["wall_ms"] for r in rows), 2),
                "idle_ms": round(sum(r["idle_ms"] for r in rows), 2)}

    prefill = [r for r in per_step if r["prefill_tokens"]]
    decode = [r for r in per_step if not r["prefill_tokens"]]
    return {"wall_ms": wall / 1e3, "device_busy_ms": busy_us / 1e3, "device_idle_ms": (wall - busy_us) / 1e3,
            "kernels": len(kernels), "calls": len(steps),
            "prefill_calls": total(prefill), "decode_calls": total(decode),
            "per_step": per_step, "longest_gaps": gaps[:top]}


def kernels_in(kernels: list, lo: float, hi: float, top: int = 12) -> list[dict]:
    """The kernels that start in [lo, hi), summed by name: [{name, ms, n}], the `top` longest first."""
    by_name: dict[str, list[float]] = {}
    for start, end, name in kernels:
        if lo <= start < hi:
            by_name.setdefault(name[:70], []).append(end - start)
    rows = [{"name": name, "ms": round(sum(d) / 1e3, 3), "n": len(d)} for name, d in by_name.items()]
    return sorted(rows, key=lambda r: -r["ms"])[:top]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="next-16b", choices=[m for m in gpu_bench.MODELS if m != "tiny"])
    parser.add_argument("--runs", type=int, default=2, help="untraced phase D runs before the traced one")
    parser.add_argument("--mamba-ssm-cache-dtype", default="auto")
    parser.add_argument("--kernels-of-calls", default="4,5,6", help="calls whose kernels to list (comma-separated)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    out_dir = Path(args.out or os.environ.get("OUT") or ".")
    out_dir.mkdir(parents=True, exist_ok=True)
    folder, extra = run_folder(args.model, "bf16", Path(tempfile.mkdtemp()), dummy=True)
    llm = LLM(folder, dtype="bfloat16", device="cuda", block_size=64, max_num_seqs=64, max_num_batched_tokens=16384,
              mamba_ssm_cache_dtype=args.mamba_ssm_cache_dtype, **extra)
    compiles = gpu_bench.CompileLog()  # every Triton compile from here on is one the engine's start-up missed
    compiles.label = "warm-up"
    gpu_bench.warm_up(llm, random.Random(99))
    compiles.label = "phase D"
    rng = random.Random(0)
    result: dict = {"model": args.model, "device": torch.cuda.get_device_name(), "untraced": []}
    for _ in range(args.runs):
        run = gpu_bench.phase_d(llm, rng)
        result["untraced"].append({k: run[k] for k in ("output_tok_per_s", "total_s", "prefill_s", "prefill_steps",
                                                        "decode_steps", "decode_step_ms_p50", "steps_prefill_tokens_ms")
                                   if k in run})
        print(f"untraced: {run['output_tok_per_s']:.0f} out tok/s, prefill calls {run['prefill_steps']} "
              f"({run['prefill_s']:.3f} s), decode step p50 {run['decode_step_ms_p50']:.2f} ms; steps "
              f"{run['steps_prefill_tokens_ms'][:8]} ... {run['steps_prefill_tokens_ms'][-3:]}", flush=True)
    start = time.perf_counter()
    traced, kernels, steps = traced_phase_d(llm, rng)
    result["traced"] = {"output_tok_per_s": traced["output_tok_per_s"], "wall_s": time.perf_counter() - start,
                        **analyse(kernels, steps)}
    t = result["traced"]
    listed = {int(c): kernels_in(kernels, steps[int(c)][0], steps[int(c)][1], top=len(kernels))
              for c in args.kernels_of_calls.split(",") if c and int(c) < len(steps)}
    t["kernels_of_calls"] = {call: rows[:12] for call, rows in listed.items()}
    print(f"traced: {t['output_tok_per_s']:.0f} out tok/s; wall {t['wall_ms']:.1f} ms, device busy "
          f"{t['device_busy_ms']:.1f} ms, idle {t['device_idle_ms']:.1f} ms ({t['kernels']} kernels, {t['calls']} "
          f"step calls)")
    print(f"prefill calls: {t['prefill_calls']}; decode calls: {t['decode_calls']}")
    result["kernels_compiled"] = compiles.by_label
    print("Triton kernels compiled after start-up: "
          + (", ".join(f"{label} {len(names)}: {names}" for label, names in compiles.by_label.items()) or "none"))
    print("| call | prefill tokens | wall ms | device idle ms |\n| --- | --- | --- | --- |")
    for row in t["per_step"][:8] + t["per_step"][-4:]:
        print(f"| {row['call']} | {row['prefill_tokens']} | {row['wall_ms']:.2f} | {row['idle_ms']:.2f} |")
    print("| idle us | call | after | before |\n| --- | --- | --- | --- |")
    for gap in t["longest_gaps"]:
        print(f"| {gap['us']:.0f} | {gap['call']} | {gap['after']} | {gap['before']} |")
    for call, rows in listed.items():
        total = sum(r["ms"] for r in rows)
        print(f"| call {call}: kernels starting in it ({total:.2f} ms in all) | ms | launches |\n| --- | --- | --- |")
        for row in rows[:12]:
            print(f"| {row['name']} | {row['ms']:.3f} | {row['n']} |")
    path = out_dir / f"phase_d_timeline_{args.model}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
