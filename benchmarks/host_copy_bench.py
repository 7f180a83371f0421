"""Host <-> device copy bandwidth of the host tier (issue 30): `HostPool.save` / `load` of KV blocks (state pages
take the same path: a page is a block of the pool) and `finish` of runtime slots, against the peak of one
pinned 64 MiB copy (`measure_copy_rates`).

Pools of Qwen3-Next-80B's layer shapes (48 layers 3:1: 12 attention layers of 2 KV heads x 256 in bf16, 36 gated
DeltaNet layers of 32 value heads x 128 x 128 fp32 state and an 8,192 x 3 bf16 conv state; blocks of 64 tokens,
so a block is 1.5 MiB and a state 50 blocks, as docs/cache.md's 80B cost model has it), random block ids:

    PYTHONPATH=. python benchmarks/host_copy_bench.py [--blocks 2048] [--copies 256] [--device cuda] [--json F]
    PYTHONPATH=. python benchmarks/host_copy_bench.py --device cpu --blocks 64 --copies 16 --layers 4   # smoke test

Prints GB/s per op (median of `--repeats`) and writes the JSON with `--json`. Speed is measured here, never
asserted in tests.

Then (`--overlap-ms T`, default 10; 0: skip) whether the copies overlap compute, with a stand-in forward of bf16
4,096-square matmuls taking about T ms, the host pool's copies on the forward's stream (no streams, as before the
side streams) against on its side streams (`CopyStreams`; CUDA only, the CPU runs the first twice as a smoke test):

    demotion   save `--copies` blocks, then the forward             (the next step waits for the forward stream)
    promotion  a forward, then load `--copies` blocks, then the forward that reads them   (the load may overlap
               the first forward: with async scheduling the host plans a step while the one before runs)

each timed on the forward stream (events) and until every copy is done (a device synchronisation).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from hybridcache.engine.host_pool import CopyStreams, HostPool, measure_copy_rates
from hybridcache.engine.memory import pool_bytes, state_pages
from hybridcache.engine.paged_state import PagedStates
from hybridcache.state_spec import AttentionSpec, DevicePools, RecurrentSpec, StateTensorSpec

BLOCK, KBS = 64, 64


def specs(layers: int) -> list:
    delta = RecurrentSpec((StateTensorSpec("conv", (8192, 3), torch.bfloat16),
                           StateTensorSpec("ssm", (32, 128, 128), torch.float32)))
    attention = AttentionSpec(2, 256, torch.bfloat16)
    return [attention if (i + 1) % 4 == 0 else delta for i in range(layers)]


def timed(device: torch.device, run) -> float:
    run()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    run()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def timed_streams(device: torch.device, run) -> tuple[float, float]:
    """(ms on the current stream, ms until the device is idle) of `run`, after a warm-up run."""
    run()
    if device.type != "cuda":
        start = time.perf_counter()
        run()
        seconds = 1000 * (time.perf_counter() - start)
        return seconds, seconds
    torch.cuda.synchronize(device)
    first, last = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start = time.perf_counter()
    first.record()
    run()
    last.record()
    torch.cuda.synchronize(device)
    return first.elapsed_time(last), 1000 * (time.perf_counter() - start)


def overlap(host: HostPool, device: torch.device, device_ids: torch.Tensor, host_ids: list[int], target_ms: float,
            repeats: int) -> dict:
    """The demotion and promotion scenarios of the module docstring, without and with side streams."""
    a = torch.randn(4096, 4096, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32, device=device)
    one_ms = timed_streams(device, lambda: a @ a)[0]
    count = max(1, round(target_ms / max(one_ms, 1e-3)))

    def forward() -> None:
        for _ in range(count):
            a @ a

    scenarios = {
        "forward alone": forward,
        "demotion": lambda: (host.save(device_ids, host_ids), forward()),
        "promotion": lambda: (forward(), host.load(host_ids, device_ids), forward()),
    }
    side = CopyStreams(device) if device.type == "cuda" else None
    result: dict = {"matmuls": count}
    print(f"\noverlap: a forward of {count} matmuls; {len(host_ids)} blocks per copy; ms on the forward stream / "
          f"until every copy is done (median of {repeats})")
    print("| scenario | one stream | side streams |\n| --- | --- | --- |")
    for name, run in scenarios.items():
        cells = []
        for streams in (None, side):
            host.streams = streams
            runs = [timed_streams(device, run) for _ in range(repeats)]
            main_ms, all_ms = statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)
            result[f"{name} / {'side streams' if streams is not None else 'one stream'}"] = {
                "forward_stream_ms": main_ms, "all_done_ms": all_ms}
            cells.append(f"{main_ms:.2f} / {all_ms:.2f}")
        print(f"| {name} | {cells[0]} | {cells[1]} |", flush=True)
    host.streams = None
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--blocks", type=int, default=2048, help="device pool and host pool blocks")
    parser.add_argument("--copies", type=int, default=256, help="blocks per save / load")
    parser.add_argument("--slots", type=int, default=4, help="runtime slots finished to the host at once")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--overlap-ms", type=float, default=10.0, help="the stand-in forward's ms (0: no overlap run)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    layer_specs = specs(args.layers)
    slot_specs = (StateTensorSpec("last_hidden", (2048,), torch.bfloat16),)
    pools = DevicePools.allocate(layer_specs, num_pages=args.blocks, kernel_block_size=KBS, num_slots=args.slots,
                                 device=device, slot_specs=slot_specs)
    page, slot = pool_bytes(layer_specs, BLOCK, slot_specs)
    k = state_pages(slot, page)
    paged = PagedStates(pools, pages_per_block=BLOCK // KBS, num_blocks=args.blocks, k=k)
    host = HostPool(paged, args.blocks, pin=device.type == "cuda")
    rng = random.Random(0)
    device_ids = torch.tensor(rng.sample(range(args.blocks), args.copies), dtype=torch.int64, device=device)
    host_ids = sorted(rng.sample(range(args.blocks), args.copies))  # as the host pool hands them out: mostly runs
    num_slots = max(1, min(args.slots, args.blocks // k))  # the host pool must hold their pages
    chunks = torch.arange(num_slots * k, dtype=torch.int64, device=device)
    finish_ids = list(range(num_slots * k))
    peak, flops = measure_copy_rates(device, torch.bfloat16)
    ops = {
        "save (device -> host)": (args.copies * page, lambda: host.save(device_ids, host_ids)),
        "load (host -> device)": (args.copies * page, lambda: host.load(host_ids, device_ids)),
        "finish (slots -> host)": (num_slots * k * page, lambda: host.finish(chunks, finish_ids)),
    }
    result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "block_bytes": page, "state_pages": k, "copies": args.copies,
              "pinned_peak_gb_s": peak / 1e9, "matmul_tflops": flops / 1e12, "ops": {}}
    print(f"{result['device']}: blocks of {page / 2**20:.2f} MiB, a state = {k} blocks; pinned 64 MiB host -> device "
          f"peak {peak / 1e9:.1f} GB/s, bf16 matmul {flops / 1e12:.0f} TFLOP/s")
    for name, (nbytes, run) in ops.items():
        seconds = statistics.median(timed(device, run) for _ in range(args.repeats))
        rate = nbytes / seconds / 1e9
        result["ops"][name] = {"bytes": nbytes, "seconds": seconds, "gb_s": rate, "of_peak": rate / (peak / 1e9)}
        print(f"  {name:<24} {nbytes / 2**20:9.1f} MiB  {1000 * seconds:8.2f} ms  {rate:7.2f} GB/s  "
              f"{rate / (peak / 1e9):.2f} of peak")
    if args.overlap_ms > 0:
        result["overlap"] = overlap(host, device, device_ids, host_ids, args.overlap_ms, args.repeats)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
