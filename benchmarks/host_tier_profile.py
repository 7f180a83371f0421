"""Where a request that hits the host tier spends its milliseconds, against the same request recomputed without a
tier (issue 30): one process, two engines of the same model and pool, the same phase-A traffic, the same requests
profiled.

    PYTHONUNBUFFERED=1 PYTHONPATH=. python benchmarks/host_tier_profile.py [--model next-1b] [--num-blocks 1000]
        [--host-cache-gib 16] [--turns 4] [--ch 2] [--enforce-eager] [--device cuda] [--model-dir DIR] [--out DIR]
    PYTHONPATH=. python benchmarks/host_tier_profile.py --model tiny --device cpu --scale 0.05 --num-blocks 200 \
        --host-cache-gib 0.05       # the CPU smoke test
    python benchmarks/host_tier_profile.py --from-json DIR/host_tier_profile_next-1b.json   # the tables again
    # the engine's own work per request on the CPU, next-1b's proportions (a state = 51 blocks), no forward
    PYTHONPATH=. python benchmarks/host_tier_profile.py --model tiny-state50 --device cpu --stub-forward \
        --num-blocks 1000 --host-cache-gib 2 --ch 0

For each engine, first with a host tier of `--host-cache-gib` behind a pool of `--num-blocks`, then with none:

1. A warm-up (`gpu_bench.warm_up`), then `--turns` turns of phase A's sessions (`gpu_bench.phase_a`'s workload and
   prompts, the same seed: 4 system prompts of 2,000 tokens, 16 sessions, one request at a time, 1 new token
   each; 4 turns are gpu_bench's phase A, summarised as it does), timed: with the tier the pool fills in turn 0
   and demotes from then on, and later turns hit the host. From the first turn on every request is also timed by
   part, with no synchronisation added (`Parts`: schedule, launch and the host-tier copies' calls within it, the
   wait for the sampled token, completing, garbage collection).
2. The next turn's requests, timed without a profiler: `hit` (sessions 1-7: their prefix is on the host with the
   tier, recomputed without) and `fresh` (4 unrelated prompts of the same lengths: no hit; they still demote with
   the tier).
3. One `hit` request (session 0) and one `fresh` request under torch.profiler: each operator's host (self CPU) ms,
   device ms and calls (and, with `--traces 1`, the hit's timeline as a gzipped Chrome trace, DIR/trace_<tier|none>
   _hit.json.gz); then one more `hit` request under cProfile (the host's Python by function).
4. With the tier only, after `clear_cache` (every block of both tiers free, so nothing cached is touched): the
   engine's own host pool checked (pinned or not) and timed directly, one HOST_SAVE and one HOST_LOAD of
   `--copy-blocks` blocks, once as one run of consecutive host ids and once as one run per block: the host's ms
   inside the call (a call that returns only when its copy is done is a synchronous copy) and the ms until the
   device is done, against a fresh pinned buffer's host -> device bandwidth (`measure_copy_rates`).

Before step 4, `--ch` rounds (2) of phase CH on the same engine: a cold 16,000-token prompt, `--ch-fillers`
unrelated ones that push its prefix off the pool (a pool of 1,000 blocks holds three such prompts with their
states, not four), then the prompt + 200 tokens: a host hit of its 16,000-token prefix with the tier, a recompute
without (the second round's + 200 request meets no shape for the first time).

Then one table of every operator for hit-with-tier against hit-without (the recompute) and fresh-with against
fresh-without, largest difference first: what a host hit pays that recomputing does not.

Prints the tables; writes DIR/host_tier_profile_<model>.json and DIR/host_tier_profile_<model>.txt (what it
printed; DIR: --out, else $OUT, else .), both after each step, so a run cut by a time limit keeps what it
measured (`--from-json` prints the comparison from a JSON with both engines' profiles). `--enforce-eager`: the
measured requests are prefills of one new token, which replay no decode graph, so the engines may skip capturing
them (start-up time).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import gzip
import io
import json
import os
import pstats
import random
import statistics
import string
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_bench import MODELS, SCALE, letters, model_folder, timed, warm_up  # noqa: E402

from hybridcache import LLM  # noqa: E402
from hybridcache.copy_kinds import Pool  # noqa: E402
from hybridcache.engine.host_pool import measure_copy_rates  # noqa: E402
from hybridcache.sampling import PendingSample  # noqa: E402

# next-1b's proportions on the CPU: a state of 51 blocks (KV 8 KiB a block, DeltaNet state 388 KiB), tiny compute;
# with --stub-forward the engine does everything but the model's forward (`stub_forward`)
MODELS.setdefault("tiny-state50", ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(
    vocab_size=320, hidden_size=64, num_hidden_layers=4, num_experts=4, num_experts_per_tok=2,
    moe_intermediate_size=32, shared_expert_intermediate_size=32, intermediate_size=64, num_attention_heads=2,
    num_key_value_heads=1, head_dim=16, linear_num_key_heads=1, linear_num_value_heads=8, linear_key_head_dim=64,
    linear_value_head_dim=64)))
HOST_COUNTERS = ("num_host_hits", "num_host_hit_tokens", "num_promoted_checkpoints", "num_promoted_blocks",
                 "num_demoted_checkpoints", "num_demoted_blocks", "num_promotions_skipped", "num_host_dropped")
OUT_LINES: list[str] = []  # what `say` printed, written to the .txt at the end


def say(text: str = "") -> None:
    """Print now and keep it for the text file."""
    print(text, flush=True)
    OUT_LINES.append(text)


def host_counters(llm: LLM) -> dict[str, int]:
    stats = llm.engine.stats()["cache"]
    return {name: getattr(stats, name, 0) for name in HOST_COUNTERS}


class Traffic:
    """Phase A's sessions (`gpu_bench.phase_a`), replayed identically for each engine (the same seed)."""

    def __init__(self, seed: int = 0) -> None:
        self.rng = random.Random(seed)
        systems = [letters(self.rng, 2000) for _ in range(4)]
        self.history = [systems[i % 4] for i in range(16)]

    def prompt(self, session: int) -> str:
        """The session's next prompt (its history + a new user message); the history grows by a reply after it."""
        prompt = self.history[session] + letters(self.rng, self.rng.randint(200, 600))
        self.history[session] = prompt + letters(self.rng, self.rng.randint(100, 300))
        return prompt


class Parts:
    """Wall seconds of the parts of the engine's steps, with no synchronisation added (so nothing moves): the
    scheduler (admission, eviction, demotion and promotion, the plan), the launch (inputs, the copies and the
    forward queued, sampling queued), within it the host-tier copies' calls (`host copies`: queueing HOST_SAVE,
    HOST_LOAD and HOST_FINISH; a copy that blocks the host shows here), the wait for the sampled token
    (`PendingSample.result`: the device work the host did not hide), completing steps (the wait included) and the
    garbage collector's pauses (`gc.callbacks`). One engine's at a time: the newest `Parts` counts the waits (a
    class-wide hook)."""

    current: Parts | None = None

    def __init__(self, engine) -> None:
        self.seconds: dict[str, float] = dict.fromkeys(
            ("schedule", "launch", "host copies", "wait", "complete", "gc"), 0.0)
        for owner, name, key in ((engine.scheduler, "schedule", "schedule"), (engine, "_launch", "launch"),
                                 (engine, "_complete", "complete")):
            setattr(owner, name, self._timed(getattr(owner, name), key))
        runner = engine.runner
        copy, host_copy = runner._copy, self._timed(runner._copy, "host copies")
        runner._copy = lambda op: host_copy(op) if op.kind.pool is Pool.HOST else copy(op)
        if Parts.current is None:  # hook the class once; each wait counts for the newest Parts
            inner = PendingSample.result

            def result(sample):
                start = time.perf_counter()
                try:
                    return inner(sample)
                finally:
                    Parts.current.seconds["wait"] += time.perf_counter() - start

            PendingSample.result = result
        Parts.current = self
        self._gc_start = 0.0
        gc.callbacks.append(self._gc)

    def _timed(self, inner, key: str):
        def timed_call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds[key] += time.perf_counter() - start
        return timed_call

    def _gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        else:
            self.seconds["gc"] += time.perf_counter() - self._gc_start

    def close(self) -> None:
        gc.callbacks.remove(self._gc)

    def snapshot(self) -> dict[str, float]:
        return dict(self.seconds)


PARTS: dict[int, Parts] = {}  # id(engine) -> its parts


def request(llm: LLM, prompt: str) -> dict:
    """One request of 1 new token: wall ms, cached tokens, host counters it moved, ms by part (`Parts`: complete
    includes the wait)."""
    parts = PARTS.get(id(llm.engine))
    before, parts_before = host_counters(llm), parts.snapshot() if parts else {}
    seconds, out = timed(llm, [prompt], 1)
    after = host_counters(llm)
    row = {"ms": 1000 * seconds, "cached": out[0].num_cached_tokens, "prompt": len(out[0].prompt_token_ids),
           "host": {name: after[name] - before[name] for name in HOST_COUNTERS if after[name] != before[name]}}
    if parts:
        row["parts_ms"] = {key: round(1000 * (value - parts_before[key]), 2) for key, value in parts.seconds.items()}
    return row


def parts_p50(rows: list[dict]) -> str:
    """The median ms of each part over `rows`."""
    keys = rows[0].get("parts_ms", {})
    return ", ".join(f"{key} {statistics.median(r['parts_ms'][key] for r in rows):.2f}" for key in keys)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def stub_forward(llm: LLM) -> None:
    """Replace the model's forward with zero logits: what is left of a request is the engine's own work (the
    scheduler and cache, the inputs, the copies, sampling, completion), host tier or not."""
    runner, vocab = llm.engine.runner, llm.engine.model_config.vocab_size

    def zeros(batch):
        return torch.zeros((batch.num_seqs, vocab), device=runner.device)

    runner._run_model = zeros


def phase_a_summary(rows: list[dict]) -> dict:
    """gpu_bench's summary of phase A (`gpu_bench.summary`) from `request` rows: hit rate, p50, p95, max (ms), and
    the host counters the requests moved."""
    ordered = sorted(r["ms"] for r in rows)
    moved: dict[str, int] = {}
    for r in rows:
        for name, value in r["host"].items():
            moved[name] = moved.get(name, 0) + value
    hit_rate = sum(r["cached"] for r in rows) / sum(r["prompt"] for r in rows)
    p95 = ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]
    return {"requests": len(rows), "hit_rate": round(hit_rate, 3), "p50_ms": round(statistics.median(ordered), 1),
            "p95_ms": round(p95, 1), "max_ms": round(ordered[-1], 1), "host": moved}


def pool_copies(llm: LLM, num_blocks: int) -> dict:
    """Step 4 of the module docstring: the engine's host pool, pinned or not, and one save and one load of
    `num_blocks` free blocks, consecutive host ids against one run per block."""
    engine = llm.engine
    pool, device = engine.runner.host_pool, engine.runner.device
    life = engine.scheduler.cache._life  # the free blocks of either tier: what no cached item holds
    free_host = sorted(life.host.pool.free_ids())
    free_device = life.blocks.free_ids()
    n = min(num_blocks, len(free_device), len(free_host) // 2)
    result: dict = {"pinned": bool(pool.blocks.is_pinned()), "host_blocks": pool.num_blocks,
                    "block_bytes": pool.blocks.shape[1] * pool.blocks.element_size(), "blocks_per_copy": n}
    bandwidth, _flops = measure_copy_rates(device, torch.bfloat16)
    result["fresh_pinned_h2d_gb_s"] = bandwidth / 1e9
    if n < 2:
        result["error"] = f"only {n} free blocks"
        return result
    device_ids = torch.tensor(free_device[:n], dtype=torch.int64, device=device)
    layouts = {"one run": free_host[:n], "a run per block": free_host[:2 * n:2]}
    for layout, host_ids in layouts.items():
        for kind, call in (("save", lambda ids=host_ids: pool.save(device_ids, ids)),
                           ("load", lambda ids=host_ids: pool.load(ids, device_ids))):
            times = []
            for _ in range(3):
                sync(device)
                start = time.perf_counter()
                call()
                returned = time.perf_counter()
                sync(device)
                times.append((returned - start, time.perf_counter() - start))
            host_s, total_s = min(times, key=lambda t: t[1])
            nbytes = n * result["block_bytes"]
            result[f"{kind} ({layout})"] = {"host_ms": 1000 * host_s, "total_ms": 1000 * total_s,
                                            "gb_s": nbytes / total_s / 1e9}
    return result


def op_table(prof) -> dict[str, dict[str, float]]:
    """{operator: {host_ms, device_ms, calls}} of a torch.profiler run (self times: nothing is counted twice)."""
    table: dict[str, dict[str, float]] = {}
    for event in prof.key_averages():
        device_us = getattr(event, "self_device_time_total", None)
        if device_us is None:
            device_us = getattr(event, "self_cuda_time_total", 0)
        table[event.key] = {"host_ms": event.self_cpu_time_total / 1000, "device_ms": device_us / 1000,
                            "calls": event.count}
    return table


def profiled(llm: LLM, prompt: str, device: torch.device, trace: Path | None) -> tuple[dict, dict]:
    """One request under torch.profiler: (its `request` row, its `op_table`); its timeline to `trace` (a Chrome
    trace: where the host waited and the device idled) unless None."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync(device)
    with profile(activities=activities) as prof:
        row = request(llm, prompt)
        sync(device)
    if trace is not None:
        with tempfile.TemporaryDirectory() as folder:
            raw = Path(folder) / "trace.json"
            prof.export_chrome_trace(str(raw))
            with gzip.open(trace, "wb") as out:
                out.write(raw.read_bytes())
    return row, op_table(prof)


def python_profile(llm: LLM, prompt: str, rows: int = 25) -> tuple[dict, str]:
    """One request under cProfile: (its `request` row, the top functions by cumulative time)."""
    profiler = cProfile.Profile()
    profiler.enable()
    row = request(llm, prompt)
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(rows)
    return row, text.getvalue()


def phase_ch(llm: LLM, rng: random.Random, fillers: int) -> dict:
    """Phase CH on this engine: a cold 16,000-token prompt, `fillers` unrelated 16,000-token prompts (which push
    its prefix off the pool: to the host with the tier, out of the cache without), then the prompt + 200 tokens."""
    prompt = letters(rng, 16000)
    cold = request(llm, prompt)
    filled = [request(llm, letters(rng, 16000)) for _ in range(fillers)]
    warm = request(llm, prompt + letters(rng, 200))
    say(f"CH: cold {cold['ms']:.1f} ms; fillers {[round(r['ms'], 1) for r in filled]} ms; + 200 {warm['ms']:.1f} "
        f"ms, cached {warm['cached']} of {warm['prompt']}, host {warm['host']}")
    return {"cold": cold, "fillers": filled, "warm": warm}


def run_engine(args: argparse.Namespace, folder: Path, host_gib: float, result: dict, save) -> None:
    """Steps 1-4 of the module docstring on one engine (a host tier of `host_gib`, or none for 0), into `result`;
    `save()` after each step (a run stopped by a time limit keeps what it measured)."""
    device = torch.device(args.device)
    start = time.perf_counter()
    llm = LLM(folder, dtype="bfloat16" if device.type == "cuda" else "float32", device=args.device, block_size=64,
              max_num_seqs=64, max_num_batched_tokens=16384, num_blocks=args.num_blocks, host_cache_gib=host_gib,
              max_model_len=args.max_model_len, enforce_eager=args.enforce_eager)
    name = f"host {host_gib:g} GiB" if host_gib else "no host tier"
    result.update(host_cache_gib=host_gib, engine_init_s=time.perf_counter() - start,
                  memory=llm.engine.memory_plan.describe())
    say(f"\n## {name}: engine start-up {result['engine_init_s']:.1f} s; {result['memory']}")
    if args.stub_forward:
        stub_forward(llm)
    warm_up(llm, random.Random(99))
    PARTS[id(llm.engine)] = parts = Parts(llm.engine)
    traffic = Traffic()
    turns = []
    for turn in range(args.turns):
        rows = [request(llm, traffic.prompt(session)) for session in range(16)]
        turns.append(rows)
        say(f"turn {turn}: p50 {statistics.median(r['ms'] for r in rows):.1f} ms (parts p50: {parts_p50(rows)}), "
            f"cached p50 {statistics.median(r['cached'] for r in rows):.0f}, ms {[round(r['ms']) for r in rows]}")
    result["turns"] = turns
    result["phase_a"] = phase_a_summary([r for rows in turns for r in rows])
    say(f"A ({name}, {args.turns} turns): {json.dumps(result['phase_a'])}")
    save()
    prompts = {session: traffic.prompt(session) for session in range(8)}
    fresh_rng = random.Random(7)  # unrelated prompts of the hit prompts' lengths (already scaled)
    fresh = ["".join(fresh_rng.choices(string.ascii_lowercase, k=len(prompts[s]))) for s in range(5)]
    unprofiled = {"hit": [request(llm, prompts[s]) for s in range(1, 8)],
                  "fresh": [request(llm, p) for p in fresh[1:]]}
    result["unprofiled"] = unprofiled
    for kind, rows in unprofiled.items():
        say(f"{kind}: p50 {statistics.median(r['ms'] for r in rows):.1f} ms (parts p50: {parts_p50(rows)}), ms "
            f"{[round(r['ms'], 1) for r in rows]}, cached {[r['cached'] for r in rows]}, host "
            f"{[r['host'] for r in rows]}")
    result["profiled"] = {}
    for kind, prompt in (("hit", prompts[0]), ("fresh", fresh[0])):
        trace = None
        if args.traces and kind == "hit":
            trace = Path(args.out_dir) / f"trace_{'tier' if host_gib else 'none'}_hit.json.gz"
        row, table = profiled(llm, prompt, device, trace)
        result["profiled"][kind] = {"request": row, "ops": table}
        say(f"{kind} under torch.profiler: {row}")
    row, text = python_profile(llm, traffic.prompt(0))
    result["python_profile"] = {"request": row, "top": text}
    say(f"one more session-0 request under cProfile: {row}\n{text}")
    save()
    result["ch"] = []
    for round_ in range(args.ch):  # the first round also meets its shapes first (a 200-token chunk on a 16,000-token
        # context with the tier), so its + 200 request may pay a first-time cost the second does not
        result["ch"].append(phase_ch(llm, random.Random(11 + round_), args.ch_fillers))
        save()
    result["host_counters"] = host_counters(llm)
    if host_gib and llm.engine.runner.host_pool is not None:
        llm.engine.clear_cache()  # every block of both tiers free: the timed copies touch nothing cached
        result["pool_copies"] = copies = pool_copies(llm, args.copy_blocks)
        timings = "; ".join(f"{key} host {v['host_ms']:.2f} total {v['total_ms']:.2f} ms {v['gb_s']:.1f} GB/s"
                            for key, v in copies.items() if isinstance(v, dict))
        say(f"host pool: pinned {copies['pinned']}, {copies['host_blocks']} blocks of {copies['block_bytes']} B, "
            f"{copies['blocks_per_copy']} per copy; a fresh pinned buffer {copies['fresh_pinned_h2d_gb_s']:.1f} GB/s; "
            f"{timings}{copies.get('error', '')}")
    save()
    parts.close()
    llm.close()
    del llm
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def compare(tier: dict, none: dict, kind: str, rows: int) -> list[dict]:
    """Every operator of the `kind` request with and without the tier, the largest |difference| (host + device)
    first; prints the top `rows`."""
    with_ops, without_ops = tier["profiled"][kind]["ops"], none["profiled"][kind]["ops"]
    zero = {"host_ms": 0.0, "device_ms": 0.0, "calls": 0}
    table = []
    for op in set(with_ops) | set(without_ops):
        a, b = with_ops.get(op, zero), without_ops.get(op, zero)
        table.append({"op": op, "host_ms": (a["host_ms"], b["host_ms"]), "device_ms": (a["device_ms"], b["device_ms"]),
                      "calls": (a["calls"], b["calls"]),
                      "diff_ms": (a["host_ms"] - b["host_ms"]) + (a["device_ms"] - b["device_ms"])})
    table.sort(key=lambda r: -abs(r["diff_ms"]))
    request_with, request_without = tier["profiled"][kind]["request"], none["profiled"][kind]["request"]
    say(f"\n### `{kind}` request: with the tier {request_with['ms']:.1f} ms (cached {request_with['cached']}), "
        f"without {request_without['ms']:.1f} ms (cached {request_without['cached']}), under torch.profiler")
    for side, ops in (("with", with_ops), ("without", without_ops)):
        say(f"totals {side} the tier: host (self CPU) {sum(o['host_ms'] for o in ops.values()):.1f} ms, device "
            f"{sum(o['device_ms'] for o in ops.values()):.1f} ms, {sum(o['calls'] for o in ops.values())} calls")
    say("| operator | host ms with / without | device ms with / without | calls with / without | diff ms |\n"
        "| --- | --- | --- | --- | --- |")
    for r in table[:rows]:
        say(f"| {r['op'][:60]} | {r['host_ms'][0]:.2f} / {r['host_ms'][1]:.2f} | {r['device_ms'][0]:.2f} / "
            f"{r['device_ms'][1]:.2f} | {r['calls'][0]} / {r['calls'][1]} | {r['diff_ms']:+.2f} |")
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="next-1b", choices=list(MODELS))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--num-blocks", type=int, default=1000)
    parser.add_argument("--host-cache-gib", type=float, default=16.0)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--turns", type=int, default=4,
                        help="phase A turns before the measured requests (4: all of gpu_bench's phase A)")
    parser.add_argument("--copy-blocks", type=int, default=128, help="blocks per timed HostPool save or load")
    parser.add_argument("--rows", type=int, default=30, help="operators printed per comparison")
    parser.add_argument("--ch", type=int, default=2, help="rounds of phase CH after the profiles (0: none)")
    parser.add_argument("--ch-fillers", type=int, default=3, help="16,000-token prompts between CH's two")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="no decode graphs (the measured requests are prefills of 1 new token: none replay)")
    parser.add_argument("--stub-forward", action="store_true",
                        help="zero logits instead of the model's forward (the engine's own work alone; eager steps)")
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every prompt length (smoke tests)")
    parser.add_argument("--model-dir", default=None)
    parser.add_argument("--out", default=None)
    parser.add_argument("--traces", type=int, default=1, help="1: Chrome traces of the profiled hit requests in DIR")
    parser.add_argument("--from-json", default=None,
                        help="print the comparison tables of an earlier run's JSON (one cut after both profiles)")
    args = parser.parse_args()
    if args.from_json:
        result = json.loads(Path(args.from_json).read_text())
        for kind in ("hit", "fresh"):
            compare(result["tier"], result["none"], kind, args.rows)
        return
    if args.host_cache_gib <= 0:
        parser.error("--host-cache-gib must be > 0 (the run without a tier is the second engine)")
    SCALE["value"] = args.scale
    out_dir = Path(args.out or os.environ.get("OUT") or ".")
    out_dir.mkdir(parents=True, exist_ok=True)
    args.out_dir = str(out_dir)
    json_path, text_path = (out_dir / f"host_tier_profile_{args.model}.{ext}" for ext in ("json", "txt"))
    folder = model_folder(args.model, args.model_dir)
    result: dict = {"model": args.model, "num_blocks": args.num_blocks, "turns": args.turns}

    def save() -> None:
        json_path.write_text(json.dumps(result, indent=1, default=str))
        text_path.write_text("\n".join(OUT_LINES) + "\n")

    for key, gib in (("tier", args.host_cache_gib), ("none", 0.0)):
        result[key] = {}
        run_engine(args, folder, gib, result[key], save)
    result["compare"] = {kind: compare(result["tier"], result["none"], kind, args.rows) for kind in ("hit", "fresh")}
    save()
    print(f"wrote {json_path} and {text_path}")


if __name__ == "__main__":
    main()
