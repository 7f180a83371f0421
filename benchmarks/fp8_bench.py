"""FP8 on the H200 (issue 29): gpu_bench's phases with FP8 weights beside bf16 in one call, FP8 KV, the
Qwen3-Next-80B-A3B shape in FP8 on one GPU.

    PYTHONUNBUFFERED=1 PYTHONPATH=. python benchmarks/fp8_bench.py
        [--runs next-16b:fp8,next-16b:bf16,next-16b:fp8:fp8,80b:fp8] [--phases D,C,A] [--kv-fp8-phases A]
        [--load-format dummy|auto] [--kv-pools] [--gpu-memory-utilization F] [--out DIR] [--scale S]
        [--profile decode,batch,small] [--dense-fp8 library|triton] [--decode-kernels-from SWEEP.json]

A run is MODEL:WEIGHTS[:KV]. MODEL is a `gpu_bench.MODELS` name or `80b`; WEIGHTS is `bf16`, `fp8` (128 x 128
block-scaled, quantised at load: `quantization="fp8"`) or `fp8-channel` (a folder written in compressed-tensors'
per-channel format by `write_fp8_folder` from the random bf16 one, both on disk), or `fp8` with other kernel choices
whatever the library's defaults (`KERNEL_VARIANTS`): the routed experts re-quantised per output channel
(`fp8-rowexp`), the FP8 kernels before session 41 (`fp8-blockexp`), session 41's (`fp8-unfused`: the shared expert
on its own, no split-K, per-group decode scales), the row-wise expert GEMMs with fast accumulation (`fp8-fastacc`),
no split-K dense decode GEMM (`fp8-nosplitk`), the decode expert tiles with per-group scales (`fp8-groupscale`),
session 42's MoE decode launches (`fp8-s42`: main before session 43's fp8h); KV
is `auto` (the model dtype) or `fp8` (`kv_cache_dtype="fp8"`; such runs run --kv-fp8-phases). With `--load-format
dummy` (the default) a folder holds only config.json and the tokenizer and the engine draws the weights on the GPU
(FP8 linears quantised from their draws): nothing is written to disk. `80b` is the Qwen3-Next-80B-A3B shape (48
layers 3:1, hidden 2048, 512 experts top-10 + a shared expert, expert width 512, vocabulary 151,936): about 80 GB in
FP8, always dummy; in bf16 (~160 GB) it does not fit one H200 and is not run.

Each run builds one engine (async scheduling and CUDA graphs as gpu_bench), records its start-up seconds, the
memory plan (blocks, the blocks of one checkpoint state, how many checkpoint states the pool holds), then warms up
and runs the phases (gpu_bench's A, C, D: D records the decode step in ms), then frees the GPU before the next run.
Every figure is written to the JSON as it comes (a run cut short keeps its phases). `--profile PARTS`: after the
warm-up, `fp8_profile.py`'s profiles of the decode step, a phase-D prefill step and phase A's small prefills by
kernel group, on the same engine (no second start-up), into the run's "profile". `--kv-pools` adds first, per
model, the pool's blocks under one fixed budget for bf16 and FP8 KV (computed from the state specs, no engine).

Prints a side-by-side table and writes DIR/fp8_bench.json (DIR: --out, else $OUT, else .).
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
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

import torch

from benchmarks import gpu_bench
from hybridcache import LLM
from hybridcache.models.builtin import build_byte_tokenizer

QWEN3_NEXT_80B = dict(vocab_size=151936, hidden_size=2048, num_hidden_layers=48, num_attention_heads=16,
                      num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
                      linear_key_head_dim=128, linear_value_head_dim=128, num_experts=512, num_experts_per_tok=10,
                      moe_intermediate_size=512, shared_expert_intermediate_size=512, intermediate_size=5120)
WEIGHTS = ("bf16", "fp8", "fp8-channel", "fp8-rowexp", "fp8-blockexp", "fp8-unfused", "fp8-fastacc", "fp8-nosplitk",
           "fp8-groupscale", "fp8-s42")
# the `fp8` variants' library choices while one run lasts (`kernel_variant`): (module, attribute) -> value
KERNEL_VARIANTS = {
    # the routed experts re-quantised per output channel (read when they are stacked at start-up)
    "fp8-rowexp": {("fp8_tiles", "EXPERTS_PER_CHANNEL"): True},
    # the FP8 kernels before session 41: block-scaled experts, every dense decode GEMM on cuBLAS, the shared
    # expert on its own
    "fp8-blockexp": {("fp8_tiles", "EXPERTS_PER_CHANNEL"): False, ("triton_block_fp8", "DECODE_TRITON_SHAPES"): {},
                     ("fp8_tiles", "SHARED_AS_EXPERT"): False, ("triton_block_fp8", "DECODE_SPLIT_K"): {},
                     ("fp8_decode_choice", "MEASURE"): False, ("triton_fp8_moe", "DECODE_TOKEN_SCALES"): False},
    # session 41's kernels (main's): the shared expert on its own (its dense GEMMs, SwiGLU and gated add), no
    # split-K dense decode GEMM, the decode experts' x and h per token per 128 channels
    "fp8-unfused": {("fp8_tiles", "SHARED_AS_EXPERT"): False, ("triton_block_fp8", "DECODE_SPLIT_K"): {},
                    ("fp8_decode_choice", "MEASURE"): False, ("triton_fp8_moe", "DECODE_TOKEN_SCALES"): False},
    # the decode expert tiles with x and h per token per 128 channels, scaled at every K step (session 41's)
    "fp8-groupscale": {("triton_fp8_moe", "DECODE_TOKEN_SCALES"): False},
    # the row-wise expert GEMMs with Hopper's FP8 fast accumulation (then from every prefill size)
    "fp8-fastacc": {("fp8_tiles", "ROWWISE_FAST_ACCUM"): True},
    # no split-K dense decode GEMM (neither measured nor from `--decode-kernels-from`)
    "fp8-nosplitk": {("triton_block_fp8", "DECODE_SPLIT_K"): {}, ("fp8_decode_choice", "MEASURE"): False},
    # session 42's FP8 MoE decode (main before session 43): the sort of the [T, k + 1] ids (the shared column
    # included), with_shared, sort and x's quantisation as three launches, the `DECODE_*` expert tile at every shape
    "fp8-s42": {("triton_fp8_moe", "SHARED_SORT"): False, ("triton_fp8_moe", "DECODE_PROLOGUE"): False,
                ("fp8_tiles", "DECODE_TILES"): {}},
}


@contextlib.contextmanager
def kernel_variant(weights: str):
    """While one run of `weights` lasts, the library choices of its `KERNEL_VARIANTS` entry (none for the other
    runs: the library's defaults), so the FP8 kernels of several sessions run in one process. The library's
    choices are restored."""
    from hybridcache.kernels.gemm import fp8_decode_choice, fp8_tiles, triton_block_fp8, triton_fp8_moe

    modules = {"fp8_tiles": fp8_tiles, "triton_block_fp8": triton_block_fp8, "fp8_decode_choice": fp8_decode_choice,
               "triton_fp8_moe": triton_fp8_moe}
    settings = KERNEL_VARIANTS.get(weights, {})
    saved = {key: getattr(modules[key[0]], key[1]) for key in settings}
    for (module, name), value in settings.items():
        setattr(modules[module], name, value)
    try:
        yield
    finally:
        for (module, name), value in saved.items():
            setattr(modules[module], name, value)


def config_only_folder(model: str, path: Path) -> Path:
    """A folder with config.json (bf16, byte tokenizer's eos) and the byte tokenizer, no weights (`load_format
    dummy` draws them on the GPU): the 80B shape, or a `gpu_bench.MODELS` entry."""
    import transformers

    if model == "80b":
        config_class, model_class, fields = "Qwen3NextConfig", "Qwen3NextForCausalLM", QWEN3_NEXT_80B
    else:
        config_class, model_class, fields = gpu_bench.MODELS[model]
    config = getattr(transformers, config_class)(**fields, eos_token_id=258, dtype="bfloat16")
    config.architectures = [model_class]
    path.mkdir(parents=True, exist_ok=True)
    config.to_json_file(str(path / "config.json"))
    build_byte_tokenizer().save(str(path / "tokenizer.json"))
    return path


def run_folder(model: str, weights: str, root: Path, dummy: bool) -> tuple[Path, dict]:
    """(the folder, the extra LLM options) of one run; `dummy`: random weights drawn on the GPU, no disk."""
    weights = "fp8" if weights in KERNEL_VARIANTS else weights
    if model == "80b" and weights != "fp8":
        raise ValueError("the 80B shape runs in fp8 only (bf16 does not fit one H200; no folder for channel)")
    if model == "80b" or (dummy and weights != "fp8-channel"):
        folder = config_only_folder(model, root / f"{model}-config")
        return folder, {"load_format": "dummy", **({"quantization": "fp8"} if weights == "fp8" else {})}
    dense = gpu_bench.model_folder(model, str(root / model))
    if weights == "bf16":
        return dense, {}
    if weights == "fp8":
        return dense, {"quantization": "fp8"}
    channel = root / f"{model}-fp8-channel"
    if not (channel / "config.json").is_file():
        from hybridcache.models.fp8_folders import write_fp8_folder

        write_fp8_folder(dense, channel, "channel")
    return channel, {}


# the start-up's parts that `StartupParts` times: (module, attribute path) of each function wrapped, as the engine
# calls it (a name imported into a module is wrapped there)
STARTUP_PARTS = (
    ("hybridcache.engine.rank_runner", "load_model"),
    ("hybridcache.models.random_weights", "randomize_"),
    ("hybridcache.models.quant", "convert_linears"),
    ("hybridcache.engine.rank_runner", "measure_activation_bytes"),
    ("hybridcache.kernels.gemm.triton_fp8_moe", "Fp8ExpertWeights.share"),
    ("hybridcache.kernels.cuda_backend", "compile_fp8_tiles"),
    ("hybridcache.kernels.cuda_backend", "compile_tiles"),
    ("hybridcache.engine.runner", "ModelRunner._compile_copies"),
    ("hybridcache.engine.runner", "ModelRunner._compile_on_pools"),
    ("hybridcache.engine.runner", "ModelRunner._capture"),
    ("hybridcache.engine.runner", "ModelRunner._capture_prefill"),
    ("triton.runtime.autotuner", "Autotuner._bench"),  # one config's compile + timing while a kernel autotunes
)


class CompileTimes:
    """While entered, Triton's compilation listener (`triton.knobs.compilation.listener`, where this Triton has
    one) records every kernel compiled or loaded from the disk cache: per kernel name, the compiles, the disk
    cache hits and the seconds (Triton's own timer: IR, lowering stages, storing). `summary()` gives totals and
    the `top` kernels by seconds. Restores the previous listener on exit."""

    def __init__(self, top: int = 25) -> None:
        self.top = top
        self.by_kernel: dict[str, dict] = {}
        self._knobs = None
        self._saved = None

    def __enter__(self) -> CompileTimes:
        try:
            import triton
        except ImportError:
            return self
        compilation = getattr(getattr(triton, "knobs", None), "compilation", None)
        if compilation is not None and hasattr(compilation, "listener"):
            self._knobs, self._saved = compilation, compilation.listener
            compilation.listener = self
        return self

    def __call__(self, *, src, metadata, metadata_group, times, cache_hit) -> None:
        name = str(getattr(src, "name", None) or metadata.get("name", "?"))
        entry = self.by_kernel.setdefault(name, {"compiled": 0, "disk_hits": 0, "s": 0.0})
        entry["disk_hits" if cache_hit else "compiled"] += 1
        entry["s"] += getattr(times, "total", 0) / 1e6  # microseconds

    def __exit__(self, *exc) -> None:
        if self._knobs is not None:
            self._knobs.listener = self._saved

    def summary(self) -> dict:
        if self._knobs is None:
            return {"error": "this Triton has no compilation listener"}
        ranked = sorted(self.by_kernel.items(), key=lambda item: -item[1]["s"])
        return {"compiled": sum(e["compiled"] for e in self.by_kernel.values()),
                "disk_hits": sum(e["disk_hits"] for e in self.by_kernel.values()),
                "s": round(sum(e["s"] for e in self.by_kernel.values()), 2),
                "top": {name: {**e, "s": round(e["s"], 3)} for name, e in ranked[:self.top]}}


class StartupParts:
    """While entered, each `STARTUP_PARTS` function (one that exists) sums its calls' wall seconds (CUDA
    synchronised after each, so a part's queued device work counts in it; nested parts count in both) into
    `seconds` and `calls` ("module:attribute" keys); restored on exit. The engine's start-up by part."""

    def __init__(self, cuda: bool, on_call=None) -> None:
        self.cuda = cuda
        self.on_call = on_call  # called after each timed call (a start-up cut short keeps its parts so far)
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._restore: list = []

    def __enter__(self) -> StartupParts:
        import importlib

        for module_name, path in STARTUP_PARTS:
            owner = importlib.import_module(module_name)
            *parents, name = path.split(".")
            for parent in parents:
                owner = getattr(owner, parent)
            original = owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name, None)
            if original is None:
                continue
            key = f"{module_name.rsplit('.', 1)[-1]}:{path}"
            wrapped = self._timed(key, original.__get__(None, owner) if isinstance(original, classmethod)
                                  else original)
            setattr(owner, name, staticmethod(wrapped) if isinstance(original, classmethod) else wrapped)
            self._restore.append((owner, name, original))
        return self

    def _timed(self, key: str, function):
        def timed_call(*args, **kwargs):
            begin = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                if self.cuda and not torch.cuda.is_current_stream_capturing():
                    torch.cuda.synchronize()
                self.seconds[key] = self.seconds.get(key, 0.0) + time.perf_counter() - begin
                self.calls[key] = self.calls.get(key, 0) + 1
                if self.on_call is not None:
                    self.on_call(self)

        return timed_call

    def __exit__(self, *exc) -> None:
        for owner, name, original in reversed(self._restore):
            setattr(owner, name, original)

    def summary(self) -> dict:
        return {key: {"s": round(seconds, 3), "calls": self.calls[key]} for key, seconds in self.seconds.items()}


class StackSampler:
    """While entered (with `every_s` > 0), a daemon thread appends the main thread's Python stack to `path` every
    `every_s` seconds, with the seconds since entering. It reads the stack with `sys._current_frames()` holding
    the GIL (faulthandler's watchdog reads it without and crashed an engine start-up)."""

    def __init__(self, path: Path, every_s: float) -> None:
        self.path, self.every_s = path, every_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> StackSampler:
        if self.every_s > 0:
            self._thread = threading.Thread(target=self._run, args=(threading.get_ident(), time.perf_counter()),
                                            daemon=True)
            self._thread.start()
        return self

    def _run(self, main: int, start: float) -> None:
        with open(self.path, "a") as out:
            while not self._stop.wait(self.every_s):
                frame = sys._current_frames().get(main)
                if frame is None:
                    return
                out.write(f"--- {time.perf_counter() - start:.1f} s\n{''.join(traceback.format_stack(frame))}")
                out.flush()

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


def one_run(model: str, weights: str, kv: str, root: Path, phases: list[str], options: dict, dummy: bool,
            result: dict, save, profile_dir: Path | None = None, profile_parts: list[str] | None = None,
            out_dir: Path | None = None, stacks_every_s: float = 0.0) -> dict:
    """One engine's figures, written into `result` (and `save()`d) as they come, so a run cut short keeps them;
    with `profile_parts`, after the warm-up and before the phases, `fp8_profile.profile_engine` (its cProfile
    table in `out_dir`); with `profile_dir`, after the phases, `profile_prefix_hit` (its tables in that folder).
    With `stacks_every_s`, the main thread's Python stack is appended to `out_dir`/startup_stacks_MODEL_WEIGHTS.txt
    that often while the engine starts (`StackSampler`: where a start-up cut short by a time limit was)."""
    folder, extra = run_folder(model, weights, root, dummy)
    cuda = options["device"] == "cuda"
    start = time.perf_counter()
    sampler = StackSampler((out_dir or Path(".")) / f"startup_stacks_{model}_{weights}.txt", stacks_every_s)

    compiled = CompileTimes()

    def parts_so_far(parts: StartupParts) -> None:
        result["startup_parts"] = parts.summary()
        result["startup_compiles"] = compiled.summary()
        save()

    with sampler, compiled, StartupParts(cuda, parts_so_far) as parts:
        llm = LLM(folder, **options, **extra, kv_cache_dtype=kv)
    result.update({"engine_init_s": time.perf_counter() - start, "startup_parts": parts.summary(),
                   "startup_compiles": compiled.summary(),
                   "weight_format": llm.engine.weight_format, "kv_cache_dtype": llm.engine.kv_cache_dtype,
                   "memory": llm.engine.memory_plan.describe(), "num_blocks": llm.engine.memory_plan.num_blocks,
                   "state_pages": llm.engine.memory_plan.state_pages,
                   "cuda_graphs": list(llm.engine.runner.graph_batch_sizes), "phases": {},
                   "gpu_memory_allocated_gib": torch.cuda.memory_allocated() / 2**30 if cuda else None,
                   "budget_bytes": llm.engine.memory_plan.budget_bytes,
                   "runtime_state_bytes": llm.engine.memory_plan.state_bytes,
                   "device_total_bytes": torch.cuda.mem_get_info()[1] if cuda else None})
    result["checkpoint_states_that_fit"] = result["num_blocks"] // max(1, result["state_pages"])
    save()
    print(f"{model}:{weights}:{kv} up in {result['engine_init_s']:.1f} s: {result['memory']}", flush=True)
    print(f"{model}:{weights}:{kv} start-up by part: {json.dumps(result['startup_parts'])}", flush=True)
    print(f"{model}:{weights}:{kv} start-up's Triton compiles: {json.dumps(result['startup_compiles'])}",
          flush=True)
    compiles = gpu_bench.CompileLog()  # from here on, every compile is one the engine's start-up did not do
    compiles.label = "warm-up"
    gpu_bench.warm_up(llm, random.Random(99))
    result["warm_up_kernels_compiled"] = compiles.by_label.get("warm-up", [])
    if profile_parts:
        from benchmarks import fp8_profile

        compiles.label = "profile"
        fp8_profile.profile_engine(llm, profile_parts, result, save,
                                   (out_dir or Path(".")) / f"host_{model}_{weights}_{kv}.txt")
        result["profile_kernels_compiled"] = compiles.by_label.get("profile", [])
    runners = {"A": gpu_bench.phase_a, "B": gpu_bench.phase_b, "C": gpu_bench.phase_c, "D": gpu_bench.phase_d}
    rng = random.Random(0)
    for phase in phases:
        compiles.label = phase
        if not gpu_bench.run_phase(llm, runners[phase], rng, result, phase):
            continue
        result["phases"][phase]["kernels_compiled"] = compiles.by_label.get(phase, [])
        gpu_bench.print_row(f"{model}:{weights}:{kv} {phase}", result["phases"][phase])
        save()
    if weights.startswith("fp8"):  # (the table is the process's: a bf16 run would repeat an FP8 run's)
        result["fp8_decode_choices"] = decode_choice_table()
        print(f"{model}:{weights}:{kv} FP8 decode choices: {json.dumps(result['fp8_decode_choices'])}", flush=True)
        save()
    if profile_dir is not None:
        try:
            result["prefix_hit_profile"] = profile_prefix_hit(
                llm, random.Random(7), profile_dir / f"profile_{model}_{weights}_{kv}.txt")
            print(f"{model}:{weights}:{kv} + 200 profile: {result['prefix_hit_profile']}", flush=True)
        except Exception as error:  # a profile is a diagnostic: the run's figures stand without it
            traceback.print_exc()
            result["prefix_hit_profile"] = {"error": repr(error)}
        save()
    del llm
    release_engines(cuda)
    return result


def release_engines(cuda: bool) -> None:
    """Free what engines no longer referenced hold, before the next one starts. A CUDA engine moves the heap out of
    the cycle collector's reach at start-up (`gc.freeze`, `engine._freeze_gc_heap`), so a reference cycle through
    its objects made afterwards (a profile's wrapper of a runner method was one: its pools stayed allocated and
    the next engine ran out of memory) survives `gc.collect()`: unfreeze, then collect."""
    gc.unfreeze()
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()


def decode_choice_table() -> dict:
    """The process's measured FP8 decode choices so far (`fp8_decode_choice.choices()`): "NxK" -> the launch
    chosen ("library" or the split-K launch's fields) and every candidate's microseconds."""
    from hybridcache.kernels.gemm import fp8_decode_choice

    return {f"{n}x{k}": {"chosen": "library" if c.config is None else c.config.__dict__, "times_us": dict(c.times_us)}
            for (_, _, n, k, _), c in fp8_decode_choice.choices().items()}


def profile_prefix_hit(llm, rng: random.Random, path: Path) -> dict:
    """Phase C's + 200 request (a 16,000-token prefix cached, 200 new tokens, one output token) after one cold
    prefill of the prefix: three timed, one under torch.profiler, one under cProfile; the profiler's operator
    tables (by host and by device time) and cProfile's functions (by own and by cumulative time) go to `path`.
    Returns the ms of each, and the traced request's count of device kernels and its host and device time summed
    over operators (ms)."""
    from torch.profiler import ProfilerActivity, profile

    prompt = gpu_bench.letters(rng, 16000)
    gpu_bench.timed(llm, [prompt], 1)
    out = {"plus200_ms": [1000 * gpu_bench.timed(llm, [prompt + gpu_bench.letters(rng, 200)], 1)[0]
                          for _ in range(3)]}
    cuda = llm.engine.device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        out["traced_ms"] = 1000 * gpu_bench.timed(llm, [prompt + gpu_bench.letters(rng, 200)], 1)[0]
    averages = prof.key_averages()
    tables = [averages.table(sort_by="self_cpu_time_total", row_limit=25)]
    if cuda:
        tables.append(averages.table(sort_by="self_cuda_time_total", row_limit=25))
    host = cProfile.Profile()  # the host's Python, which torch.profiler does not break down (Triton's launcher)
    host.enable()
    out["cprofiled_ms"] = 1000 * gpu_bench.timed(llm, [prompt + gpu_bench.letters(rng, 200)], 1)[0]
    host.disable()
    for order in ("tottime", "cumulative"):
        text = io.StringIO()
        pstats.Stats(host, stream=text).sort_stats(order).print_stats(30)
        tables.append(text.getvalue())
    path.write_text("\n\n".join(tables))
    device = [e for e in averages if e.device_type == torch.autograd.DeviceType.CUDA]
    out["device_kernels"] = sum(e.count for e in device)
    out["device_ms"] = sum(getattr(e, "self_device_time_total", 0.0) for e in device) / 1000
    out["host_ops_self_ms"] = sum(e.self_cpu_time_total for e in averages) / 1000
    return out


def kv_pools(model: str, root: Path, budget_gib: float) -> dict:
    """The pool's blocks and checkpoint states under a fixed budget with the model-dtype (bf16) and FP8 KV."""
    from hybridcache.engine.memory import pool_bytes, state_pages
    from hybridcache.models import ModelConfig, get_model_class, quant

    config = ModelConfig.from_model_dir(config_only_folder(model, root / f"{model}-config"))
    with torch.device("meta"):
        net = get_model_class(config.architecture)(config)
    out = {"budget_gib": budget_gib}
    for kv in ("bf16", "fp8"):
        quant.set_kv_fp8(net, kv == "fp8", {})
        block, slot = pool_bytes(net.state_specs(torch.bfloat16, torch.float32), 64, net.slot_specs(torch.bfloat16))
        blocks = int(budget_gib * 2**30 // block)
        out[kv] = {"kv_bytes_per_block": block, "state_bytes": slot, "blocks": blocks,
                   "state_pages": state_pages(slot, block), "tokens_of_kv": blocks * 64}
    return out


PREFILL_FIELDS = ("block_m", "block_n", "down_block_n", "num_warps", "num_stages", "group_m")


def prefill_config(row: dict) -> tuple:
    """A W8A8 prefill sweep row's `fp8_tiles.PrefillTile` fields (rows from before the tile had them: its
    defaults for the missing ones, the down GEMM as wide as the gate/up one)."""
    return (row["block_m"], row["block_n"], row.get("down_block_n", row["block_n"]), row.get("num_warps", 4),
            row.get("num_stages", 3), row.get("group_m", 0))


def prefill_bucket_of(row: dict) -> str:
    """The `fp8_tiles.PREFILL_TILES` bucket of a sweep row (next-16b's experts, 32 top-8, where the row does
    not say its rows per expert)."""
    from hybridcache.kernels.gemm import fp8_tiles

    rows = row.get("rows_per_expert", row["tokens"] * 8 // 32)
    return "small" if rows <= fp8_tiles.PREFILL_SMALL_ROWS else "large"


MAX_SWEEP_ERR = 0.25  # a sweep row with a larger error (relative to max |ref|) is a broken kernel


def fastest(rows: list[dict], config_of, size_of, primary=None) -> tuple[tuple, dict[tuple, float], list] | None:
    """(the configuration with the least summed ms over every size the rows hold, {configuration: summed ms}, the
    sizes summed over) among the configurations measured at all those sizes with an error below MAX_SWEEP_ERR;
    None without one.
    `config_of(row)` names a row's configuration, `size_of(row)` its size (e.g. tokens). With `primary` (a test of
    a size), fewer than two configurations measured at every size (a sweep cut short by its budget) compare at
    the primary sizes alone."""
    best: dict[tuple, dict] = {}  # configuration -> size -> its fastest ms
    for r in rows:
        if "ms" in r and r.get("err", 0.0) < MAX_SWEEP_ERR:  # a NaN error fails; a row without one passes
            per_size = best.setdefault(config_of(r), {})
            per_size[size_of(r)] = min(per_size.get(size_of(r), float("inf")), r["ms"])
    sizes = {size for per_size in best.values() for size in per_size}
    complete = [config for config, per_size in best.items() if set(per_size) == sizes]
    if primary is not None and len(complete) < 2 and len(best) >= 2:
        sizes = {size for size in sizes if primary(size)}
        best = {config: {size: ms for size, ms in per_size.items() if size in sizes} for config, per_size in
                best.items()}
        complete = [config for config, per_size in best.items() if sizes and set(per_size) == sizes]
    sums = {config: sum(best[config].values()) for config in complete}
    return (min(sums, key=sums.get), sums, sorted(sizes)) if sums else None


def decode_choices(rows: list[dict]) -> dict:
    """The fastest FP8 kernels of `fp8_sweep.py` result rows, each over the sizes it was swept at (a part without
    rows is absent): "experts", the routed experts' decode tile (kernel, block_n, swap_ab, num_warps, num_stages)
    by its ms summed over the decode token counts (T <= 64: 1 and 64; `moe.grouped.tile_rows` gives BLOCK_M, as in
    the sweep); "experts_prefill", per `fp8_tiles.PREFILL_TILES` bucket ("small": up to PREFILL_SMALL_ROWS
    rows per expert, "large": more) the W8A8 prefill tile (`PREFILL_FIELDS`) summed over the token counts above 64
    the bucket was swept at (`--quick`: 256 and 1,024 tokens; `--prefill`: 1,024, 4,096 and 16,384; 1,024 or
    16,384 alone if a cut-short sweep has fewer than two tiles at every size); "dense", the dense kernel at
    M <= 64 summed over the shapes and row counts
    (swap-AB tiles and cuBLAS), or, where the rows name their weight shape, "dense_shapes" instead
    (`dense_shape_choices`); "dense_splitk", the split-K launch per shape from `--splitk` rows
    (`splitk_choices`); "experts_bf16_ms", bf16's experts per token count (a reference, not a choice).
    Rows with an error of MAX_SWEEP_ERR or more are left out."""
    rows = [r for r in rows if "ms" in r]
    chosen: dict = {}
    decode = [r for r in rows if r.get("experts") and r["tokens"] <= 64 and r["kernel"] in ("w8a8", "w8a16")
              and "group_m" not in r]  # (a prefill tile's row, e.g. a CPU smoke test's, is no decode tile)
    found = fastest(decode, lambda r: (r["kernel"], r["block_n"], bool(r.get("swap_ab")), r.get("num_warps", 4),
                                       r.get("num_stages", 3)),
                    lambda r: r["tokens"], primary=lambda tokens: tokens == 64)
    if found:
        (kernel, block_n, swap_ab, warps, stages), sums, sizes = found
        chosen["experts"] = {"kernel": kernel, "block_n": block_n, "swap_ab": swap_ab, "num_warps": warps,
                             "num_stages": stages, "tokens": sizes,
                             "ms_sum": {"/".join(map(str, config)): ms for config, ms in sums.items()}}
    prefill = [r for r in rows if r.get("experts") and r["tokens"] > 64 and r["kernel"] == "w8a8"
               and not r.get("swap_ab")]
    for bucket in ("small", "large"):
        found = fastest([r for r in prefill if prefill_bucket_of(r) == bucket], prefill_config,
                        lambda r: r["tokens"], primary=lambda tokens: tokens in (1024, 16384))
        if found:
            config, sums, sizes = found
            chosen.setdefault("experts_prefill", {})[bucket] = {
                **dict(zip(PREFILL_FIELDS, config, strict=True)), "tokens": sizes,
                "ms_sum": {"/".join(map(str, c)): ms for c, ms in sums.items()}}
    bf16 = {r["tokens"]: r["ms"] for r in rows if r.get("experts") and r["kernel"] == "bf16"}
    if bf16:
        chosen["experts_bf16_ms"] = dict(sorted(bf16.items()))  # for reference: bf16's experts at each size
    splitk = splitk_choices(rows)
    if splitk:
        chosen["dense_splitk"] = splitk
    dense = [r for r in rows if r.get("shape") and r.get("M", 0) <= 64 and r["kernel"] != "bf16"
             and (r.get("tile") or {}).get("swap_ab", True) and not r.get("splitk_sweep")]
    shapes = dense_shape_choices(dense)
    if shapes:
        chosen["dense_shapes"] = shapes
        return chosen
    found = fastest(dense, lambda r: (r["kernel"],), lambda r: (r["shape"], r["M"]))
    if found:
        (kernel,), sums, _ = found
        chosen["dense"] = {"kernel": kernel, "ms_sum": {k: ms for (k,), ms in sums.items()}}
    return chosen


def splitk_choices(rows: list[dict]) -> dict[str, dict]:
    """Per weight shape ("NxK") of `fp8_sweep.py --splitk` rows: the split-K launch (`triton_block_fp8.SplitK`
    fields) with the least ms summed over the row counts swept, where that sum is below the library's kernel's
    ("library" rows) over the same row counts and every one of its rows has an error below MAX_SWEEP_ERR, taken
    from the first row count of the smallest swept size's BLOCK_M bucket (`min_rows`: 1, 17 or 33; a sweep at 64
    rows alone says nothing of 16); shapes where none beats the library are left out (`DECODE_SPLIT_K`)."""
    per_shape: dict[str, dict] = {}
    for r in rows:
        if r.get("splitk_sweep") and "ms" in r and r["kernel"] in ("library", "w8a8-splitk"):
            config = ("library",) if r["kernel"] == "library" else tuple(
                r["tile"][f] for f in ("block_n", "split_k", "num_warps", "num_stages"))
            per_shape.setdefault(f"{r['N']}x{r['K']}", []).append(r | {"config": config})
    chosen = {}
    for shape, shape_rows in sorted(per_shape.items()):
        found = fastest(shape_rows, lambda r: r["config"], lambda r: r["M"])
        if found is None:
            continue
        best, sums, sizes = found
        if best != ("library",) and ("library",) in sums:
            smallest = min(sizes)  # from the first row count of the smallest size's BLOCK_M (`decode_config`)
            chosen[shape] = {**dict(zip(("block_n", "split_k", "num_warps", "num_stages"), best, strict=True)),
                             "min_rows": 1 if smallest <= 16 else 17 if smallest <= 32 else 33,
                             "rows": sizes, "ms_sum": round(sums[best], 5), "library_ms_sum": sums[("library",)]}
    return chosen


def dense_shape_choices(rows: list[dict]) -> dict[str, int]:
    """Per weight shape ("NxK") of dense decode rows that name it (`N`, `K`): the most rows M up to which the
    Triton W8A8 swap-AB tile beat cuBLAS's block-scaled GEMM at every M measured (`triton_block_fp8.
    DECODE_TRITON_SHAPES`); shapes where cuBLAS won at the smallest M are left out."""
    times: dict[tuple[int, int], dict[int, dict[str, float]]] = {}
    for r in rows:
        if "N" in r and "K" in r and r["kernel"] in ("w8a8", "cublas-block") and r.get("err", 0.0) < MAX_SWEEP_ERR:
            per_kernel = times.setdefault((r["N"], r["K"]), {}).setdefault(r["M"], {})
            per_kernel[r["kernel"]] = min(per_kernel.get(r["kernel"], float("inf")), r["ms"])
    chosen = {}
    for (n, k), per_m in sorted(times.items()):
        limit = 0
        for m, ms in sorted(per_m.items()):
            if not ms.get("w8a8", float("inf")) < ms.get("cublas-block", float("inf")):
                break
            limit = m
        if limit:
            chosen[f"{n}x{k}"] = limit
    return chosen


def choose_decode_kernels(sweep_json: str) -> dict:
    """Set the FP8 kernels' module choices (`triton_fp8_moe.DECODE_*`, `fp8_tiles.PREFILL_TILES`, `triton_block_fp8.
    DECODE_W8A16`, `CUBLAS_ROWS_FROM`, `DECODE_TRITON_SHAPES` and `DECODE_SPLIT_K`) to `decode_choices` of a
    `fp8_sweep.py` result;
    a part the sweep has no rows for keeps the library's choice. Returns the choices (they go into the JSON)."""
    from hybridcache.kernels.gemm import fp8_tiles, triton_block_fp8, triton_fp8_moe

    sweep = json.loads(Path(sweep_json).read_text())
    if "rows" not in sweep:
        raise ValueError(f"{sweep_json} is not a fp8_sweep.py result (no 'rows')")
    chosen = decode_choices(sweep["rows"])
    if "experts" in chosen:
        experts = chosen["experts"]
        triton_fp8_moe.DECODE_W8A16 = experts["kernel"] == "w8a16"
        triton_fp8_moe.DECODE_BLOCK_N = experts["block_n"]
        triton_fp8_moe.DECODE_SWAP_AB = experts["swap_ab"]
        triton_fp8_moe.DECODE_NUM_WARPS = experts["num_warps"]
        triton_fp8_moe.DECODE_NUM_STAGES = experts["num_stages"]
    for bucket, prefill in chosen.get("experts_prefill", {}).items():
        fp8_tiles.PREFILL_TILES[bucket] = fp8_tiles.PrefillTile(*(prefill[f] for f in PREFILL_FIELDS))
    if "dense_shapes" in chosen:  # per shape: cuBLAS but on these
        triton_block_fp8.DECODE_W8A16 = False
        triton_block_fp8.CUBLAS_ROWS_FROM = 1
        triton_block_fp8.DECODE_TRITON_SHAPES = {tuple(map(int, shape.split("x"))): rows
                                                 for shape, rows in chosen["dense_shapes"].items()}
        chosen["dense"] = f"cuBLAS but the Triton W8A8 tile on {chosen['dense_shapes']} (shape: up to M rows)"
    if "dense_splitk" in chosen:
        triton_block_fp8.DECODE_SPLIT_K = {
            tuple(map(int, shape.split("x"))): triton_block_fp8.SplitK(c["block_n"], c["split_k"], c["num_warps"],
                                                                       c["num_stages"], c["min_rows"])
            for shape, c in chosen["dense_splitk"].items()}
    if "dense" in chosen and isinstance(chosen["dense"], dict):
        kernel = chosen["dense"]["kernel"]
        triton_block_fp8.DECODE_W8A16 = kernel == "w8a16"
        triton_block_fp8.CUBLAS_ROWS_FROM = 1 if kernel == "cublas-block" else triton_block_fp8.DECODE_ROWS + 1
    for part in ("experts", "experts_prefill", "dense"):
        chosen.setdefault(part, "no sweep rows: the library's choice")
    print(f"FP8 decode kernels from {sweep_json}: {chosen}", flush=True)
    return chosen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", default="next-16b:fp8,next-16b:bf16,next-16b:fp8:fp8,80b:fp8")
    parser.add_argument("--phases", default="D,C,A")
    parser.add_argument("--kv-fp8-phases", default="A", help="the phases of runs with FP8 KV")
    parser.add_argument("--load-format", default="dummy", choices=("dummy", "auto"),
                        help="dummy: random weights drawn on the GPU (no folder on disk); auto: a random bf16 "
                             "folder written once and read (fp8-channel runs always write theirs)")
    parser.add_argument("--kv-pools", action="store_true")
    parser.add_argument("--profile-prefix-hit", action="store_true",
                        help="after each run's phases, phase C's + 200 request timed three times and once under "
                             "torch.profiler (tables: DIR/profile_MODEL_WEIGHTS_KV.txt)")
    parser.add_argument("--profile", default="",
                        help="fp8_profile.py's parts (decode,batch,small) on each run's engine, before its phases")
    parser.add_argument("--decode-kernels-from", default=None,
                        help="a fp8_sweep.py JSON: use its fastest decode kernels (choose_decode_kernels)")
    parser.add_argument("--dense-fp8", default="library", choices=("library", "triton"),
                        help="triton: the dense FP8 linears on the Triton W8A8 kernel at every size instead of "
                             "cuBLAS's block-scaled GEMM (an A/B of cuBLAS's cost)")
    parser.add_argument("--startup-stacks-s", type=float, default=0.0,
                        help="append the main thread's stack to DIR/startup_stacks_*.txt this often during start-up")
    parser.add_argument("--kv-budget-gib", type=float, default=40.0)
    parser.add_argument("--gpu-memory-utilization", type=float, default=None)
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    parser.add_argument("--model-dir", default=None, help="folders are built (or reused) under this folder")
    parser.add_argument("--out", default=None)
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every workload length (smoke tests)")
    parser.add_argument("--device", default="cuda", help="cpu: a smoke test of this script (--runs tiny:fp8 ...)")
    args = parser.parse_args()
    gpu_bench.SCALE["value"] = args.scale
    root = Path(args.model_dir) if args.model_dir else Path(tempfile.mkdtemp())
    out_path = Path(args.out or os.environ.get("OUT") or ".") / "fp8_bench.json"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    runs = [(r.split(":") + ["auto"])[:3] for r in args.runs.split(",") if r]
    from benchmarks.fp8_profile import parse_parts

    try:
        profile_parts = parse_parts(args.profile)
    except ValueError as error:
        parser.error(str(error))
    bad = [r for r in args.runs.split(",") if r and (len(r.split(":")) not in (2, 3) or r.split(":")[1] not in WEIGHTS
                                                   or (r.split(":") + ["auto"])[2] not in ("auto", "fp8")
                                                   or r.split(":")[0] not in (*gpu_bench.MODELS, "80b"))]
    if bad:
        parser.error(f"runs must be MODEL:WEIGHTS[:KV] with MODEL in {[*gpu_bench.MODELS, '80b']}, WEIGHTS in "
                     f"{WEIGHTS}, KV auto or fp8; got {bad}")

    def phase_list(text: str) -> list[str]:
        return [p.strip().upper() for p in text.split(",") if p.strip()]

    options = dict(dtype="bfloat16" if args.device == "cuda" else "float32", device=args.device, block_size=64,
                   max_num_seqs=64,
                   max_num_batched_tokens=args.max_num_batched_tokens,
                   gpu_memory_utilization=args.gpu_memory_utilization)
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    result: dict = {"device": device_name, "date": time.strftime("%Y-%m-%d"), "options": options, "runs": []}
    if args.dense_fp8 == "triton":
        from hybridcache.kernels.gemm import triton_block_fp8

        triton_block_fp8.CUBLAS_ROWS_FROM = sys.maxsize
        result["dense_fp8"] = "triton"
    if args.decode_kernels_from and Path(args.decode_kernels_from).is_file():
        result["decode_kernels"] = choose_decode_kernels(args.decode_kernels_from)
    elif args.decode_kernels_from:
        print(f"no {args.decode_kernels_from}: the library's decode kernels", flush=True)

    def save() -> None:
        out_path.write_text(json.dumps(result, indent=1))

    if args.kv_pools:  # no engine: computed first, so a run cut short keeps them
        result["kv_pools"] = {model: kv_pools(model, root, args.kv_budget_gib) for model in dict.fromkeys(
            model for model, _, _ in runs)}
        print(json.dumps(result["kv_pools"]), flush=True)
        save()
    for model, weights, kv in runs:
        run: dict = {"model": model, "weights": weights, "kv": kv}
        result["runs"].append(run)
        try:
            with kernel_variant(weights):
                one_run(model, weights, kv, root, phase_list(args.kv_fp8_phases if kv == "fp8" else args.phases),
                        options, args.load_format == "dummy", run, save,
                        out_path.parent if args.profile_prefix_hit else None, profile_parts, out_path.parent,
                        args.startup_stacks_s)
        except Exception as error:
            traceback.print_exc()
            run["error"] = repr(error)
        save()
    print("| run | init s | blocks | states | phase | hit rate | p50 ms | total s | out tok/s | decode step ms |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for run in result["runs"]:
        for phase, r in run.get("phases", {}).items():
            tok_s = f"{r['output_tok_per_s']:.0f}" if "output_tok_per_s" in r else "-"
            step = f"{r['decode_step_ms_p50']:.1f}" if r.get("decode_step_ms_p50") else "-"
            print(f"| {run['model']}:{run['weights']}:{run['kv']} | {run['engine_init_s']:.0f} | "
                  f"{run['num_blocks']:,} | {run['checkpoint_states_that_fit']:,} | {phase} | {r['hit_rate']:.3f} | "
                  f"{r['p50_ms']:.0f} | {r['total_s']:.2f} | {tok_s} | {step} |")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
