"""The host tier in the simulator (issue 30): at each GPU budget, `hybridcache` alone and with a host tier of
R x the budget, against the bounded oracle at the GPU budget and at GPU + host bytes (one pool).

Per GPU budget G and host ratio R (default 4, 16), the jobs (one rendering of the workload, one process):

    hybridcache          G, no host          (the GPU-only policy)
    hybridcache+host Rx  G, host R x G       (device eviction demotes there, hits promote back)
    bounded-oracle       G                   (the target: GPU + 4x host >= this hit rate)
    bounded-oracle       (1 + R) x G         (the yardstick of the same bytes in one pool)

Prints one table per run (token hit rate; prefill PFLOPs saved; for the host runs the hit tokens served from
the host, the GB copied each way and the promotions skipped) and writes the JSON with `--json`.

    OMP_NUM_THREADS=1 nice -n 10 python benchmarks/host_tier_sweep.py --workload mooncake \\
        --trace /path/to/mooncake/conversation_trace.jsonl --num-requests 3000 --gib 1,2 [--json out.json]

`--host-bandwidth-gbs` makes promotions pay for their copy (`CostModel.promotion_pays`, at
`--device-tflops`); without it copies are free and the table measures capacity alone.
"""

from __future__ import annotations

import argparse
import json
import sys

from hybridcache.bench.simulator import GIB, SimConfig, parse_policies, simulate_many
from hybridcache.bench.specs import PolicySpec
from hybridcache.bench.workloads import load_workload
from hybridcache.engine.cost_model import load_model_cost
from hybridcache.model_path import resolve_model


def workload_arguments(parser: argparse.ArgumentParser) -> None:
    """The options the host-tier scripts share: which workload, the model whose config.json sizes the cache, and
    the block size."""
    parser.add_argument("--workload", required=True)
    parser.add_argument("--trace", default=None)
    parser.add_argument("--num-requests", type=int, default=None)
    parser.add_argument("--model", default=None, help="a model folder whose config.json sizes the cache")
    parser.add_argument("--block-size", type=int, default=64)


def load_cost_and_workload(args: argparse.Namespace):
    """The cost model and the workload that `workload_arguments`' options name."""
    model_dir = resolve_model(args.model).path if args.model is not None else None
    cost = load_model_cost(model_dir, "auto")
    return cost, load_workload(args.workload, trace=args.trace, num_requests=args.num_requests, model_dir=model_dir)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    workload_arguments(parser)
    parser.add_argument("--gib", required=True, help="GPU budgets, comma-separated GiB")
    parser.add_argument("--ratios", default="4,16", help="host tiers as multiples of the GPU budget")
    parser.add_argument("--host-bandwidth-gbs", type=float, default=None)
    parser.add_argument("--device-tflops", type=float, default=400.0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    cost, workload = load_cost_and_workload(args)
    hybrid, oracle = parse_policies("hybridcache,bounded-oracle", args.block_size)
    bandwidth = float("inf") if args.host_bandwidth_gbs is None else args.host_bandwidth_gbs * 1e9
    ratios = [float(r) for r in args.ratios.split(",")]
    jobs: list[tuple[str, float, PolicySpec, SimConfig]] = []
    for gib in (float(g) for g in args.gib.split(",")):
        gpu = int(gib * GIB)

        def config(memory: int, host: int = 0) -> SimConfig:
            return SimConfig(memory, args.block_size, host_memory_bytes=host, host_bandwidth=bandwidth,
                             device_flops=args.device_tflops * 1e12)

        jobs.append(("hybridcache", gib, hybrid, config(gpu)))
        jobs += [(f"hybridcache+host {r:g}x", gib, hybrid, config(gpu, int(r * gpu))) for r in ratios]
        jobs.append(("bounded-oracle", gib, oracle, config(gpu)))
        jobs += [(f"bounded-oracle at {1 + r:g}x", gib, oracle, config(int((1 + r) * gpu))) for r in ratios]
    results = simulate_many(workload, [(spec, cfg) for _, _, spec, cfg in jobs], cost, 1)
    print(f"{workload.name}: {len(workload)} requests, model {cost.name}, B={args.block_size}, host bandwidth "
          f"{'free' if args.host_bandwidth_gbs is None else f'{args.host_bandwidth_gbs:g} GB/s'}")
    print(f"{'GPU GiB':>8}  {'policy':<24}{'hit rate':>9}{'PFLOPs saved':>14}{'host hit tok':>14}"
          f"{'to host GB':>12}{'from host GB':>14}{'skipped':>9}")
    rows = []
    for (name, gib, _, cfg), r in zip(jobs, results, strict=True):
        print(f"{gib:>8g}  {name:<24}{r.token_hit_rate:>9.3f}{r.flops_saved / 1e15:>14.3f}{r.host_hit_tokens:>14,}"
              f"{r.host_save_bytes / 1e9:>12.2f}{r.host_load_bytes / 1e9:>14.2f}{r.promotions_skipped:>9}")
        rows.append({"gpu_gib": gib, "policy": name, "memory_gib": cfg.memory_bytes / GIB,
                     "host_gib": cfg.host_memory_bytes / GIB, **r.to_json()})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"workload": workload.name, "model": cost.name, "num_requests": len(workload),
                       "host_bandwidth_gbs": args.host_bandwidth_gbs, "device_tflops": args.device_tflops,
                       "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
