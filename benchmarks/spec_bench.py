"""MTP speculative decoding: acceptance per draft position and decode tokens/s against MTP off.

    PYTHONPATH=. python benchmarks/spec_bench.py [--model-dir DIR] [--k 1 2 3] [--batch 1 8 64] [--max-tokens 128]
                                                 [--prompt-len 256] [--temperature 0] [--device cpu]
                                                 [--dtype bfloat16] [--disable-by-batch-size N] [--json OUT]
                                                 [--tensor-parallel-size N] [--mtp-first] [--chain-split]
                                                 [--ab-chain-graphs] [--profile-batch B ...]

One engine per k (MTP off, then each k; its start-up is the costly part), warmed up by a short generation, then for
each batch size b, from an empty cache: b requests (prompts cut from the model folder's `training_corpus.txt` when
`benchmarks/train_byte_lm.py --mtp-steps N` wrote it, else random bytes) are prefilled, then decoded to
`--max-tokens`; the decode time is the wall time from the first step that only decodes to the last. Acceptance:
accepted / fed draft tokens, and per draft position (drafts accepted at position j / verify rows); agree: the share
of MTP off's greedy tokens each completion repeats up to its first difference (`agreement`). Prints a table
(speedup: tokens/s over MTP off's at the same batch) and writes the rows as JSON, with the host's seconds per
phase of the steps (`phase_timers`). `--disable-by-batch-size N` adds
rows of k = 2 with the speculative config's `disable_by_batch_size` N at the batch sizes over N (steps there are
plain decode steps, overlapped by async scheduling). On CUDA in bf16 both use CUDA graphs (MTP's verify steps
too) and async scheduling: MTP's uniform greedy verify steps are queued before the step before is judged
(`engine/spec_chain.py`; `chained_steps` in the JSON counts them), other speculative steps run synchronously.
`--tensor-parallel-size N`: every engine (MTP off too) split over N ranks (the head sharded and drafting on every
rank; async scheduling on for MTP off's steps, as at N = 1 on CUDA; speculative steps synchronous).
Where a chained step's time goes: `--chain-split` records, per chained step, the host's milliseconds in each of its
phases and the device's span of the work it queued (CUDA events; `chain_split`), `--profile-batch B` runs batch B
once more under torch.profiler (the device's busy time and the host's launches per step; `device_profile`), and
`--ab-chain-graphs` runs each batch size twice in the MTP engine, first with the chained steps' glue eager
(`ModelRunner.without_chain_graphs`), then in its graphs (`spec_chain.ChainGraphs`, the default), and checks they
give the same tokens. `--mtp-first`
starts the MTP engines before MTP off's.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import logging
import random
import time
import traceback
from collections.abc import Iterator
from pathlib import Path

from hybridcache.config import EngineConfig
from hybridcache.engine.engine import LLMEngine
from hybridcache.engine.spec_chain import DeviceVerdicts
from hybridcache.models.builtin import ensure_builtin_model
from hybridcache.sampling import SamplingParams

CORPUS_FILE = "training_corpus.txt"


def prompts(model_dir: Path, count: int, length: int, seed: int = 0) -> list[list[int]]:
    """`count` prompts of `length` byte ids: windows of the training corpus when the folder has one."""
    rng = random.Random(seed)
    corpus = model_dir / CORPUS_FILE
    if corpus.is_file():
        data = corpus.read_bytes()
        return [list(data[s:s + length]) for s in (rng.randrange(len(data) - length) for _ in range(count))]
    return [[rng.randrange(256) for _ in range(length)] for _ in range(count)]


def make_engine(model_dir: Path, k: int | None, args: argparse.Namespace, limit: int | None = None) -> LLMEngine:
    """An engine with MTP k (None: off; `limit`: its disable_by_batch_size) for every batch size of the run
    (max_num_seqs = the largest), warmed up by one short generation (the first steps of a fresh engine build lazy
    state that no later step pays for)."""
    speculative = {"method": "mtp", "num_speculative_tokens": k, "disable_by_batch_size": limit} if k else None
    config = EngineConfig(block_size=64, max_num_seqs=max(args.batch), dtype=args.dtype,
                          max_model_len=args.prompt_len + args.max_tokens + 8,
                          max_num_batched_tokens=max(args.max_num_batched_tokens, args.prompt_len), device=args.device,
                          speculative_config=speculative, tensor_parallel_size=args.tensor_parallel_size,
                          async_scheduling=True if args.device.startswith("cuda") else None)
    engine = LLMEngine(model_dir, config)
    decode(engine, prompts(model_dir, 2, args.prompt_len, seed=1), min(16, args.max_tokens), args)
    return engine


def decode(engine: LLMEngine, batch_prompts: list[list[int]], max_tokens: int,
           args: argparse.Namespace) -> tuple[int, float, list[list[int]]]:
    """Run the prompts to `max_tokens` each from an empty cache; (decode tokens, seconds from the first step that
    only decodes to the last, each request's token ids)."""
    engine.clear_cache()
    params = SamplingParams(temperature=args.temperature, max_tokens=max_tokens, ignore_eos=True, seed=0)
    for i, prompt in enumerate(batch_prompts):
        engine.add_request(str(i), prompt, params)
    start = None
    generated = 0
    outputs = {}
    while engine.has_unfinished_requests():
        decoding = all(s.num_computed >= s.prompt_len for s in engine.scheduler.running) and engine.scheduler.running
        if decoding and start is None and not engine.scheduler.waiting:
            start, generated = time.perf_counter(), engine.num_decode_tokens
        outputs.update((out.request_id, list(out.outputs[0].token_ids)) for out in engine.step() if out.finished)
    seconds = time.perf_counter() - start if start is not None else float("nan")
    return engine.num_decode_tokens - generated, seconds, [outputs[str(i)] for i in range(len(batch_prompts))]


@contextlib.contextmanager
def phase_timers(engine: LLMEngine) -> Iterator[dict[str, float]]:
    """Wall seconds the engine's host spends in each phase of its steps (prefill included), by wrapping the engine's
    methods for the block: `schedule`, `launch` (inputs, forward launch; a speculative step's judging waits there for
    the logits, and for the drafting queued before the verdicts: `runner.draft_after_verify`), `complete`
    (postprocess; a speculative step's rollback and drafting), and within it `propose` (the head's passes, which
    wait for their drafts; only a transfer after a step drafted before its verdicts); async speculative steps
    (`engine/spec_chain.py`): `chained` (the whole `step()` of one), within it `chain_launch` (queueing the next
    verify step and its drafting) and `chain_wait` (waiting for a deferred step's device values: ~0 when the host
    is the bottleneck). Host time, not device time: a wait for the device counts where it happens."""
    totals = {"schedule": 0.0, "launch": 0.0, "complete": 0.0, "propose": 0.0, "chained": 0.0, "chain_launch": 0.0,
              "chain_wait": 0.0}
    targets = [(engine.scheduler, "schedule", "schedule"), (engine, "_launch", "launch"),
               (engine, "_complete", "complete")]
    if engine.drafter is not None:
        targets += [(engine.drafter, "propose", "propose"), (engine, "_step_chained", "chained"),
                    (engine, "_launch_chained", "chain_launch")]

    def timed(fn, name):
        def wrapper(*a, **kw):
            start = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                totals[name] += time.perf_counter() - start
        return wrapper

    for owner, attribute, name in targets:
        setattr(owner, attribute, timed(getattr(owner, attribute), name))
    result = DeviceVerdicts.result
    DeviceVerdicts.result = timed(result, "chain_wait")
    try:
        yield totals
    finally:
        DeviceVerdicts.result = result
        for owner, attribute, _ in targets:
            delattr(owner, attribute)  # the class's method again


@contextlib.contextmanager
def chain_split(engine: LLMEngine) -> Iterator[dict[str, list[float]]]:
    """Per async speculative step (`LLMEngine._step_chained`), host and device milliseconds, as lists (one entry a
    chained step): host `step` (the whole call), `launch` (`_launch_chained`: queueing t + 1's rollback, verify and
    drafting), `wait` (for t's device values), `settle` (`_complete_deferred` less its wait: judging, output
    processing, the scheduler's and the cache's accept, propose), `schedule` and `adopt` (`_adopt_chained`); device
    (CUDA events on the stream) `span` (from the first to the last work `_launch_chained` queued: the step's device
    time, plus any gap where the device waited for the host's next launch inside it) and `period` (from one chained
    launch's first work to the next's: the step as the device sees it). Empty lists off CUDA or without MTP."""
    times: dict[str, list[float]] = {name: [] for name in ("step", "launch", "wait", "settle", "schedule", "adopt",
                                                           "span", "period")}
    if engine.drafter is None or engine.device.type != "cuda":
        yield times
        return
    import torch

    events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
    inside = [False]
    originals = {name: getattr(engine, name) for name in ("_step_chained", "_launch_chained", "_complete_deferred",
                                                          "_adopt_chained")}
    wrapped = {name for name in originals if name in vars(engine)}  # (instance attributes: phase_timers')
    schedule = engine.scheduler.schedule
    outer_schedule = {"schedule"} if "schedule" in vars(engine.scheduler) else set()
    result = DeviceVerdicts.result

    def clocked(name, fn):
        def wrapper(*a, **kw):
            start = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                times[name].append((time.perf_counter() - start) * 1e3)
        return wrapper

    def step(*a, **kw):
        inside[0] = True
        try:
            return clocked("step", originals["_step_chained"])(*a, **kw)
        finally:
            inside[0] = False

    def launch(*a, **kw):
        first, last = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        first.record()
        try:
            return clocked("launch", originals["_launch_chained"])(*a, **kw)
        finally:
            last.record()
            events.append((first, last))

    def complete(*a, **kw):
        waited = len(times["wait"])
        start = time.perf_counter()
        try:
            return originals["_complete_deferred"](*a, **kw)
        finally:
            spent = (time.perf_counter() - start) * 1e3
            if kw.get("chained"):
                times["settle"].append(spent - sum(times["wait"][waited:]))

    def timed_result(self):
        if not inside[0]:
            return result(self)
        return clocked("wait", result)(self)

    def timed_schedule(*a, **kw):
        return clocked("schedule", schedule)(*a, **kw) if inside[0] else schedule(*a, **kw)

    engine._step_chained, engine._launch_chained = step, launch
    engine._complete_deferred, engine._adopt_chained = complete, clocked("adopt", originals["_adopt_chained"])
    engine.scheduler.schedule = timed_schedule
    DeviceVerdicts.result = timed_result
    try:
        yield times
    finally:
        DeviceVerdicts.result = result
        for name, fn in originals.items():  # (phase_timers' wrappers, when they are there, come back)
            if name in wrapped:
                setattr(engine, name, fn)
            else:
                delattr(engine, name)
        if outer_schedule:
            engine.scheduler.schedule = schedule
        else:
            del engine.scheduler.schedule
        torch.cuda.synchronize()
        times["span"] = [first.elapsed_time(last) for first, last in events]
        times["period"] = [a.elapsed_time(b) for (a, _), (b, _) in zip(events, events[1:], strict=False)]


def summary(values: list[float]) -> dict[str, float]:
    """Median, mean and count of a list of milliseconds."""
    if not values:
        return {"n": 0}
    ordered = sorted(values)
    return {"n": len(values), "median": ordered[len(values) // 2], "mean": sum(values) / len(values)}


def stats_snapshot(engine: LLMEngine) -> tuple[int, int]:
    """(verify rows, decode tokens) so far: `steps_of` counts the steps after it."""
    return (engine.drafter.stats.num_drafts if engine.drafter is not None else 0), engine.num_decode_tokens


def steps_of(engine: LLMEngine, before: tuple[int, int], batch: int) -> int:
    """Decode steps of `batch` sequences since `before`: verify rows (with MTP) or decode tokens per sequence."""
    rows, tokens = stats_snapshot(engine)
    return (rows - before[0] if engine.drafter is not None else tokens - before[1]) // batch


def device_profile(engine: LLMEngine, model_dir: Path, batch: int, args: argparse.Namespace) -> dict:
    """One more decode run of `batch` under torch.profiler (CUDA): the device's busy time (kernels, copies and
    memsets summed) and the host's launches, per decode step; the top device ops by time. Profiling slows the
    host, so the run's wall time is not reported."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    chained = engine.num_chained_steps
    before = stats_snapshot(engine)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        decode(engine, prompts(model_dir, batch, args.prompt_len, seed=3), args.max_tokens, args)
        torch.cuda.synchronize()
    steps = engine.num_chained_steps - chained
    averages = prof.key_averages()

    def device_us(event) -> float:  # (device events only: a host op's self device time repeats its kernels')
        if event.device_type != torch.autograd.DeviceType.CUDA:
            return 0.0
        return getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0.0)

    busy = sum(device_us(e) for e in averages)
    launches = {e.key: e.count for e in averages if e.key in (
        "cudaLaunchKernel", "cudaGraphLaunch", "cudaMemcpyAsync", "cudaLaunchKernelExC", "cuLaunchKernel",
        "cudaMemsetAsync", "cudaEventRecord", "cudaStreamSynchronize", "cudaEventSynchronize")}
    top = sorted(((e.key, device_us(e) / 1e3, e.count) for e in averages if device_us(e) > 0),
                 key=lambda item: -item[1])[:25]
    decode_steps = steps_of(engine, before, batch)
    return {"batch": batch, "chained_steps": steps, "decode_steps": decode_steps, "device_busy_ms": busy / 1e3,
            "device_busy_ms_per_step": busy / 1e3 / max(1, decode_steps),
            "host_calls_per_step": {key: count / max(1, decode_steps) for key, count in launches.items()},
            "top_device_ops_ms_count": top}


def measure(engine: LLMEngine, model_dir: Path, batch: int, args: argparse.Namespace) -> dict:
    """One row: decode tokens/s of `batch` requests on `engine`, and its acceptance counters over this run."""
    stats = engine.drafter.stats if engine.drafter is not None else None
    before = dataclasses.replace(stats, accepted_per_position=list(stats.accepted_per_position)) if stats else None
    chained = engine.num_chained_steps
    with phase_timers(engine) as phases, chain_split(engine) if args.chain_split else contextlib.nullcontext(
            {}) as split:
        tokens, seconds, token_ids = decode(engine, prompts(model_dir, batch, args.prompt_len), args.max_tokens, args)
    k = engine.drafter.k if engine.drafter is not None else 0
    row = {"k": k, "batch": batch, "decode_tokens": tokens, "decode_seconds": seconds,
           "decode_tokens_per_s": tokens / seconds if seconds else float("nan"), "token_ids": token_ids,
           "host_seconds": phases, "chained_steps": engine.num_chained_steps - chained}
    if split:
        row["chain_split_ms"] = {name: summary(values) for name, values in split.items()}
    if stats is not None:
        rows = stats.num_drafts - before.num_drafts
        fed = stats.num_draft_tokens - before.num_draft_tokens
        accepted = stats.num_accepted_tokens - before.num_accepted_tokens
        row.update(verify_rows=rows, draft_tokens=fed, accepted_tokens=accepted, acceptance=accepted / max(1, fed),
                   accepted_per_position=[(n - m) / max(1, rows) for n, m in
                                          zip(stats.accepted_per_position, before.accepted_per_position, strict=True)])
    return row


def measure_batches(engine: LLMEngine, model_dir: Path, k: int | None, limit: int | None, batches: list[int],
                    args: argparse.Namespace, rows: list[dict]) -> None:
    """The rows of one engine, appended to `rows` (and printed) as they are measured: each batch size (with
    `--ab-chain-graphs`, first with the chain's glue eager), then its profile when asked."""
    for batch in batches:
        if k and args.ab_chain_graphs:  # the same batch first with the chain's glue built eagerly (before)
            with engine.runner.without_chain_graphs():
                rows.append(measure(engine, model_dir, batch, args) | {"disable_by_batch_size": limit,
                                                                       "chain_graphs": False})
            print(json.dumps({key: v for key, v in rows[-1].items() if key != "token_ids"}), flush=True)
        rows.append(measure(engine, model_dir, batch, args) | {"disable_by_batch_size": limit})
        if k and args.ab_chain_graphs:
            rows[-1]["chain_graphs"] = True
            rows[-1]["same_tokens_as_eager_chain"] = rows[-1]["token_ids"] == rows[-2]["token_ids"]
        print(json.dumps({key: v for key, v in rows[-1].items() if key != "token_ids"}), flush=True)  # at once
        if k and batch in args.profile_batch and args.device.startswith("cuda"):
            try:
                rows[-1]["device_profile"] = device_profile(engine, model_dir, batch, args)
            except Exception:  # (a profiler failure costs only the profile)
                traceback.print_exc()
                continue
            print(json.dumps(rows[-1]["device_profile"]), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, default=None, help="default: the built-in model")
    parser.add_argument("--k", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="bfloat16", help="the model dtype (bfloat16: CUDA graphs on CUDA)")
    parser.add_argument("--disable-by-batch-size", type=int, default=None,
                        help="also run k = 2 with speculation off above this many sequences, at batch sizes over it")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--chain-split", action="store_true",
                        help="time each async speculative step's host phases and device span (`chain_split`)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048,
                        help="the engines' step budget (prompts prefill in steps of it; fewer prefill graphs)")
    parser.add_argument("--log", action="store_true", help="log the engines' start-up (INFO, with times)")
    parser.add_argument("--mtp-first", action="store_true", help="start the MTP engines before MTP off's")
    parser.add_argument("--ab-chain-graphs", action="store_true",
                        help="with MTP, run each batch size twice in the same engine: the async speculative steps' "
                             "glue eager (`runner.without_chain_graphs`), then in its graphs")
    parser.add_argument("--profile-batch", type=int, nargs="*", default=[],
                        help="with MTP, one more run of these batch sizes under torch.profiler (`device_profile`)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.log:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    model_dir = args.model_dir or ensure_builtin_model()
    rows = []
    runs = [(k, None, args.batch) for k in ([*args.k, None] if args.mtp_first else [None, *args.k])]
    limit = args.disable_by_batch_size
    if limit is not None:  # MTP turned off above `limit`, at the batch sizes over it (right after the first k)
        runs.insert(1 if args.mtp_first else 2, (2 if 2 in args.k else args.k[0], limit,
                                                 [b for b in args.batch if b > limit]))
    for k, limit, batches in runs:  # one engine per k (its start-up is the expensive part), every batch size on it
        started = time.perf_counter()
        engine = make_engine(model_dir, k, args, limit)
        print(f"k={k or 0}: engine up in {time.perf_counter() - started:.1f} s", flush=True)
        try:
            measure_batches(engine, model_dir, k, limit, batches, args, rows)
        except Exception:  # (the rows so far are kept; the next engine still runs)
            traceback.print_exc()
            print(f"k={k or 0}: failed; its remaining batch sizes are not measured", flush=True)
        with contextlib.suppress(Exception):
            engine.close()
        del engine
        gc.collect()
        write_json(args, model_dir, rows)
    base = {row["batch"]: row for row in rows if row["k"] == 0}
    for row in rows:
        if row["batch"] in base:
            row["speedup"] = row["decode_tokens_per_s"] / base[row["batch"]]["decode_tokens_per_s"]
            row["tokens_agree"] = agreement(row["token_ids"], base[row["batch"]]["token_ids"])
    for row in rows:
        del row["token_ids"]  # (kept out of the JSON)
    rows.sort(key=lambda row: (row["batch"], row["k"], row.get("chain_graphs", True)))
    print(f"{'batch':>5} {'k':>2} {'off above':>9} {'graphs':>6} {'tok/s':>9} {'speedup':>8} {'agree':>6} "
          f"{'accept':>7} {'ms/step':>7}  per position")
    for row in rows:
        per = " ".join(f"{p:.2f}" for p in row.get("accepted_per_position", []))
        limit = row["disable_by_batch_size"] if row["disable_by_batch_size"] is not None else "-"
        graphs = {True: "on", False: "off"}.get(row.get("chain_graphs"), "-")
        steps = (row.get("verify_rows") or row["decode_tokens"]) / row["batch"]
        nan = float("nan")
        print(f"{row['batch']:>5} {row['k']:>2} {limit:>9} {graphs:>6} {row['decode_tokens_per_s']:>9.1f} "
              f"{row.get('speedup', nan):>8.2f} {row.get('tokens_agree', nan):>6.1%} {row.get('acceptance', nan):>7.2f}"
              f" {1e3 * row['decode_seconds'] / max(1.0, steps):>7.2f}  {per}")
    write_json(args, model_dir, rows)


def agreement(token_ids: list[list[int]], reference: list[list[int]]) -> float:
    """The share of the reference's tokens that each completion repeats up to its first difference (greedy MTP on
    against off: a bf16 near-tie flips a token, and everything after it counts as disagreeing)."""
    same = sum(next((j for j, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))
               for mine, theirs in zip(token_ids, reference, strict=True))
    return same / max(1, sum(map(len, reference)))


def write_json(args: argparse.Namespace, model_dir: Path, rows: list[dict]) -> None:
    """The rows so far (and the options) to `--json`, when given, without their token ids."""
    if args.json is not None:
        rows = [{key: value for key, value in row.items() if key != "token_ids"} for row in rows]
        args.json.write_text(json.dumps({"model_dir": str(model_dir), "options": vars(args) | {
            "model_dir": str(model_dir), "json": str(args.json)}, "rows": rows}, indent=1, default=str))


if __name__ == "__main__":
    main()
