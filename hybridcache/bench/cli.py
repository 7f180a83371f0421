"""`hybridcache simulate` (the cache simulator, no torch) and `hybridcache bench` (the engine benchmark)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from hybridcache.arg_types import (
    gib_or_multiple,
    human_readable_int,
    model_len,
    non_negative_int,
    positive_float,
    positive_floats,
    positive_int,
)
from hybridcache.config import CACHE_MODES, DTYPES, SSM_DTYPE_FLAG
from hybridcache.engine_args import AUTO, HelpFormatter
from hybridcache.extras import require_extra
from hybridcache.model_path import resolve_model

if TYPE_CHECKING:
    from hybridcache.bench.simulator import SimConfig
    from hybridcache.bench.workloads import Workload
    from hybridcache.engine.cost_model import ModelCost

SWEEP_FACTORS = (0.125, 0.25, 0.5, 1.0, 2.0)
_MODEL_FORMS = ("a model folder, a Hugging Face snapshot folder, or a hub id (from the local Hugging Face cache, "
                "downloaded into it when missing unless HF_HUB_OFFLINE=1)")


def register(subparsers) -> None:
    sim = subparsers.add_parser("simulate", help="replay a workload through the prefix cache under several policies",
                                formatter_class=HelpFormatter, allow_abbrev=False)
    sim.add_argument("--workload", required=True,
                     help="sharegpt, mooncake, swe-agent, shared-prefix, group-sampling[-n]")
    sim.add_argument("--trace", default=None,
                     help="trace file or folder (default: the slice shipped in hybridcache/bench/traces/; "
                     "sharegpt has none)")
    sim.add_argument("--num-requests", type=positive_int, default=None,
                     help="requests taken from the workload, in order (default: all of it)")
    sim.add_argument("--policies", default="none,block-aligned,seed,hybridcache,hybridcache+flop,oracle",
                     help="comma-separated, of none, block-aligned, seed, hybridcache, hybridcache+flop, "
                     "hybridcache+all, oracle, bounded-oracle, reuse-oracle; NAME:B runs a policy at block size B "
                     "(e.g. block-aligned:528)")
    sim.add_argument("--memory-gib", type=positive_float, default=1.0,
                     help="cache memory: KV blocks + checkpoint states")
    sim.add_argument("--model", default=None, help=f"the model whose config.json sizes the cache: {_MODEL_FORMS} "
                     "(default: built-in)")
    sim.add_argument(SSM_DTYPE_FLAG, default=AUTO, choices=[AUTO, *DTYPES],
                     help="the recurrent state's dtype in the state slots (sizes each checkpoint), as the engine's "
                          "option of that name; auto: the model config's mamba_ssm_dtype, else float32")
    sim.add_argument("--host-memory-gib", type=gib_or_multiple, default="0",
                     help="a host tier behind the cache memory of the engine's policies (hybridcache*; not the "
                          "oracles): GiB, or NX for N times the cache memory (4x); 0: none")
    sim.add_argument("--host-bandwidth-gbs", type=positive_float, default=None,
                     help="host -> device copy bandwidth, GB/s: a promotion is skipped when its copy takes longer "
                          "than recomputing (default: copies are free)")
    sim.add_argument("--device-tflops", type=positive_float, default=400.0,
                     help="the device's prefill rate, TFLOP/s (read with --host-bandwidth-gbs)")
    sim.add_argument("--block-size", type=positive_int, default=64, help="tokens per KV block")
    sim.add_argument("--chunk-budget", type=positive_int, default=8192, help="prefill tokens per chunk")
    sim.add_argument("--kv-tokens-per-slot", type=positive_int, default=2048,
                     help="block-aligned and seed (engines with a separate state pool): the budget holds one "
                          "checkpoint slot per this many KV tokens; the hybridcache policies and the bounded oracles "
                          "keep checkpoint states in KV blocks, as the engine does")
    sim.add_argument("--seed", type=non_negative_int, default=0,
                     help="seed of the workloads drawn at random")
    sim.add_argument("--json", default=None, help="write the results as JSON here")
    sim.add_argument("--plot", default=None, help="write a PNG of hit rate vs memory (runs a sweep) here")
    sim.add_argument("--sweep", type=positive_floats, default=None,
                     help="run a sweep over these memory points in GiB (the JSON's `sweep`; with --plot, its "
                          "points; default with --plot: budget x " + ",".join(str(f) for f in SWEEP_FACTORS) + ")")
    sim.add_argument("--jobs", type=positive_int, default=None,
                     help="worker processes (one group of policies per worker; default: the CPU count)")
    sim.add_argument("--no-progress", action="store_true", help="no progress bar")
    sim.add_argument("--replicas", type=positive_int, default=None,
                     help="simulate this many replicas of the hybridcache policy (each with --memory-gib and "
                          "--host-memory-gib) behind a router instead of one cache (--policies is then ignored; "
                          "--plot, --sweep and --jobs are refused)")
    sim.add_argument("--routing", default="round-robin,session,kv-prefix,checkpoint",
                     help="with --replicas: comma-separated routing policies, of round-robin, session, kv-prefix, "
                          "checkpoint")
    sim.set_defaults(func=cmd_simulate)

    bench = subparsers.add_parser("bench", help="run a workload through the engine in several cache modes",
                                  formatter_class=HelpFormatter, allow_abbrev=False)
    bench.add_argument("--workload", default="swe-agent",
                       help="a workload name, as for simulate")
    bench.add_argument("--trace", default=None,
                       help="trace file or folder (default: the slice shipped in hybridcache/bench/traces/)")
    bench.add_argument("--modes", type=cache_modes, default="none,block-aligned,hybridcache",
                       help="comma-separated cache modes, of none, block-aligned, seed, hybridcache")
    bench.add_argument("--model", default=None, help=f"{_MODEL_FORMS} (default: the built-in model)")
    bench.add_argument("--num-sessions", type=positive_int, default=8,
                       help="chat workloads: sessions")
    bench.add_argument("--max-turns", type=positive_int, default=3,
                       help="chat workloads: model calls per session")
    bench.add_argument("--max-message-chars", type=positive_int, default=200,
                       help="chat workloads: characters kept of each message")
    bench.add_argument("--max-prompt-len", type=positive_int, default=2048,
                       help="chat workloads: a session ends before a call whose prompt + reply would pass this")
    bench.add_argument("--num-requests", type=positive_int, default=None,
                       help="model calls taken from the workload, in order (default: all of it)")
    bench.add_argument("--max-reply-tokens", type=positive_int, default=32,
                       help="new tokens per model call at most")
    bench.add_argument("--seed", type=non_negative_int, default=0,
                       help="seed of the workload's random parts (sessions' start gaps and think times)")
    bench.add_argument("--block-size", type=positive_int, default=64,
                       help="tokens per KV block")
    bench.add_argument("--max-num-seqs", type=positive_int, default=16,
                       help="sequences running at once")
    bench.add_argument("--max-num-batched-tokens", type=human_readable_int, default=512,
                       help="token budget of one step (also 2k, 2K)")
    bench.add_argument("--num-blocks", type=positive_int, default=None,
                       help="blocks in the pool of KV and checkpoint states (default: the engine's)")
    bench.add_argument("--max-model-len", type=model_len, default=None,
                       help="the engine's max_model_len, as serve's: 32k, 32K, auto (default: the engine's: the "
                            "model's length, at most 8,192 "
                            "on the CPU); a call whose prompt + max_tokens passes it is dropped, and the table says "
                            "how many (with --server: the server's, from /v1/models)")
    bench.add_argument(
        "--server", default=None,
        help="URL of a running `hybridcache serve` to benchmark over HTTP instead of the offline engine "
        "(--modes is then ignored: the server runs one mode; --model must name the server's model)",
    )
    bench.add_argument("--concurrency", type=positive_int, default=64, help="with --server: requests in flight at most")
    bench.add_argument("--out-dir", default="results",
                       help="where the JSON and PNGs go (a folder, created if missing; checked before the run)")
    bench.add_argument("--no-progress", action="store_true", help="no progress bar")
    bench.set_defaults(func=cmd_bench)


def cache_modes(text: str) -> tuple[str, ...]:
    """`bench --modes`: a comma-separated list of distinct cache modes (at least one)."""
    modes = tuple(m.strip() for m in text.split(","))
    if not text.strip() or not all(modes):
        raise argparse.ArgumentTypeError(f"must be a comma-separated list of cache modes ({', '.join(CACHE_MODES)}), "
                                         f"got {text!r}")
    unknown = [m for m in modes if m not in CACHE_MODES]
    if unknown:
        raise argparse.ArgumentTypeError(f"must be cache modes of {', '.join(CACHE_MODES)}, got {text!r} (unknown: "
                                         f"{', '.join(unknown)})")
    if len(set(modes)) != len(modes):
        raise argparse.ArgumentTypeError(f"must be distinct cache modes (each runs once), got {text!r}")
    return modes


def check_out_dir(out_dir: str | Path, flag: str = "--out-dir") -> None:
    """`--out-dir` (or what `flag` names) is a folder this process can write, created now when missing: a
    ValueError naming it otherwise, before a run whose results would be lost."""
    path = Path(out_dir)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{flag} {str(out_dir)!r} is a file, not a folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ValueError(f"{flag} {str(out_dir)!r} cannot be created: {error.strerror or error}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {str(out_dir)!r} is not writable")


def check_out_files(**paths: str | None) -> None:
    """`simulate --json PATH --plot PATH` (keyword: the flag's name, `json`, `plot`): each a file path whose folder
    this process can write (created now when missing), not a folder: a ValueError naming the flag otherwise,
    before the replay whose results would be lost. None: not asked for."""
    for name, value in paths.items():
        if value is None:
            continue
        flag, path = f"--{name}", Path(value)
        if path.is_dir():
            example = path / ("sim.json" if name == "json" else "sim.png")
            raise ValueError(f"{flag} {value!r} is a folder; give a file path (e.g. {str(example)!r})")
        check_out_dir(path.parent, f"{flag} {value!r}: its folder")


# ---- simulate ---------------------------------------------------------------------------------------------


def cmd_simulate(args: argparse.Namespace) -> int:
    from tqdm.auto import tqdm

    from hybridcache.bench.simulator import GIB, SimResult, parse_policies, simulate_many

    if args.replicas is not None:
        return cmd_simulate_routing(args)
    check_out_files(json=args.json, plot=args.plot)  # before the replay: its results would be lost
    num_jobs = args.jobs if args.jobs is not None else os.cpu_count() or 1
    if args.plot:
        require_extra("bench", "hybridcache simulate --plot")
    specs = parse_policies(args.policies, args.block_size)
    workload, cost = simulated_workload(args)
    json_path, plot_path = fresh_paths(args.json, args.plot)
    budget = int(args.memory_gib * GIB)
    memories = [budget]
    if args.plot or args.sweep:
        factors = [x / args.memory_gib for x in args.sweep] if args.sweep else SWEEP_FACTORS
        points = [args.memory_gib * f for f in factors]
        memories = sorted({int(g * GIB) for g in points} | {budget})

    # none and oracle do not depend on memory: run them once.
    jobs = [(s, sim_config(args, m)) for m in memories for s in specs
            if s.mode not in ("none", "oracle") or m == budget]
    bar = tqdm(total=len(jobs) * len(workload), desc=f"simulate {workload.name}", unit="req",
               disable=args.no_progress, file=sys.stderr, mininterval=1.0)
    results = simulate_many(workload, jobs, cost, min(num_jobs, len(jobs)), bar.update)
    bar.close()
    by_memory: dict[int, dict] = {m: {} for m in memories}
    for (spec, cfg), result in zip(jobs, results):
        by_memory[cfg.memory_bytes][spec.name] = result
    for m in memories:
        for (spec, _), result in zip(jobs, results):
            if spec.mode in ("none", "oracle"):
                by_memory[m].setdefault(spec.name, result)
    main = SimResult(workload.name, cost.name, budget, args.block_size, len(workload),
                     {s.name: by_memory[budget][s.name] for s in specs})
    print(format_sim_table(main))
    record = main.to_json()
    record["state_bytes"], record["mamba_ssm_cache_dtype"] = cost.state_bytes, cost.ssm_dtype
    if args.plot or args.sweep:
        record["sweep"] = [{"memory_gib": m / GIB, "token_hit_rate": {s.name: by_memory[m][s.name].token_hit_rate
                                                                         for s in specs}} for m in memories]
    if plot_path:
        from hybridcache.bench.plots import plot_hit_rate_sweep

        path = plot_hit_rate_sweep(
            plot_path, f"{workload.name}: {len(workload)} requests, {cost.name}, B={args.block_size}",
            [m / GIB for m in memories],
            {s.name: [by_memory[m][s.name].token_hit_rate for m in memories] for s in specs},
        )
        print(f"plot: {path}")
    if json_path:
        _write_json(json_path, record)
    return 0


def simulated_workload(args: argparse.Namespace) -> tuple[Workload, ModelCost]:
    """`simulate`'s workload and the cost model of its `--model` (None: the built-in model), as the flags say."""
    from hybridcache.bench.workloads import load_workload
    from hybridcache.engine.cost_model import load_model_cost

    model_dir = resolve_model(args.model, weights=False).path if args.model is not None else None
    cost = load_model_cost(model_dir, args.mamba_ssm_cache_dtype)
    workload = load_workload(args.workload, trace=args.trace, num_requests=args.num_requests, seed=args.seed,
                             model_dir=model_dir)
    return workload, cost


def sim_config(args: argparse.Namespace, memory_bytes: int) -> SimConfig:
    """One simulated cache of `memory_bytes` with `simulate`'s block size, chunk budget, host tier and rates."""
    from hybridcache.bench.simulator import SimConfig

    bandwidth = float("inf") if args.host_bandwidth_gbs is None else args.host_bandwidth_gbs * 1e9
    return SimConfig(memory_bytes, args.block_size, args.chunk_budget, args.kv_tokens_per_slot,
                     host_memory_bytes=host_memory_bytes(args.host_memory_gib, memory_bytes),
                     host_bandwidth=bandwidth, device_flops=args.device_tflops * 1e12)


def host_memory_bytes(text: str, memory_bytes: int) -> int:
    """`--host-memory-gib`: GiB (`"64"`), or a multiple of the cache memory (`"4x"`)."""
    from hybridcache.bench.simulator import GIB

    text = str(text).strip().lower()
    value = float(text[:-1]) if text.endswith("x") else float(text)
    if value < 0:
        raise ValueError(f"--host-memory-gib must be >= 0, got {text!r}")
    return int(value * memory_bytes) if text.endswith("x") else int(value * GIB)


def cmd_simulate_routing(args: argparse.Namespace) -> int:
    """`simulate --replicas N`: every routing policy over N replicas (bench/routing.py), each replica with the
    cache memory and host tier of one `simulate` run; the flags of a one-cache run that routing does not take
    (--plot, --sweep, --jobs) are refused."""
    from tqdm.auto import tqdm

    from hybridcache.bench.routing import format_routing_table, simulate_routing
    from hybridcache.bench.simulator import GIB

    refused = [flag for flag, value in (("--plot", args.plot), ("--sweep", args.sweep), ("--jobs", args.jobs))
               if value is not None]
    if refused:
        raise ValueError(f"{', '.join(refused)}: not with --replicas (routing runs one process, at --memory-gib)")
    check_out_files(json=args.json)
    policies = [p.strip() for p in args.routing.split(",") if p.strip()]
    workload, cost = simulated_workload(args)
    (json_path,) = fresh_paths(args.json)
    config = sim_config(args, int(args.memory_gib * GIB))
    bar = tqdm(total=len(workload), desc=f"route {workload.name}", unit="req", disable=args.no_progress,
               file=sys.stderr, mininterval=1.0)
    results = simulate_routing(workload, policies, args.replicas, cost, config, on_request=lambda _: bar.update())
    bar.close()
    print(format_routing_table(workload.name, results, args.memory_gib))
    if json_path:
        _write_json(json_path, {"workload": workload.name, "model": cost.name, "memory_gib_per_replica":
                                args.memory_gib, "host_memory_bytes_per_replica": config.host_memory_bytes,
                                "block_size": args.block_size, "num_requests": len(workload),
                                "routing": {name: r.to_json() for name, r in results.items()}})
    return 0


def format_sim_table(result) -> str:
    """The terminal table of one simulator run."""
    from hybridcache.bench.simulator import GIB

    oracle = result.policies.get("oracle")
    lines = [
        f"workload {result.workload}: {result.num_requests} requests, model {result.model}, "
        f"memory {result.memory_bytes / GIB:.3g} GiB, block size {result.block_size}",
        f"{'policy':<20}{'hit rate':>9}{'/oracle':>9}{'computed tok':>14}{'PFLOPs saved':>14}{'ckpts':>9}"
        f"{'evictions':>11}{'peak GiB':>10}{'uncacheable':>12}",
    ]
    for name, r in result.policies.items():
        rel = f"{r.token_hit_rate / oracle.token_hit_rate:.3f}" if oracle and oracle.token_hit_rate else "-"
        lines.append(
            f"{name:<20}{r.token_hit_rate:>9.3f}{rel:>9}{r.prefill_tokens_computed:>14,}{r.flops_saved / 1e15:>14.3f}"
            f"{r.checkpoints_saved:>9,}{r.evictions:>11,}{r.bytes_peak / GIB:>10.3f}{r.num_uncacheable:>12,}"
        )
    return "\n".join(lines)


# ---- bench ------------------------------------------------------------------------------------------------


def cmd_bench(args: argparse.Namespace) -> int:
    require_extra("bench", "hybridcache bench (its plots)")
    from tqdm.auto import tqdm

    from hybridcache.bench.engine_bench import BenchConfig, count_calls, run_bench
    from hybridcache.bench.workloads import ChatOptions, load_workload
    modes = ("server",) if args.server else args.modes
    check_out_dir(args.out_dir)  # before the run: its results would be lost
    resolved = resolve_model(args.model)
    model_path = resolved.path
    chat = ChatOptions(args.num_sessions, args.max_turns, args.max_message_chars, args.max_prompt_len)
    workload = load_workload(args.workload, trace=args.trace, num_requests=args.num_requests, seed=args.seed,
                             model_dir=model_path, chat=chat)
    options = dict(block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                   max_num_batched_tokens=args.max_num_batched_tokens, num_blocks=args.num_blocks,
                   max_model_len=args.max_model_len)
    config = BenchConfig(modes, args.max_reply_tokens, options)
    bar = tqdm(total=count_calls(workload) * len(modes), desc=f"bench {workload.name}", unit="req",
               disable=args.no_progress, file=sys.stderr)
    if args.server:
        from hybridcache.bench.server_bench import run_server_bench

        result = run_server_bench(args.server, workload, config, concurrency=args.concurrency, on_progress=bar.update)
    else:
        result = run_bench(model_path, workload, config, bar.update, model_name=resolved.name)
    bar.close()
    print(format_bench_table(result, count_calls(workload)))
    out = Path(args.out_dir)
    json_path, cdf_path, turn_path = fresh_paths(out / f"bench_{workload.name}.json",
                                                 out / f"bench_{workload.name}_ttft_cdf.png",
                                                 out / f"bench_{workload.name}_hit_rate_by_turn.png")
    _write_json(json_path, result.to_json())
    from hybridcache.bench.plots import plot_hit_rate_by_turn, plot_ttft_cdf

    title = f"{workload.name}, {resolved.name}"
    ttfts = {m: list(r.ttfts_s) for m, r in result.modes.items()}
    by_turn = {m: r.hit_rate_by_turn for m, r in result.modes.items()}
    print(f"plot: {plot_ttft_cdf(cdf_path, title, ttfts)}")
    print(f"plot: {plot_hit_rate_by_turn(turn_path, title, by_turn)}")
    return 0 if result.outputs_identical else 1


def format_bench_table(result, num_requests: int) -> str:
    lines = [
        f"workload {result.workload}: {num_requests} requests per mode, model {result.model}",
        f"{'mode':<16}{'hit rate':>9}{'prefill tok':>13}{'TTFT p50 ms':>13}{'TTFT p95 ms':>13}{'E2E p50 ms':>12}"
        f"{'E2E p95 ms':>12}{'out tok/s':>11}{'wall s':>8}",
    ]
    for mode, r in result.modes.items():
        lines.append(
            f"{mode:<16}{r.token_hit_rate:>9.3f}{r.prefill_tokens_computed:>13,}{r.ttft_p50_s * 1e3:>13.1f}"
            f"{r.ttft_p95_s * 1e3:>13.1f}{r.e2e_p50_s * 1e3:>12.1f}{r.e2e_p95_s * 1e3:>12.1f}"
            f"{r.output_tokens_per_s:>11.1f}{r.wall_s:>8.2f}"
        )
    if len(result.modes) > 1:
        same = "yes" if result.outputs_identical else f"NO ({len(result.mismatched_calls)} calls differ)"
        lines.append(f"greedy outputs identical across modes: {same}")
    for mode, r in result.modes.items():
        if r.num_dropped:
            lines.append(f"{mode}: {r.num_dropped:,} of {num_requests:,} requests dropped: prompt + max_tokens over "
                         f"max_model_len {r.max_model_len:,} (--max-model-len)")
    return "\n".join(lines)


def fresh_paths(*paths: str | Path | None) -> tuple[Path | None, ...]:
    """Where one run writes its files without overwriting an earlier run's: `paths` as given if none exists,
    else all of them with the first suffix -2, -3, ... that is free for every one (so one run's files keep
    one suffix), and a line on stdout saying so. None entries stay None.

    Example: results/bench_x.json exists -> bench_x-2.json, bench_x_ttft_cdf-2.png, bench_x_hit_rate_by_turn-2.png
    (or -3 where a -2 file exists)."""
    given = [Path(p) if p is not None else None for p in paths]
    real = [p for p in given if p is not None]
    k = 1
    while any(_suffixed(p, k).exists() for p in real):
        k += 1
    if k > 1:
        print(f"{', '.join(str(p) for p in real if p.exists())} exists: this run writes "
              f"{', '.join(str(_suffixed(p, k)) for p in real)} instead")
    return tuple(_suffixed(p, k) if p is not None else None for p in given)


def _suffixed(path: Path, k: int) -> Path:
    return path if k == 1 else path.with_name(f"{path.stem}-{k}{path.suffix}")


def _write_json(path: str | Path, record: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2))
    print(f"json: {path}")
