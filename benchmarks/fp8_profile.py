"""Where an FP8 engine's milliseconds go against bf16's (issue 29), by kernel group: the decode step, a step
shaped like phase D's prefill and the small prefills of phase A.

    PYTHONUNBUFFERED=1 PYTHONPATH=. python benchmarks/fp8_profile.py [--runs next-16b:fp8,next-16b:bf16]
        [--parts decode,batch,small] [--out DIR]
    PYTHONPATH=. python benchmarks/fp8_profile.py --device cpu --runs tiny:fp8,tiny:bf16 --scale 0.05   # smoke

Runs are `fp8_bench.py`'s (MODEL:WEIGHTS[:KV], its kernel variants included; random weights drawn on the device);
one engine at a time, built with fp8_bench's options, then the parts (`profile_engine`; `fp8_bench.py --profile
PARTS` runs the same parts on its engines before their phases):

- decode: `--seqs` prompts of 1,024 tokens decoding together (graphs), the free-running step timed over 16 steps
  (p50), then 5 steps under torch.profiler (and the copy ops they ran, by kind and id count: `copies`); no
  sequence finishes before then (their finish saves would count as decode work), and all are aborted after;
- batch: one step of 16 fresh 1,024-token prompts (16,384 tokens: phase D's 64 prompts take four such steps),
  timed twice after a warm-up, then once profiled;
- small: a 2,000-token prefix cached, then the prefix + about 300, 600 and 1,000 new tokens (phase A's requests,
  one output token), each size timed three times (p50) and once profiled, every request a new token count as in
  phase A (n + 1, n + 2, ...), then one more at the last count (`repeat_ms`: a cost paid once per GEMM shape
  shows as the difference); the 600 one also under cProfile (the host's Python by function: the FP8 linears,
  cuBLAS's `_scaled_mm_v2`, the experts, Triton's launcher; the table in DIR/host_RUN.txt). Every profile's
  operator table (by device time) goes to DIR/kernels_RUN.txt.

Device time is grouped as docs/bench.md's decode table (`step_profile.GROUPS`: routed-expert GEMMs, other
GEMMs, the DeltaNet step kernel, attention, everything else) plus "FP8 activation quantisation" (the
`triton_quant` launches, a cost bf16 does not have). Per profile: wall ms, device ms and launches by family and
group (per step for decode). On the CPU the profiles have no device rows (a smoke test of the script).
Writes DIR/fp8_profile.json as figures come (DIR: --out, else $OUT, else .).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import random
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

from benchmarks import fp8_bench, gpu_bench
from hybridcache import LLM
from hybridcache.sampling import RequestOutputKind, SamplingParams

# kernel-name fragment -> family, tried before `step_profile.FAMILIES` (first match wins)
# (`swiglu_quantize_rows`: the row-wise experts' SwiGLU with h's quantisation; `with_shared`: the shared expert
# appended to every token's picks)
FP8_FAMILIES = (("_quantize_groups", "FP8 activation quantisation"),
                ("_swiglu_quantize_rows", "FP8 activation quantisation"), ("_with_shared", "MoE: routing"))
PARTS = ("decode", "batch", "small")
DECODE_STEPS, PROFILED_STEPS = 16, 5
SMALL_PREFIX, SMALL_SIZES, HOST_PROFILED = 2000, (300, 600, 1000), 600
# the host functions whose cumulative time `host_functions` reports: (function name, file fragment)
HOST_FUNCTIONS = (("fp8_linear", "backend.py"), ("linear", "torch._C._nn"), ("fp8_grouped_experts", ""),
                  ("grouped_experts", "grouped.py"), ("quantize_groups", ""), ("block_fp8_linear", ""),
                  ("scaled_mm", "functional.py"), ("_scaled_mm_v2", "torch"), ("_grouped_mm", "torch"),
                  ("fp8_expert_gemm", ""), ("run", "triton/runtime/jit.py"),
                  ("execute", "runner.py"), ("step", "engine.py"))


def _step_profile():
    """benchmarks/step_profile.py as a module (it imports gpu_bench by its own path)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import step_profile

    return step_profile


def kernel_groups(prof, steps: int = 1) -> dict:
    """{"families": {family: {"ms", "launches"}}, "groups": {group: ...}, "total": {...}} of a profile's device
    kernels, per step (totals / `steps`): families by `FP8_FAMILIES` then `step_profile.FAMILIES`, groups by
    `step_profile.GROUPS` (other families: "everything else"; the FP8 quantisation is its own group). Device
    events only (a CPU operator's device time is its kernels, counted as themselves)."""
    sp = _step_profile()
    families = {family: {"ms": ms / steps, "launches": count / steps}
                for family, (ms, count) in sp.device_families(prof, tuple(FP8_FAMILIES) + tuple(sp.FAMILIES)).items()}
    groups: dict[str, dict[str, float]] = {}
    for family, entry in families.items():
        group = family if family.startswith("FP8") else sp.GROUPS.get(family, "everything else")
        totals = groups.setdefault(group, {"ms": 0.0, "launches": 0.0})
        totals["ms"] += entry["ms"]
        totals["launches"] += entry["launches"]
    total = {"ms": sum(e["ms"] for e in families.values()), "launches": sum(e["launches"] for e in families.values())}
    order = lambda table: dict(sorted(table.items(), key=lambda item: -item[1]["ms"]))  # noqa: E731
    return {"families": order(families), "groups": order(groups), "total": total}


def print_groups(name: str, wall_ms: float, found: dict) -> None:
    print(f"{name}: wall {wall_ms:.2f} ms, device {found['total']['ms']:.3f} ms in "
          f"{found['total']['launches']:.0f} launches", flush=True)
    for group, entry in found["groups"].items():
        print(f"  | {group} | {entry['ms']:.3f} ms | {entry['launches']:.1f} |")


def _profiled(fn, cuda: bool, tables: list[str] | None = None, title: str = ""):
    """(fn's result, the torch.profiler profile of the call); with `tables`, the profile's operators by device
    time (CUDA) or host time are appended to it under `title`."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        out = fn()
    if tables is not None:
        order = "self_cuda_time_total" if cuda else "self_cpu_time_total"
        tables.append(f"{title}\n{prof.key_averages().table(sort_by=order, row_limit=40)}")
    return out, prof


def profile_decode(llm: LLM, rng: random.Random, seqs: int, prompt_len: int, tables: list[str] | None = None) -> dict:
    """`seqs` sequences of `prompt_len` tokens decoding together: the free-running step's p50 over DECODE_STEPS
    steps (after 4 untimed), then PROFILED_STEPS steps profiled (per-step groups)."""
    engine = llm.engine
    # no sequence finishes before the profiled steps end (a finish saves a checkpoint: not a decode step's work):
    # the staggered prefill takes at most `seqs` steps, and the first prompts decode during it
    params = SamplingParams(temperature=0, max_tokens=seqs + DECODE_STEPS + PROFILED_STEPS + 8, ignore_eos=True,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    request_ids = [f"fp8prof-{time.perf_counter_ns()}-{i}" for i in range(seqs)]
    for request_id in request_ids:
        engine.add_request(request_id, gpu_bench.letters(rng, prompt_len), params)
    while any(s.num_computed < s.prompt_len for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    for _ in range(4):
        engine.step()
    walls = []
    for _ in range(DECODE_STEPS):
        start = time.perf_counter()
        engine.step()
        walls.append(1000 * (time.perf_counter() - start))
    batch = len(engine.scheduler.running)
    copies: list[list[str]] = []  # the copy ops the profiled steps ran (`step_profile.log_copies`), per step

    def steps():
        unwrap = _step_profile().log_copies(engine.runner, copies)
        start = time.perf_counter()
        for _ in range(PROFILED_STEPS):
            copies.append([])
            engine.step()
        unwrap()
        return 1000 * (time.perf_counter() - start) / PROFILED_STEPS

    profiled_ms, prof = _profiled(steps, engine.device.type == "cuda", tables, f"decode, {PROFILED_STEPS} steps")
    for request_id in request_ids:
        engine.abort(request_id)
    while engine.has_unfinished_requests():
        engine.step()
    out = {"seqs": batch, "step_ms_p50": statistics.median(walls), "profiled_step_ms": profiled_ms,
           "copies": copies, **kernel_groups(prof, PROFILED_STEPS)}
    print_groups(f"decode step ({batch} sequences; free-running p50 {out['step_ms_p50']:.2f} ms)", profiled_ms, out)
    print(f"  copy ops of the profiled steps: {copies}", flush=True)
    return out


def generate_ms(llm: LLM, prompts: list[str]) -> float:
    """Wall ms of one `generate` of `prompts`, one output token each."""
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return 1000 * (time.perf_counter() - start)


def profile_batch_prefill(llm: LLM, rng: random.Random, count: int = 16, prompt_len: int = 1024,
                          tables: list[str] | None = None) -> dict:
    """One step of `count` fresh prompts of `prompt_len` tokens (phase D's prefill steps): a warm-up, two timed,
    one profiled."""
    batch = lambda: [gpu_bench.letters(rng, prompt_len) for _ in range(count)]  # noqa: E731
    generate_ms(llm, batch())
    timed = [generate_ms(llm, batch()) for _ in range(2)]
    prompts = batch()
    wall, prof = _profiled(lambda: generate_ms(llm, prompts), llm.engine.device.type == "cuda", tables,
                           f"prefill step {count} x {prompt_len}")
    out = {"prompts": count, "prompt_len": prompt_len, "timed_ms": timed, "profiled_ms": wall, **kernel_groups(prof)}
    print_groups(f"prefill step ({count} x {prompt_len}; timed {timed[0]:.1f}, {timed[1]:.1f} ms)", wall, out)
    return out


def host_functions(profiler: cProfile.Profile) -> dict[str, dict[str, float]]:
    """{name: {"calls", "cum_ms", "own_ms"}} of the `HOST_FUNCTIONS` in a cProfile run (summed over the
    functions of that name in files containing the fragment)."""
    found: dict[str, dict[str, float]] = {}
    for (filename, _line, function), (_cc, calls, own, cum, _callers) in pstats.Stats(profiler).stats.items():
        for name, fragment in HOST_FUNCTIONS:
            if (function == name or function.endswith(f".{name}>")) and fragment in filename + function:
                entry = found.setdefault(f"{name} ({fragment})" if fragment else name,
                                         {"calls": 0, "cum_ms": 0.0, "own_ms": 0.0})
                entry["calls"] += calls
                entry["cum_ms"] += 1000 * cum
                entry["own_ms"] += 1000 * own
    return found


def profile_small_prefills(llm: LLM, rng: random.Random, host_path: Path | None = None,
                           tables: list[str] | None = None) -> dict:
    """A SMALL_PREFIX-token prefix cached, then prefix + n new tokens for n in SMALL_SIZES: three timed (p50),
    one profiled; at HOST_PROFILED one more under cProfile (its table to `host_path`)."""
    prefix = gpu_bench.letters(rng, SMALL_PREFIX)
    generate_ms(llm, [prefix])
    cuda = llm.engine.device.type == "cuda"
    out: dict = {"prefix": SMALL_PREFIX}
    for size in SMALL_SIZES:
        # every request a new token count, as phase A's (a cost paid once per new GEMM shape shows in each), then
        # one more at the last count: `repeat_ms`
        timed = [generate_ms(llm, [prefix + gpu_bench.letters(rng, size + i)]) for i in (1, 2, 3)]
        prompt = prefix + gpu_bench.letters(rng, size + 4)
        wall, prof = _profiled(lambda prompt=prompt: generate_ms(llm, [prompt]), cuda, tables,
                               f"prefix {SMALL_PREFIX} + {size + 4}")
        entry = out[str(size)] = {"timed_ms": timed, "p50_ms": statistics.median(timed), "profiled_ms": wall,
                                  **kernel_groups(prof)}
        if size == HOST_PROFILED:
            host = cProfile.Profile()
            prompt = prefix + gpu_bench.letters(rng, size + 5)
            host.enable()
            entry["cprofiled_ms"] = generate_ms(llm, [prompt])
            host.disable()
            entry["host"] = host_functions(host)
            if host_path is not None:
                text = io.StringIO()
                for order in ("tottime", "cumulative"):
                    pstats.Stats(host, stream=text).sort_stats(order).print_stats(40)
                host_path.write_text(text.getvalue())
        entry["repeat_ms"] = generate_ms(llm, [prefix + gpu_bench.letters(rng, size + (5 if size == HOST_PROFILED
                                                                                         else 4))])
        print_groups(f"prefix {SMALL_PREFIX} + {size} (p50 {entry['p50_ms']:.1f} ms, same count again "
                     f"{entry['repeat_ms']:.1f} ms)", wall, entry)
        if "host" in entry:
            print(f"  host (cProfile, {entry['cprofiled_ms']:.1f} ms): {json.dumps(entry['host'])}", flush=True)
    return out


def profile_engine(llm: LLM, parts: list[str], result: dict, save, host_path: Path | None = None,
                   seqs: int = 64) -> dict:
    """Run `parts` (of PARTS) on an engine into `result["profile"]`, `save()`d after each; a part that fails
    records its error and the others still run. Forgets the cached prefixes afterwards. With `host_path`
    (DIR/host_RUN.txt), each profile's operator table goes beside it (DIR/kernels_RUN.txt)."""
    profile = result.setdefault("profile", {})
    rng = random.Random(5)
    tables: list[str] = []
    for part in parts:
        try:
            if part == "decode":
                profile[part] = profile_decode(llm, rng, seqs, 1024, tables)
            elif part == "batch":
                profile[part] = profile_batch_prefill(llm, rng, tables=tables)
            else:
                profile[part] = profile_small_prefills(llm, rng, host_path, tables)
        except Exception as error:  # a profile is a diagnostic: the run's other figures stand without it
            traceback.print_exc()
            profile[part] = {"error": repr(error)}
        save()
        if host_path is not None and tables:
            host_path.with_name(host_path.name.replace("host_", "kernels_", 1)).write_text("\n\n".join(tables))
    llm.engine.clear_cache()
    return profile


def parse_parts(text: str) -> list[str]:
    parts = [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in parts if p not in PARTS]
    if bad:
        raise ValueError(f"profile parts must be among {PARTS}, got {bad}")
    return parts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", default="next-16b:fp8,next-16b:bf16")
    parser.add_argument("--parts", default=",".join(PARTS))
    parser.add_argument("--seqs", type=int, default=64)
    parser.add_argument("--decode-kernels-from", default=None, help="a fp8_sweep.py JSON (fp8_bench's option)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every prompt length (smoke tests)")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    parts = parse_parts(args.parts)
    gpu_bench.SCALE["value"] = args.scale
    out_dir = Path(args.out or os.environ.get("OUT") or ".")
    out_dir.mkdir(parents=True, exist_ok=True)
    root = Path(out_dir / "folders")
    cuda = args.device == "cuda"
    options = dict(dtype="bfloat16" if cuda else "float32", device=args.device, block_size=64,
                   max_num_seqs=args.seqs, max_num_batched_tokens=16384)
    result: dict = {"device": torch.cuda.get_device_name() if cuda else args.device, "options": options, "runs": []}
    if args.decode_kernels_from:
        result["decode_kernels"] = fp8_bench.choose_decode_kernels(args.decode_kernels_from)

    def save() -> None:
        (out_dir / "fp8_profile.json").write_text(json.dumps(result, indent=1))

    for text in args.runs.split(","):
        model, weights, kv = (text.split(":") + ["auto"])[:3]
        run: dict = {"model": model, "weights": weights, "kv": kv}
        result["runs"].append(run)
        llm = None
        try:
            folder, extra = fp8_bench.run_folder(model, weights, root, dummy=True)
            with fp8_bench.kernel_variant(weights):  # the variant's kernel choices (fp8_bench.KERNEL_VARIANTS)
                start = time.perf_counter()
                llm = LLM(folder, **options, **extra, kv_cache_dtype=kv)
                run["engine_init_s"] = time.perf_counter() - start
                print(f"{text} up in {run['engine_init_s']:.1f} s", flush=True)
                profile_engine(llm, parts, run, save, out_dir / f"host_{model}_{weights}_{kv}.txt", args.seqs)
        except Exception as error:
            traceback.print_exc()
            run["error"] = repr(error)
        save()
        llm = None
        fp8_bench.release_engines(cuda)


if __name__ == "__main__":
    main()
