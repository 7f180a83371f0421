"""Where the milliseconds of one decode step go (issue 11's "profile" must-show).

    PYTHONPATH=. python benchmarks/step_profile.py [--model next-1b] [--model-dir DIR] [--device cuda] [--seqs 64]

Builds the random model folder of `benchmarks/gpu_bench.py`, prefills `--seqs` prompts of `--prompt-len` tokens,
then decodes `--steps` steps twice:
1. phase-timed: each part of `LLMEngine.step` (schedule, build inputs, execute, sample, postprocess) is timed
   with a device synchronisation after it, so each row is that part's own cost (host + device);
2. free-running: the plain step wall time, as a user sees it (parts overlap where they can).
Then `torch.profiler` over a few decode steps prints the top operators by host time and by device time, and over
two more run without graph replay, the copying, gathering and reducing operators by input shape.
`--prefill`: instead, phase C of the GPU benchmark (a cold 16,000-token prompt, then it + 200 tokens) three times
with fresh prompts, each request timed, then the operators of one more cold and one more warm request, and the
host's Python functions (cProfile) of one more warm request.
`--batch-prefill`: instead, steps shaped like phase D's prefill (16 fresh prompts of `--prompt-len` tokens, one
step of 16,384 tokens at 1,024), timed, then one profiled; `--and-batch-prefill`: those after the decode profile,
in the same process (one start-up).
On CUDA every profile also prints its device time and kernel launches by kernel family (GEMM, MoE, fla, attention,
...) and, for decode, per step by the groups of docs/bench.md's decode table (routed-expert GEMMs, other GEMMs, the
DeltaNet step kernel, attention, everything else), also in the JSON (`device_per_step`).
`--no-pdl`: the kernels launched without programmatic dependent launch, so that each kernel's profiled time is
its own (with PDL a kernel's blocks wait for the one before inside it, and the by-kernel table over-counts:
next-16b's kernels summed to 18.3 ms in a 14.8 ms step; docs/bench.md, session 71). `--quick`: only the
free-running steps and the graph-replay profile by kernel group (for a device call short of time).
`--load-format dummy`: the folder holds only config.json and the tokenizer (`tp_bench.config_folder`: seconds,
not the minutes a 9-16B random folder takes to write) and the engine draws random weights on the device.
`--trace`: after the free-running steps, `TRACED_STEPS` more decode steps under torch.profiler with shapes and
Python stacks: OUT/trace_<model>.json.gz (a chrome trace), OUT/launches_<model>.txt (every device kernel of the
last traced step in launch order, with the torch op, shapes and Python frames that launched it, or "graph
replay"), the step's copy ops by kind (`runner._copy`) and the eager torch ops that reach the device by stack
(which eager work runs beside the graph, and who issues it).
Every Triton kernel compiled after the engine's start-up is named at the end (`compiled_after_start_up` in the
JSON: the engine means to compile none). Prints one table; writes DIR/step_profile_<model>.json (DIR: --out, else
$OUT, else .; `_ssm-<dtype>` is added to the name with a `--mamba-ssm-cache-dtype` other than auto).
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
from gpu_bench import MODELS, CompileLog, letters, model_folder  # noqa: E402

import hybridcache.engine.engine as engine_module  # noqa: E402
from hybridcache import LLM  # noqa: E402
from hybridcache.sampling import RequestOutputKind, SamplingParams  # noqa: E402


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def instrument(engine, times: dict[str, list[float]]) -> None:
    """Wrap the parts of one step so each records its own wall time, ending on a device sync."""
    device = engine.device

    def wrap(owner, name: str, key: str) -> None:
        inner = getattr(owner, name)

        def timed(*args, **kwargs):
            sync(device)
            start = time.perf_counter()
            result = inner(*args, **kwargs)
            sync(device)
            times.setdefault(key, []).append(time.perf_counter() - start)
            return result

        setattr(owner, name, timed)

    wrap(engine.scheduler, "schedule", "schedule")
    wrap(engine_module, "build_forward_batch", "build inputs")
    wrap(engine.runner, "execute", "execute (forward)")
    wrap(engine_module, "sample_async", "sample")
    wrap(engine, "_complete", "postprocess")


def decode_steps(engine, prompts: list[str], steps: int) -> list[float]:
    """Add the prompts, run until every sequence decodes, then time `steps` decode steps."""
    params = SamplingParams(temperature=0, max_tokens=steps + 4, ignore_eos=True,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"p{time.perf_counter_ns()}-{i}", prompt, params)  # as LLM.generate
    while any(s.num_computed < s.prompt_len for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    walls = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - start)
    while engine.has_unfinished_requests():
        engine.step()
    return walls


FAMILIES = (  # kernel name fragment -> family, first match wins (device-time summary of a profile)
    ("_expert_gemm", "MoE: Triton expert GEMM"), ("_combine", "MoE: combine"), ("_route", "MoE: routing"),
    ("grouped", "MoE: grouped GEMM"), ("sort", "MoE: sort"),
    ("chunk_", "fla: chunked delta rule"), ("solve_tril", "fla: chunked delta rule"),
    ("recompute_w_u", "fla: chunked delta rule"), ("cumsum", "fla: chunked delta rule"), ("swiglu", "fla: swiglu"),
    ("_gdn_step", "DeltaNet step"), ("_gates", "DeltaNet gates"), ("conv", "causal conv1d"),
    ("attention", "attention"), ("_attn", "attention"), ("_paged", "attention"), ("_decode_split", "attention"),
    ("_decode_merge", "attention"), ("splitkreduce", "dense GEMM"),
    ("norm", "norms"), ("rotary", "rotary"), ("sigmoid_mul", "attention output gate"), ("_copy_blocks", "cache copies"),
    ("gemm", "dense GEMM"), ("nvjet", "dense GEMM"), ("cutlass", "dense GEMM"), ("sm90", "dense GEMM"),
    ("index", "gather / scatter / copies"), ("copy", "gather / scatter / copies"), ("cat", "gather / scatter / copies"),
)


GROUPS = {  # family -> group of docs/bench.md's "decode step by kernel against its floor" table
    "MoE: Triton expert GEMM": "routed-expert GEMMs", "MoE: grouped GEMM": "routed-expert GEMMs",
    "dense GEMM": "other GEMMs", "DeltaNet step": "DeltaNet step kernel", "attention": "attention decode",
}


def device_families(prof, families: tuple = FAMILIES) -> dict[str, tuple[float, int]]:
    """Device (ms, kernel launches) of the profile's kernels summed by family (`families`, (name fragment, family)
    pairs, the first match wins; the rest: "other"). Only
    device events count: a CPU operator's own device time is the kernels it launched, which are listed again as
    themselves."""
    from torch.autograd import DeviceType

    totals: dict[str, tuple[float, int]] = {}
    for event in prof.key_averages():
        us = getattr(event, "self_device_time_total", 0) or 0
        if us <= 0 or event.device_type == DeviceType.CPU:
            continue
        name = event.key.lower()
        family = next((fam for fragment, fam in families if fragment in name), "other")
        ms, count = totals.get(family, (0.0, 0))
        totals[family] = (ms + us / 1000, count + event.count)
    return dict(sorted(totals.items(), key=lambda item: -item[1][0]))


def print_operators(prof, steps: int = 1) -> dict[str, dict[str, float]]:
    """The operator tables and the device time by kernel family; returns {family or group: {"ms", "launches"}}
    per step (the profile's totals / `steps`), the groups of `GROUPS` ("everything else": every other family)
    prefixed "group: "."""
    averages = prof.key_averages()
    print(averages.table(sort_by="self_cpu_time_total", row_limit=15))
    print(averages.table(sort_by="self_cuda_time_total", row_limit=30))
    families = device_families(prof)
    per_step: dict[str, dict[str, float]] = {}
    print(f"| kernel family | device ms per step | launches per step |  ({steps} steps)\n| --- | --- | --- |")
    for family, (ms, count) in families.items():
        print(f"| {family} | {ms / steps:.3f} | {count / steps:.1f} |")
        per_step[family] = {"ms": ms / steps, "launches": count / steps}
        group = "group: " + GROUPS.get(family, "everything else")
        totals = per_step.setdefault(group, {"ms": 0.0, "launches": 0.0})
        totals["ms"] += ms / steps
        totals["launches"] += count / steps
    total_ms = sum(ms for ms, _ in families.values()) / steps
    total_launches = sum(count for _, count in families.values()) / steps
    print(f"| total | {total_ms:.3f} | {total_launches:.1f} |")
    print("| group | device ms per step | launches per step |\n| --- | --- | --- |")
    for key, value in per_step.items():
        if key.startswith("group: "):
            print(f"| {key[7:]} | {value['ms']:.3f} | {value['launches']:.1f} |")
    per_step["total"] = {"ms": total_ms, "launches": total_launches}
    return per_step


COPY_OPS = ("aten::copy_", "aten::index_copy_", "aten::clone", "aten::cat", "aten::index_select", "aten::index",
            "aten::contiguous", "aten::to", "aten::_to_copy", "aten::argmax", "aten::max")


def print_copies(prof, steps: int) -> list[dict]:
    """The torch operators that copy, gather or reduce (`COPY_OPS`) by input shapes: which tensors a step's copy
    kernels move (the profile's kernel table names only the kernel). Device us per step, calls per step."""
    found = []
    for event in prof.key_averages(group_by_input_shape=True):
        us = getattr(event, "device_time_total", 0) or 0
        if event.key in COPY_OPS and us > 0:
            found.append({"op": event.key, "shapes": str(event.input_shapes)[:160], "us": us / steps,
                          "calls": event.count / steps})
    found.sort(key=lambda row: -row["us"])
    print("| torch op | input shapes | device us per step | calls per step |\n| --- | --- | --- | --- |")
    for row in found[:20]:
        print(f"| {row['op']} | {row['shapes']} | {row['us']:.1f} | {row['calls']:.1f} |")
    return found[:20]


def dense_choices() -> list[dict]:
    """The engine's measured dense GEMM choices (`kernels/gemm/dense.py`), printed and returned for the JSON."""
    from hybridcache.kernels.gemm import dense

    found = []
    print("| dense linear N x K | rows | chosen | device us per GEMM (CUDA-graph replays) |\n| --- | --- | --- | --- |")
    for (_, _, n, k, _, rows), choice in sorted(dense.choices().items(), key=lambda item: item[0][2:]):
        times = dict(choice.times_us)
        chosen = "cublas" if choice.config is None else choice.config.describe()
        print(f"| {n} x {k} | {rows} | {chosen} | " + ", ".join(f"{key} {t:.1f}" for key, t in times.items()) + " |")
        found.append({"n": n, "k": k, "rows": rows, "chosen": chosen, "times_us": times})
    return found


PROFILED_STEPS = 5  # decode steps under torch.profiler
TRACED_STEPS = 2  # decode steps of `--trace`


def log_copies(runner, log: list[list[str]]):
    """Wrap `runner._copy` so each copy op appends "KIND xN" (N: its source ids) to `log[-1]` (a list per step
    the caller opens); returns a function that unwraps it (the runner as before: its class's method, no bound
    method left in the instance, which would be a reference cycle that a frozen heap never collects)."""
    own = "_copy" in vars(runner)
    inner = runner._copy

    def logged(op):
        if log:
            log[-1].append(f"{op.kind.name} x{op.src_ids.numel()}")
        return inner(op)

    runner._copy = logged
    return lambda: setattr(runner, "_copy", inner) if own else delattr(runner, "_copy")


def _frames(stack: list[str], limit: int = 4) -> str:
    """The innermost `limit` frames of a profiler stack that lie in hybridcache or benchmarks."""
    mine = [frame for frame in stack if "hybridcache" in frame or "benchmarks" in frame]
    return " < ".join(frame.split("hybridcache/")[-1] for frame in mine[:limit])


def launch_order(prof, path: Path, since_us: float, marker: str) -> dict[str, dict[str, float]]:
    """Write every device kernel that started after `since_us` (the profile's clock) in launch order to `path`:
    its name, device us, and the torch op (shapes, Python frames) that launched it; a kernel under no torch op but
    the `marker` range is named by its runtime call (cudaGraphLaunch: a graph replay; cuLaunchKernel: a Triton
    launch). Returns the device time of every kernel of the profile by launching op + frames (graph replays and
    Triton launches by runtime call)."""
    from torch.autograd import DeviceType

    events = prof.events()
    cpu = [e for e in events if e.device_type == DeviceType.CPU and not e.is_async]
    ops = {e.id: e for e in cpu if not e.name.startswith(("cuda", "cu"))}
    runtime = {e.id: e for e in cpu if e.name.startswith(("cuda", "cu"))}
    kernels = sorted((e for e in events if e.device_type == DeviceType.CUDA), key=lambda e: e.time_range.start)
    by_op: dict[str, dict[str, float]] = {}
    lines = [f"{'#':>4} {'us':>8}  kernel | launched by"]
    for kernel in kernels:
        op = ops.get(getattr(kernel, "linked_correlation_id", 0) or -1)
        call = runtime.get(kernel.id)
        us = kernel.time_range.end - kernel.time_range.start
        if op is None or op.name == marker:
            key = who = f"[{call.name if call is not None else 'no runtime call'}]"
        else:
            key = f"{op.name} @ {_frames(op.stack, 3)}"
            who = f"{op.name} {str(op.input_shapes)[:120]} @ {_frames(op.stack)}"
        entry = by_op.setdefault(key, {"us": 0.0, "kernels": 0})
        entry["us"] += us
        entry["kernels"] += 1
        if kernel.time_range.start >= since_us:
            lines.append(f"{len(lines) - 1:>4} {us:>8.1f}  {kernel.name[:70]} | {who}")
    path.write_text("\n".join(lines) + "\n")
    return dict(sorted(by_op.items(), key=lambda item: -item[1]["us"]))


def trace_decode(engine, prompts: list[str], out_dir: Path, model: str) -> dict:
    """`TRACED_STEPS` decode steps of `prompts` under torch.profiler (shapes, stacks): the chrome trace (gzip),
    the last step's kernels in launch order, the copy ops of every step, the eager ops' device time by stack."""
    import gzip

    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, record_function

    params = SamplingParams(temperature=0, max_tokens=TRACED_STEPS + 8, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"trace{i}", prompt, params)
    while any(s.num_computed < s.prompt_len for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    for _ in range(2):
        engine.step()
    copies: list[list[str]] = []
    unwrap = log_copies(engine.runner, copies)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True,
                 with_stack=True) as prof:
        for _ in range(TRACED_STEPS):
            copies.append([])
            sync(engine.device)
            with record_function("traced_step"):
                engine.step()
            sync(engine.device)
    unwrap()
    while engine.has_unfinished_requests():
        engine.step()
    raw = out_dir / f"trace_{model}.json"
    prof.export_chrome_trace(str(raw))
    with open(raw, "rb") as src, gzip.open(str(raw) + ".gz", "wb") as dst:
        dst.write(src.read())
    raw.unlink()
    # the last step: kernels that start after the last step's own start (the profile's clock)
    starts = sorted(e.time_range.start for e in prof.events()
                    if e.device_type == DeviceType.CPU and e.name == "traced_step")
    since = starts[-1] if starts else 0.0
    by_op = launch_order(prof, out_dir / f"launches_{model}.txt", since, "traced_step")
    print(f"\ncopy ops per traced step: {copies}")
    print("| launched by (torch op @ frames, or [runtime call]) | device us over the traced steps | kernels |\n"
          "| --- | --- | --- |")
    for key, entry in list(by_op.items())[:30]:
        print(f"| {key[:200]} | {entry['us']:.1f} | {entry['kernels']:.0f} |")
    by_stack = prof.key_averages(group_by_stack_n=6).table(sort_by="self_cuda_time_total", row_limit=40)
    (out_dir / f"ops_by_stack_{model}.txt").write_text(by_stack)
    return {"copies": copies, "by_op": by_op}
ONE_TOKEN = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)


def generate_ms(llm: LLM, prompts: list[str]) -> float:
    """Wall ms of one `generate` of `prompts`, one new token each (it returns after the host has the tokens)."""
    start = time.perf_counter()
    llm.generate(prompts, ONE_TOKEN, use_tqdm=False)
    return 1000 * (time.perf_counter() - start)


def profile_generate(llm: LLM, prompts: list[str], name: str) -> None:
    """`generate_ms` under torch.profiler, then its operator tables (CUDA only)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        ms = generate_ms(llm, prompts)
    print(f"\n{name}: {ms:.1f} ms")
    print_operators(prof)


def profile_batch_prefill(llm: LLM, rng: random.Random, device: torch.device, prompt_len: int) -> None:
    """Steps shaped like phase D's prefill: 16,384 // prompt_len fresh prompts at once, one new token each."""
    batch = lambda: [letters(rng, prompt_len) for _ in range(16384 // prompt_len)]  # noqa: E731
    generate_ms(llm, batch())  # warm-up
    cells = " | ".join(f"{generate_ms(llm, batch()):.1f} ms" for _ in range(3))
    print(f"| batch prefill ({16384 // prompt_len} x {prompt_len}), three steps | {cells} |")
    if device.type == "cuda":
        profile_generate(llm, batch(), "batch prefill")


def host_profile(llm: LLM, prompts: list[str], name: str, rows: int = 30) -> None:
    """`generate_ms` under cProfile: the host's Python functions by cumulative time (where a host-bound
    request's milliseconds go: tokenizing, matching, scheduling, each layer's launches, sampling)."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    ms = generate_ms(llm, prompts)
    profiler.disable()
    print(f"\n{name} under cProfile: {ms:.1f} ms (cProfile adds its own overhead)")
    pstats.Stats(profiler).sort_stats("cumulative").print_stats(rows)


def profile_prefill(llm: LLM, rng: random.Random, device: torch.device) -> None:
    """Phase C three times with fresh prompts (the first may include kernel compilation), then profiled: the
    device's operators of one more cold and warm pair, and the host's functions of a last warm request."""
    print("| run | cold 16,000 ms | + 200 ms |\n| --- | --- | --- |")
    for run in range(3):
        prompt = letters(rng, 16000)
        print(f"| {run} | {generate_ms(llm, [prompt]):.1f} | {generate_ms(llm, [prompt + letters(rng, 200)]):.1f} |",
              flush=True)
    if device.type == "cuda":
        prompt = letters(rng, 16000)
        profile_generate(llm, [prompt], "cold")
        profile_generate(llm, [prompt + letters(rng, 200)], "warm")
    prompt = letters(rng, 16000)
    generate_ms(llm, [prompt])
    host_profile(llm, [prompt + letters(rng, 200)], "warm")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="next-1b", choices=list(MODELS))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--seqs", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--prefill", action="store_true", help="profile phase C (long prefill) instead of decode")
    parser.add_argument("--batch-prefill", action="store_true",
                        help="profile steps shaped like phase D's prefill (16 x 1,024 fresh tokens) instead of decode")
    parser.add_argument("--and-batch-prefill", action="store_true",
                        help="after the decode profile, also --batch-prefill's steps in the same process")
    parser.add_argument("--out", default=None)
    parser.add_argument("--model-dir", default=None, help="reuse the model folder there, or build it there")
    parser.add_argument("--quick", action="store_true",
                        help="only the free-running steps and the device profile by kernel group (no phase-synced "
                             "steps, no operators by input shape): a shorter run for a tight device call")
    parser.add_argument("--trace", action="store_true",
                        help="also trace TRACED_STEPS decode steps (chrome trace, kernels in launch order, copy ops)")
    parser.add_argument("--load-format", default="auto", choices=("auto", "dummy"),
                        help="dummy: a folder of config.json and the tokenizer, random weights drawn on the device")
    parser.add_argument("--mamba-ssm-cache-dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                        help="the DeltaNet recurrent state's dtype (auto: float32 here; the models name none)")
    parser.add_argument("--no-pdl", action="store_true",
                        help="launch without programmatic dependent launch: each kernel's profiled time is its own "
                             "(with PDL it includes its wait for the kernel before, so the kernels' sum exceeds the "
                             "step)")
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.no_pdl:
        from hybridcache.kernels import pdl

        pdl._supported = lambda index: False  # (before any kernel is launched or compiled)
    if args.load_format == "dummy":
        from tp_bench import config_folder

        folder = config_folder(args.model, args.model_dir)
    else:
        folder = model_folder(args.model, args.model_dir)
    llm = LLM(folder, dtype="bfloat16" if device.type == "cuda" else "float32", device=args.device,
              block_size=64, max_num_seqs=args.seqs, max_num_batched_tokens=16384, enforce_eager=args.enforce_eager,
              max_model_len=17000 if args.prefill else None, load_format=args.load_format,
              mamba_ssm_cache_dtype=args.mamba_ssm_cache_dtype)
    engine = llm.engine
    compiles = CompileLog()  # every Triton compile from here on is one the engine's start-up did not do
    compiles.label = "after start-up"
    rng = random.Random(0)
    if args.prefill:
        return profile_prefill(llm, rng, device)
    if args.batch_prefill:
        return profile_batch_prefill(llm, rng, device, args.prompt_len)
    prompts = lambda: [letters(rng, args.prompt_len) for _ in range(args.seqs)]  # noqa: E731
    decode_steps(engine, prompts(), 8)  # warm-up: compile every shape once
    free = decode_steps(engine, prompts(), args.steps)
    out_dir = Path(args.out or os.environ.get("OUT") or ".")
    out_dir.mkdir(parents=True, exist_ok=True)
    traced = trace_decode(engine, prompts(), out_dir, args.model) if args.trace and device.type == "cuda" else None
    times: dict[str, list[float]] = {}
    if not args.quick:
        instrument(engine, times)
    timed_walls = free if args.quick else decode_steps(engine, prompts(), args.steps)
    n = args.steps
    parts = {key: 1000 * sum(values[-n:]) / n for key, values in times.items()}
    result = {
        "model": args.model, "load_format": args.load_format,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else args.device,
        "seqs": args.seqs, "prompt_len": args.prompt_len, "cuda_graphs": list(engine.runner.graph_batch_sizes),
        "mamba_ssm_cache_dtype": engine.config.mamba_ssm_cache_dtype, "pdl": not args.no_pdl,
        "free_step_ms_p50": 1000 * statistics.median(free), "synced_step_ms_p50": 1000 * statistics.median(timed_walls),
        "parts_ms": parts, "trace": traced,
    }
    print(f"\n{args.model} on {result['device']}, {args.seqs} sequences decoding, graphs {result['cuda_graphs']}, "
          f"state {result['mamba_ssm_cache_dtype']}, PDL {'on' if result['pdl'] else 'off'}")
    print(f"free-running decode step p50: {result['free_step_ms_p50']:.2f} ms; phase-synced step p50 "
          f"{result['synced_step_ms_p50']:.2f} ms")
    print("| part | ms per step (own cost, synced) |\n| --- | --- |")
    for key, ms in parts.items():
        print(f"| {key} | {ms:.2f} |")
    if device.type == "cuda":
        from torch.profiler import ProfilerActivity, profile

        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        for i, prompt in enumerate(prompts()):
            engine.add_request(f"prof{i}", prompt, params)
        while any(s.num_computed < s.prompt_len for s in engine.scheduler.running) or engine.scheduler.waiting:
            engine.step()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(PROFILED_STEPS):
                engine.step()
        result["device_per_step"] = print_operators(prof, PROFILED_STEPS)
        if not args.quick:
            # the same batches without the graph (`without_replay`): a graph's kernels have no operator or shapes
            with engine.runner.without_replay(), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                                                         record_shapes=True) as eager:
                for _ in range(2):
                    engine.step()
        while engine.has_unfinished_requests():
            engine.step()
        if not args.quick:
            print("\nTwo of the same decode steps without graph replay (their operators by input shape):")
            result["copies_by_shape"] = print_copies(eager, 2)
        result["dense_choices"] = dense_choices()
    result["compiled_after_start_up"] = compiles.by_label.get("after start-up", [])
    print(f"Triton compiled {len(result['compiled_after_start_up'])} kernels after start-up: "
          f"{[name.split(' key=')[0] for name in result['compiled_after_start_up']]}")
    suffix = ("" if args.mamba_ssm_cache_dtype == "auto" else f"_ssm-{args.mamba_ssm_cache_dtype}") + (
        "_no-pdl" if args.no_pdl else "")
    (out_dir / f"step_profile_{args.model}{suffix}.json").write_text(json.dumps(result, indent=1))
    if args.and_batch_prefill:
        profile_batch_prefill(llm, rng, device, args.prompt_len)


if __name__ == "__main__":
    main()
