"""Where the milliseconds of gpu_bench's + 200 request go (phase C's second request, issue 32).

    PYTHONUNBUFFERED=1 PYTHONPATH=. python benchmarks/prefill_profile.py [--model next-1b] [--model-dir DIR]
        [--device cuda] [--prefix 16000] [--new 200] [--runs 5] [--phase-a] [--ab] [--check-graphs] [--quick]
        [--label NAME] [--out DIR] [--load-format auto|dummy]

The request: a cold `--prefix`-token prompt, then the same prompt + `--new` tokens through `LLM.generate` (one
new token): it hits the checkpoint at the prefix's end and prefills `--new` tokens over the whole context. After a
warm-up (two such pairs at the full length: every kernel shape and graph bucket the request meets), `--runs`
fresh pairs are measured, each + 200 request three ways:

1. **free**: its wall time, as gpu_bench's phase C sees it, and the wall time of each host part with no
   synchronisation added (`PartTimer`: tokenising, `add_request`, the scheduler's step (prefix match, planning, the
   cache's commit), building the step's inputs, the runner's forward (copies, graph replays and eager cores:
   what the host spends queueing them), sampling, postprocessing (waiting for the token, detokenising, the
   output)). Parts nest ("schedule: ...", "forward: ..." and "postprocess: ..." are inside their top-level part;
   "forward: layers" is the piecewise graphs' replays and the eager cores between them); "unaccounted" is the
   wall time outside every top-level part (`generate`'s own loop). "postprocess: wait for the token" is how far
   the device was behind the host when the host asked for the token: near 0 when the request is host-bound;
2. **synced**: the same parts each ending on a device synchronisation (its own host + device cost), one pair;
3. **torch.profiler** (CUDA): device time by kernel family (`step_profile.device_families`), kernels launched,
   CUDA runtime calls (launches, graph launches, synchronisations, copies) and their host time, one pair;
4. **cProfile**: the host's Python functions by own time, one pair.

The cycle collector's runs (count and ms by generation, `gc.callbacks`) are counted over the free-running requests,
and every Triton compile after the engine's start-up is logged (gpu_bench's `CompileLog`: by part, in the JSON).
`--phase-a`: then gpu_bench's phase A on the same engine (its p50 and the collector's runs; the cache cleared
first), so that one engine start-up gives both of issue 32's small-prefill figures. `--ab`: the free-running runs
and phase A also on main's path before issue 32's gpu7p work (`main_path`: no whole-step graphs of one-sequence
steps, piecewise buckets up to 1,024 tokens, the attention prefill unsplit), in the same process: this tree's path,
main's, this tree's again. `--check-graphs`: gpu_bench's prefill graph check on this engine. `--quick`: no synced
run, no cProfile.

Runs against any tree with the same `LLM` API (main's, for a same-call before). Prints tables; writes
DIR/prefill_profile_<model>.json (DIR: --out, else $OUT, else .).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import io
import json
import os
import pstats
import random
import statistics
import string
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_bench import MODELS, SCALE, CompileLog, letters, model_folder  # noqa: E402

import hybridcache.engine.engine as engine_module  # noqa: E402
from hybridcache import LLM  # noqa: E402
from hybridcache.sampling import PendingSample, SamplingParams  # noqa: E402

ONE_TOKEN = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
TOP = ("tokenise", "add_request", "schedule", "build inputs", "forward", "sample", "postprocess")


class GcPauses:
    """The cycle collector's runs while installed (`gc.callbacks`): count and ms by generation."""

    def __init__(self) -> None:
        self.runs: dict[int, list[float]] = {}
        self._start = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.runs.setdefault(info["generation"], []).append(1000 * (time.perf_counter() - self._start))

    def __enter__(self) -> GcPauses:
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc_info: object) -> None:
        gc.callbacks.remove(self)

    def summary(self) -> dict[str, dict[str, float]]:
        return {f"gen{gen}": {"runs": len(ms), "ms": sum(ms), "max_ms": max(ms)}
                for gen, ms in sorted(self.runs.items())}


class PartTimer:
    """Wall time of named host parts, by monkeypatching the callables that do them (`install`); `sync` adds a
    device synchronisation before and after each (its own cost, device included)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.sync = False
        self.times: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._undo: list[Callable[[], None]] = []

    def wrap(self, owner: object, name: str, key: str) -> None:
        inner = getattr(owner, name, None)
        if inner is None:  # a tree without this part
            return
        timer = self

        def timed(*args, **kwargs):
            if timer.sync and timer.device.type == "cuda":
                torch.cuda.synchronize(timer.device)
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                if timer.sync and timer.device.type == "cuda":
                    torch.cuda.synchronize(timer.device)
                timer.times[key] = timer.times.get(key, 0.0) + time.perf_counter() - start
                timer.calls[key] = timer.calls.get(key, 0) + 1

        had = name in vars(owner) if not isinstance(owner, type) else None
        setattr(owner, name, timed)
        self._undo.append(lambda: delattr(owner, name) if had is False else setattr(owner, name, inner))

    def install(self, llm: LLM) -> None:
        engine = llm.engine
        runner = engine.runner
        self.wrap(engine.tokenizer, "encode", "tokenise")
        self.wrap(engine, "add_request", "add_request")
        self.wrap(engine.scheduler, "schedule", "schedule")
        self.wrap(engine.scheduler.cache, "match", "schedule: prefix match")
        self.wrap(engine.scheduler.cache, "commit_step", "schedule: cache commit")
        self.wrap(engine_module, "build_forward_batch", "build inputs")
        self.wrap(runner, "execute", "forward")
        self.wrap(runner, "_copy", "forward: restore/save copies")
        self.wrap(runner.backend, "prepare", "forward: backend prepare")
        prefill = getattr(runner, "_prefill", None)
        if prefill is not None:
            self.wrap(prefill, "run", "forward: layers (replays + eager cores)")
            whole = getattr(prefill, "sequence", None)
            if whole is not None:
                self.wrap(whole, "load", "forward: load (whole-step graph)")
                self.wrap(whole, "run", "forward: layers (whole-step graph)")
        self.wrap(runner.model, "forward_tail", "forward: tail (norm, logits)")
        self.wrap(engine, "_sample", "sample")
        self.wrap(engine, "_complete", "postprocess")
        self.wrap(PendingSample, "result", "postprocess: wait for the token")  # the device's lag behind the host
        self.wrap(engine.output_processor, "accept", "postprocess: detokenise + stop checks")
        self.wrap(engine.output_processor, "output", "postprocess: output")

    def uninstall(self) -> None:
        while self._undo:
            self._undo.pop()()

    def reset(self) -> None:
        self.times, self.calls = {}, {}


def host_probe(llm: LLM) -> dict:
    """How fast this process's host runs, apart from the engine: a fixed pure-Python loop and the tokeniser on a
    fixed 16,200-letter text (medians of 5, ms), the load average and the CPUs' mean clock (MHz, /proc/cpuinfo).
    Taken after start-up and at the end, so that a slow process (the first on a fresh machine) shows whether the
    host itself or the engine's code is slow."""
    def median_ms(fn) -> float:
        times = []
        for _ in range(5):
            start = time.perf_counter()
            fn()
            times.append(1000 * (time.perf_counter() - start))
        return statistics.median(times)

    text = "".join(random.Random(7).choices(string.ascii_lowercase, k=16_200))  # (not `letters`: no --scale)
    mhz = []
    with contextlib.suppress(OSError):
        mhz = [float(line.split(":")[1]) for line in Path("/proc/cpuinfo").read_text().splitlines()
               if line.startswith("cpu MHz")]
    saved = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # (read by tokenizers at each call)
    serial = median_ms(lambda: llm.engine.tokenizer.encode(text))
    if saved is None:
        del os.environ["TOKENIZERS_PARALLELISM"]
    else:
        os.environ["TOKENIZERS_PARALLELISM"] = saved
    return {"python_loop_ms": median_ms(lambda: sum(i * i for i in range(200_000))),
            "tokenise_16200_ms": median_ms(lambda: llm.engine.tokenizer.encode(text)),
            "tokenise_16200_no_parallelism_ms": serial,
            "loadavg": list(os.getloadavg()), "cpu_mhz_mean": statistics.fmean(mhz) if mhz else None}


def generate_ms(llm: LLM, prompt: str, cached: list[int] | None = None) -> float:
    """Wall ms of `LLM.generate` of one prompt, one new token; its cached tokens appended to `cached` if given."""
    start = time.perf_counter()
    outputs = llm.generate([prompt], ONE_TOKEN, use_tqdm=False)
    ms = 1000 * (time.perf_counter() - start)
    if cached is not None:
        cached.append(outputs[0].num_cached_tokens)
    return ms


def pair(llm: LLM, rng: random.Random, prefix: int, new: int) -> tuple[str, str]:
    """A fresh (cold prompt, prompt + new) pair; the cold one is sent here."""
    prompt = letters(rng, prefix)
    generate_ms(llm, prompt)
    return prompt, prompt + letters(rng, new)


def timed_parts(llm: LLM, timer: PartTimer, rng: random.Random, args, runs: int, sync: bool) -> dict:
    """`runs` fresh pairs; the + 200 request's wall ms and its parts' ms (medians over the runs)."""
    walls, parts, pauses, cached = [], [], GcPauses(), []
    for _ in range(runs):
        _, longer = pair(llm, rng, args.prefix, args.new)
        timer.reset()
        timer.sync = sync
        with pauses:
            walls.append(generate_ms(llm, longer, cached))
        timer.sync = False
        parts.append({key: 1000 * t for key, t in timer.times.items()} | {
            f"calls: {key}": n for key, n in timer.calls.items()})
        parts[-1]["unaccounted"] = walls[-1] - sum(parts[-1].get(k, 0.0) for k in TOP)
    keys = list(dict.fromkeys(k for p in parts for k in p))
    return {"wall_ms": walls, "wall_ms_p50": statistics.median(walls), "gc": pauses.summary(), "cached": cached,
            "parts_ms_p50": {k: statistics.median(p.get(k, 0.0) for p in parts) for k in keys}}


def print_parts(name: str, result: dict) -> None:
    print(f"\n{name}: + {result['new']} wall ms {', '.join(f'{w:.1f}' for w in result['wall_ms'])} "
          f"(p50 {result['wall_ms_p50']:.1f}), cached tokens {result['cached']}")
    print("| part | ms (p50 over the runs) | calls |\n| --- | --- | --- |")
    parts = result["parts_ms_p50"]
    for key, ms in parts.items():
        if not key.startswith("calls: "):
            print(f"| {key} | {ms:.2f} | {parts.get('calls: ' + key, 0):.0f} |")
    print(f"cycle collector during these requests: {result['gc'] or 'none'}")


# kernel families of a prefill step that step_profile's FAMILIES (decode) files under "other"; first match wins
PREFILL_FAMILIES = (("_prefill_kernel", "attention prefill"), ("_prefill_split_kernel", "attention prefill"),
                    ("_qkv_prep", "DeltaNet q/k/v prep"),
                    ("l2norm", "DeltaNet q/k/v prep"))

RUNTIME = {  # CUDA runtime / driver call name fragment -> kind (host-side counts of the profile)
    "cudaLaunchKernel": "kernel launches (CUDA runtime)", "cuLaunchKernel": "kernel launches (driver: Triton)",
    "cudaGraphLaunch": "graph launches", "Synchronize": "synchronisations", "cudaMemcpy": "copies (memcpy)",
    "cudaMemset": "memsets", "cudaLaunchCooperativeKernel": "kernel launches (CUDA runtime)",
}


def device_profile(llm: LLM, rng: random.Random, args) -> dict:
    """One + 200 request under torch.profiler: device ms and kernels by family, runtime calls by kind."""
    from step_profile import FAMILIES, device_families
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    _, longer = pair(llm, rng, args.prefix, args.new)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        wall = generate_ms(llm, longer)
    averages = prof.key_averages()
    families = device_families(prof, PREFILL_FAMILIES + FAMILIES)
    runtime: dict[str, list[float]] = {}
    for event in averages:
        if event.device_type != DeviceType.CPU:
            continue
        kind = next((k for fragment, k in RUNTIME.items() if fragment in event.key), None)
        if kind is not None:
            count, us = runtime.get(kind, [0, 0.0])
            runtime[kind] = [count + event.count, us + event.self_cpu_time_total]
    print(f"\n+ {args.new} under torch.profiler: {wall:.1f} ms (the profiler's own cost included)")
    print(averages.table(sort_by="self_cpu_time_total", row_limit=20))
    print(averages.table(sort_by="self_cuda_time_total", row_limit=25))
    print("| kernel family | device ms | kernels |\n| --- | --- | --- |")
    for family, (ms, count) in families.items():
        print(f"| {family} | {ms:.3f} | {count} |")
    total_ms = sum(ms for ms, _ in families.values())
    print(f"| total | {total_ms:.3f} | {sum(c for _, c in families.values())} |")
    print("| runtime call | calls | host ms |\n| --- | --- | --- |")
    for kind, (count, us) in sorted(runtime.items()):
        print(f"| {kind} | {count} | {us / 1000:.2f} |")
    return {"wall_ms": wall, "device_ms": total_ms,
            "families": {f: {"ms": ms, "kernels": c} for f, (ms, c) in families.items()},
            "runtime": {k: {"calls": c, "host_ms": us / 1000} for k, (c, us) in runtime.items()}}


def host_profile(llm: LLM, rng: random.Random, args, rows: int = 35) -> dict:
    """One + 200 request under cProfile: the top functions by own time and by cumulative time."""
    _, longer = pair(llm, rng, args.prefix, args.new)
    profiler = cProfile.Profile()
    profiler.enable()
    wall = generate_ms(llm, longer)
    profiler.disable()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(rows)
    stats.sort_stats("cumulative").print_stats(rows)
    print(f"\n+ {args.new} under cProfile: {wall:.1f} ms (cProfile's own cost included)\n{text.getvalue()}")
    return {"wall_ms": wall, "functions": stats.total_calls}


@contextlib.contextmanager
def timer_installed(llm: LLM, timer: PartTimer) -> Iterator[None]:
    timer.install(llm)
    try:
        yield
    finally:
        timer.uninstall()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="next-1b", choices=list(MODELS))
    parser.add_argument("--model-dir", default=None, help="reuse the model folder there, or build it there")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--prefix", type=int, default=16000)
    parser.add_argument("--new", type=int, default=200)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--label", default="", help="a name for this tree in the output (e.g. main)")
    parser.add_argument("--load-format", default="auto", choices=("auto", "dummy"),
                        help="dummy: a folder of config.json + tokenizer, random weights drawn on the device (next-16b "
                             "without writing 33 GB)")
    parser.add_argument("--phase-a", action="store_true", help="then gpu_bench's phase A on the same engine")
    parser.add_argument("--ab", action="store_true",
                        help="also the free-running runs and phase A on main's path (`main_path`: no whole-step "
                             "graphs, pieces up to 1,024 tokens, unsplit attention), one process: this, main's, this")
    parser.add_argument("--check-graphs", action="store_true",
                        help="gpu_bench's prefill graph check on this engine (replay against without_replay, eager, "
                             "and the pieces for one-sequence steps)")
    parser.add_argument("--quick", action="store_true", help="skip the synced run and cProfile")
    parser.add_argument("--scale", type=float, default=1.0,
                        help="multiply every length (the pair's and phase A's, as gpu_bench's --scale): smoke tests")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    SCALE["value"] = args.scale
    device = torch.device(args.device)
    start = time.perf_counter()
    dummy = {"load_format": "dummy"} if args.load_format == "dummy" else {}
    if dummy:
        from tp_bench import config_folder

        folder = config_folder(args.model, args.model_dir)
    else:
        folder = model_folder(args.model, args.model_dir)
    llm = LLM(folder, dtype="bfloat16" if device.type == "cuda" else "float32", device=args.device, block_size=64,
              max_num_seqs=64, max_num_batched_tokens=16384, max_model_len=max(17000, args.prefix + args.new + 64),
              **dummy)
    result: dict = {"model": args.model, "label": args.label, "prefix": args.prefix, "new": args.new,
                    "engine_s": time.perf_counter() - start,
                    "device": torch.cuda.get_device_name() if device.type == "cuda" else args.device,
                    "prefill_graphs": list(getattr(llm.engine.runner, "prefill_graph_sizes", ())),
                    "whole_step_graphs": sorted(getattr(whole_graphs(llm), "graphs", ()))}
    print(f"{args.model} {args.label}: engine in {result['engine_s']:.1f} s, prefill graphs "
          f"{result['prefill_graphs']}, whole-step graphs {result['whole_step_graphs']}", flush=True)
    out_dir = Path(args.out or os.environ.get("OUT") or ".")
    out_dir.mkdir(parents=True, exist_ok=True)
    out_path = out_dir / f"prefill_profile_{args.model}{'_' + args.label if args.label else ''}.json"
    rng = random.Random(0)
    compiles = CompileLog()  # every Triton compile after the engine's start-up, by part of this script
    compiles.label = "warm-up"
    for _ in range(2):  # warm-up: every shape of the request at its full length
        _, longer = pair(llm, rng, args.prefix, args.new)
        generate_ms(llm, longer)
    compiles.label = "profile"
    result["host_probe_start"] = host_probe(llm)
    print(f"host probe after start-up: {result['host_probe_start']}", flush=True)
    timer = PartTimer(device)
    ab = args.ab and whole_graphs(llm) is not None

    def save() -> None:  # (after each part: a run cut by a time limit keeps what it measured)
        result["kernels_compiled"] = compiles.by_label
        out_path.write_text(json.dumps(result, indent=1))

    # in the order of what a cut run should keep: the A/B of the request, of phase A, the graph check, repeats
    with timer_installed(llm, timer):
        result["free"] = timed_parts(llm, timer, rng, args, args.runs, sync=False) | {"new": args.new}
        print_parts("free-running", result["free"])
        save()
        if ab:
            with main_path(llm):
                result["free_before"] = timed_parts(llm, timer, rng, args, args.runs, sync=False) | {"new": args.new}
            print_parts("free-running, main's path (pieces up to 1,024 tokens, unsplit attention)",
                        result["free_before"])
            save()
    if args.phase_a:
        compiles.label = "phase A"
        result["phase_a"] = phase_a_timed(llm)
        save()
        if ab:
            with main_path(llm):
                result["phase_a_before"] = phase_a_timed(llm, "main's path")
            save()
    if args.check_graphs:
        from gpu_bench import check_prefill_graphs

        compiles.label = "graph check"
        result["graph_check"] = check_prefill_graphs(llm)
        print(f"prefill graph check: {result['graph_check']}", flush=True)
        save()
    if ab:
        compiles.label = "profile"
        with timer_installed(llm, timer):
            result["free_again"] = timed_parts(llm, timer, rng, args, args.runs, sync=False) | {"new": args.new}
        print_parts("free-running, this tree's path again", result["free_again"])
        save()
        if args.phase_a:
            compiles.label = "phase A"
            result["phase_a_again"] = phase_a_timed(llm, "this tree's path again")
            save()
    compiles.label = "profile"
    if device.type == "cuda":
        result["profiler"] = device_profile(llm, rng, args)
        save()
    if not args.quick:
        with timer_installed(llm, timer):
            result["synced"] = timed_parts(llm, timer, rng, args, 1, sync=True) | {"new": args.new}
            print_parts("each part synced", result["synced"])
        result["cprofile"] = host_profile(llm, rng, args)
        save()
    result["host_probe_end"] = host_probe(llm)
    print(f"host probe at the end: {result['host_probe_end']}", flush=True)
    result["kernels_compiled"] = compiles.by_label
    print(f"Triton compiles after start-up: {({k: len(v) for k, v in compiles.by_label.items()}) or 'none'}")
    save()


def whole_graphs(llm: LLM):
    """The runner's whole-step graphs of one-sequence steps (`prefill_graphs.SequenceGraphs`), or None (eager, or
    a tree without them)."""
    return getattr(getattr(llm.engine.runner, "_prefill", None), "sequence", None)


@contextlib.contextmanager
def main_path(llm: LLM) -> Iterator[None]:
    """Within the block, main's path before this tree's work (issue 32, gpu7p): no whole-step graphs (one-sequence
    steps piecewise), piecewise buckets up to 1,024 tokens (longer steps eager) and the attention prefill unsplit."""
    from gpu_bench import sequence_graphs_off

    from hybridcache.kernels.attention import triton_paged

    prefill = llm.engine.runner._prefill
    sizes, splits = prefill.sizes, triton_paged.MAX_PREFILL_SPLITS
    prefill.sizes = tuple(size for size in sizes if size <= 1024)
    triton_paged.MAX_PREFILL_SPLITS = 1
    try:
        with sequence_graphs_off(llm.engine.runner):
            yield
    finally:
        prefill.sizes, triton_paged.MAX_PREFILL_SPLITS = sizes, splits


def phase_a_timed(llm: LLM, label: str = "") -> dict:
    """gpu_bench's phase A (its prompts, seed 0) on this engine, with the cycle collector's pauses."""
    from gpu_bench import phase_a

    llm.engine.clear_cache()
    with GcPauses() as pauses:
        result = phase_a(llm, random.Random(0))
    result["gc"] = pauses.summary()
    name = f"phase A ({label})" if label else "phase A"
    print(f"\n{name}: hit rate {result['hit_rate']:.3f}, p50 {result['p50_ms']:.1f} ms, p90 {result['p90_ms']:.1f}, "
          f"max {result['max_ms']:.1f}, total {result['total_s']:.2f} s; cycle collector {result['gc'] or 'none'}")
    return result


if __name__ == "__main__":
    main()
