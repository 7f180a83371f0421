"""Time paged checkpoint-state copies (`hybridcache.engine.paged_state.PagedStates`) and check them on the device.

    PYTHONPATH=. python benchmarks/paged_state_bench.py [--device cuda] [--blocks 8192] [--seqs 1,8,64]
        [--model next-1b|next-16b] [--profile]

Pools of the 1.39B Qwen3-Next of gpu_bench.py in bf16 (4 attention layers, 2 kv heads of 256, block 64 = 512 KiB;
12 DeltaNet layers with an fp32 ssm [32, 128, 128] and a bf16 conv [8192, 3] state, last_hidden [2048]: a
24.57 MiB slot, k = 50 blocks), 2 x max(--seqs) runtime slots; `--model next-16b`: its 16.6B sibling's (8
attention layers: a block of 1 MiB; 24 DeltaNet layers, last_hidden [4096]: a 49.2 MiB slot, k = 50; with
--blocks 82131, the engine's pool on the H200, a (layer, K|V) row of the pool spans more than 2 GiB). For each n
in --seqs: one save of slots 0..n-1 into n x k random pages and one restore of them into slots n..2n-1 (median of
--repeats runs, synchronised around each); the restored slots must equal the saved ones, byte for byte.
`--profile`: also the device kernels of one save and one restore, by name (CUDA).
Prints one JSON line per n and writes DIR/paged_state_<device>.json (DIR: --out, else $OUT, else .). Runs on
the CPU too (use fewer --blocks there).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from hybridcache.engine.memory import pool_bytes, state_pages
from hybridcache.engine.paged_state import PagedStates
from hybridcache.state_spec import AttentionSpec, DevicePools, RecurrentSpec, StateTensorSpec

# (groups of 3 DeltaNet layers + 1 attention layer, hidden size)
MODELS = {"next-1b": (4, 2048), "next-16b": (8, 4096)}


def specs(model: str = "next-1b") -> tuple[list, tuple]:
    groups, hidden = MODELS[model]
    recurrent = RecurrentSpec((StateTensorSpec("conv", (8192, 3), torch.bfloat16),
                               StateTensorSpec("ssm", (32, 128, 128), torch.float32)))
    attention = AttentionSpec(num_kv_heads=2, head_dim=256, dtype=torch.bfloat16)
    return [recurrent, recurrent, recurrent, attention] * groups, (StateTensorSpec("last_hidden", (hidden,),
                                                                                   torch.bfloat16),)


def launches(fn, args: tuple) -> dict[str, int]:
    """Device kernels (and memcpys) of one `fn(*args)` by name (torch.profiler; CUDA only)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn(*args)
        torch.cuda.synchronize()
    found: dict[str, int] = {}
    for event in prof.events():
        if event.device_type == DeviceType.CUDA:
            found[event.name[:60]] = found.get(event.name[:60], 0) + 1
    return found


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, args: tuple, device: torch.device, repeats: int) -> float:
    """Median milliseconds of `fn(*args)` over `repeats` runs (one warm-up first)."""
    fn(*args)
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn(*args)
        sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--blocks", type=int, default=8192)
    parser.add_argument("--seqs", default="1,8,64")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--model", default="next-1b", choices=list(MODELS))
    parser.add_argument("--profile", action="store_true", help="also count the kernels of one save and restore")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    seqs = [int(n) for n in args.seqs.split(",")]
    layer_specs, slot_specs = specs(args.model)
    kv, state = pool_bytes(layer_specs, 64, slot_specs)
    k = state_pages(state, kv)
    if max(seqs) * k > args.blocks:
        raise SystemExit(f"--blocks {args.blocks} cannot hold {max(seqs)} states of {k} blocks")
    num_slots = 2 * max(seqs)
    pools = DevicePools.allocate(layer_specs, num_pages=args.blocks, kernel_block_size=64, num_slots=num_slots,
                                 device=device, slot_specs=slot_specs)
    for group in pools.state_groups:
        group.view(-1).view(torch.uint8).random_(0, 256)
    paged = PagedStates(pools, pages_per_block=1, num_blocks=args.blocks, k=k)
    records = []
    for n in seqs:
        chunks = torch.arange(n * k, device=device)
        pages = torch.randperm(args.blocks, device=device)[: n * k]
        back = torch.arange(n * k, 2 * n * k, device=device)  # slots n .. 2n-1
        save_ms = timed(paged.save, (chunks, pages), device, args.repeats)
        restore_ms = timed(paged.restore, (pages, back), device, args.repeats)
        as_bytes = [g.view(g.shape[0], g.shape[1], -1).view(torch.uint8) for g in pools.state_groups]
        equal = all(torch.equal(b[:, :n], b[:, n: 2 * n]) for b in as_bytes)
        moved = n * state
        if args.profile and device.type == "cuda":
            records_launches = {"save": launches(paged.save, (chunks, pages)),
                                "restore": launches(paged.restore, (pages, back))}
        else:
            records_launches = None
        records.append(dict(device=str(device), model=args.model, blocks=args.blocks, seqs=n, k=k,
                            slot_mib=round(state / 2**20, 3),
                            save_ms=round(save_ms, 3), restore_ms=round(restore_ms, 3),
                            save_gib_s=round(moved / save_ms / 1e-3 / 2**30, 1),
                            restore_gib_s=round(moved / restore_ms / 1e-3 / 2**30, 1), restored_equal=equal,
                            launches=records_launches))
        print(json.dumps(records[-1]), flush=True)
    out = Path(args.out or os.environ.get("OUT") or ".")
    out.mkdir(parents=True, exist_ok=True)
    (out / f"paged_state_{device.type}.json").write_text(json.dumps(records, indent=1))


if __name__ == "__main__":
    main()
