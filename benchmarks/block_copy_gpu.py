"""GPU correctness and bandwidth of copy_blocks / copy_slots: Triton kernel vs torch path vs plain copy.

Run from the repository root on a CUDA machine:

    PYTHONPATH=. python3 benchmarks/block_copy_gpu.py
    TRITON_INTERPRET=1 PYTHONPATH=. python3 benchmarks/block_copy_gpu.py --cpu-smoke   # tiny pools, CPU, no JSON

For each pool variant (bf16 KV pools of 16 attention layers and 8 KV heads; fp32 ssm and bf16 conv state
pools) and each plan size, it first checks that both implementations give exactly the reference result over
the whole pool (plans with repeated sources, ids on the CPU so that the launcher checks them), then times
them with ids already on the device (CUDA events, warm-up, median of N), next to `dst.copy_(src)` of one
contiguous buffer holding the same number of bytes. Bandwidth counts bytes read + bytes written
(2 x bytes copied). Writes results/block_copy_gpu.json. Imports only torch, triton and the two kernel
modules.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import triton

from hybridcache.kernels.copy.block_copy import copy_blocks, copy_slots

NUM_WARMUP = 3
NUM_TIMED = 20
RESULTS_PATH = Path("results/block_copy_gpu.json")


@dataclass(frozen=True)
class Variant:
    """One pool: `shape` with the page (or slot) dim at `page_dim`; `pages_per_block` pages per copy unit."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    page_dim: int
    pages_per_block: int
    pair_counts: tuple[int, ...]

    @property
    def num_blocks(self) -> int:
        return self.shape[self.page_dim] // self.pages_per_block


def kv_variant(head_dim: int, kernel_block_size: int, pages_per_block: int, num_pages: int) -> Variant:
    return Variant(
        name=f"kv D{head_dim} kbs{kernel_block_size} ppb{pages_per_block}",
        shape=(16, 2, num_pages, kernel_block_size, 8, head_dim),
        dtype=torch.bfloat16,
        page_dim=2,
        pages_per_block=pages_per_block,
        pair_counts=(1, 64, 256, 1024),
    )


VARIANTS = (
    kv_variant(128, 16, 1, 8192),  # 1 MiB per page: an 8 GiB pool
    kv_variant(128, 16, 2, 8192),
    kv_variant(128, 16, 4, 8192),
    kv_variant(256, 16, 4, 8192),
    kv_variant(128, 64, 1, 4096),
    # Qwen3-Next-like state pools: 36 linear layers, 128 slots
    Variant("ssm fp32 Hv32 Dk128 Dv128", (36, 128, 32, 128, 128), torch.float32, 1, 1, (1, 8, 32, 64)),
    Variant("conv bf16 8192x3", (36, 128, 8192, 3), torch.bfloat16, 1, 1, (1, 8, 32, 64)),
)


@dataclass(frozen=True)
class Row:
    variant: str
    num_pairs: int
    copied_mib: float
    triton_ms: float
    torch_ms: float
    d2d_ms: float
    triton_gbps: float
    torch_gbps: float
    d2d_gbps: float


def random_plan(
    num_blocks: int, num_pairs: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Unique destinations; sources from the other blocks, about half of them repeated."""
    order = torch.randperm(num_blocks, generator=generator)
    dst_ids = order[:num_pairs]
    candidates = order[num_pairs:]
    num_sources = max(1, min(len(candidates), (num_pairs + 1) // 2))
    src_ids = candidates[torch.randint(0, num_sources, (num_pairs,), generator=generator)]
    return src_ids, dst_ids


def reference_copy(
    pool: torch.Tensor, src_ids: torch.Tensor, dst_ids: torch.Tensor, variant: Variant
) -> None:
    """In place, pair by pair, with page-dim slices (sources and destinations are disjoint)."""
    ppb = variant.pages_per_block
    for src, dst in zip(src_ids.tolist(), dst_ids.tolist(), strict=True):
        pool.narrow(variant.page_dim, dst * ppb, ppb).copy_(pool.narrow(variant.page_dim, src * ppb, ppb))


def run_copy(variant: Variant, pool: torch.Tensor, src_ids: torch.Tensor, dst_ids: torch.Tensor,
             impl: str) -> None:
    if variant.page_dim == 1 and variant.pages_per_block == 1:
        copy_slots(pool, src_ids, dst_ids, impl=impl)
    else:
        copy_blocks(pool, src_ids, dst_ids, pages_per_block=variant.pages_per_block,
                    page_dim=variant.page_dim, impl=impl)


SMOKE_VARIANTS = (
    Variant("kv smoke ppb2", (2, 2, 24, 4, 2, 8), torch.bfloat16, 2, 2, (1, 5)),
    Variant("ssm smoke", (3, 10, 2, 4, 5), torch.float32, 1, 1, (1, 3)),
)


def median_ms(fn, device: str) -> float:
    for _ in range(NUM_WARMUP):
        fn()
    times = []
    if device == "cpu":
        for _ in range(NUM_TIMED):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)
    torch.cuda.synchronize()
    for _ in range(NUM_TIMED):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def bench_variant(variant: Variant, generator: torch.Generator, device: str) -> list[Row]:
    pool = torch.randn(variant.shape, device=device, dtype=variant.dtype)
    original = pool.clone()
    rows = []
    for num_pairs in variant.pair_counts:
        src_ids, dst_ids = random_plan(variant.num_blocks, num_pairs, generator)
        rows.append(bench_plan(variant, pool, original, src_ids, dst_ids, device))
        print(format_row(rows[-1]), flush=True)
    return rows


def bench_plan(variant: Variant, pool: torch.Tensor, original: torch.Tensor, src_ids: torch.Tensor,
               dst_ids: torch.Tensor, device: str) -> Row:
    """Check both implementations against the reference (CPU ids), then time them (device ids)."""
    label = f"{variant.name}, {len(src_ids)} pairs"
    expected = original.clone()
    reference_copy(expected, src_ids, dst_ids, variant)
    for impl in ("triton", "torch"):
        pool.copy_(original)
        run_copy(variant, pool, src_ids, dst_ids, impl)
        if not torch.equal(pool, expected):
            raise AssertionError(f"{label}: impl={impl} differs from the reference")
    src_dev, dst_dev = src_ids.to(device), dst_ids.to(device)
    triton_ms = median_ms(lambda: run_copy(variant, pool, src_dev, dst_dev, "triton"), device)
    torch_ms = median_ms(lambda: run_copy(variant, pool, src_dev, dst_dev, "torch"), device)
    if not torch.equal(pool, expected):
        raise AssertionError(f"{label}: the timed runs changed the result")
    del expected
    copied = len(src_ids) * (pool.numel() * pool.element_size() // variant.num_blocks)
    src_buf = torch.empty(copied, dtype=torch.uint8, device=device)
    dst_buf = torch.empty_like(src_buf)
    d2d_ms = median_ms(lambda: dst_buf.copy_(src_buf), device)

    def gbps(ms: float) -> float:
        return 2 * copied / (ms * 1e-3) / 1e9

    return Row(variant.name, len(src_ids), copied / 2**20, triton_ms, torch_ms, d2d_ms,
               gbps(triton_ms), gbps(torch_ms), gbps(d2d_ms))


HEADER = (f"{'variant':<28}{'pairs':>6}{'MiB':>9}{'triton ms':>11}{'GB/s':>8}{'torch ms':>10}{'GB/s':>8}"
          f"{'d2d ms':>9}{'GB/s':>8}{'tri/d2d':>9}")


def format_row(row: Row) -> str:
    return (f"{row.variant:<28}{row.num_pairs:>6}{row.copied_mib:>9.1f}{row.triton_ms:>11.4f}"
            f"{row.triton_gbps:>8.0f}{row.torch_ms:>10.4f}{row.torch_gbps:>8.0f}{row.d2d_ms:>9.4f}"
            f"{row.d2d_gbps:>8.0f}{row.triton_gbps / row.d2d_gbps:>9.2f}")


def main(argv: list[str]) -> int:
    smoke = "--cpu-smoke" in argv
    if not smoke and not torch.cuda.is_available():
        print("block_copy_gpu: needs a CUDA device (or --cpu-smoke under TRITON_INTERPRET=1)",
              file=sys.stderr)
        return 1
    device = "cpu" if smoke else "cuda"
    device_name = "cpu (smoke)" if smoke else torch.cuda.get_device_name()
    print(f"{device_name}, torch {torch.__version__}, triton {triton.__version__}")
    print("GB/s counts bytes read + bytes written (2 x bytes copied); times are medians of "
          f"{NUM_TIMED} after {NUM_WARMUP} warm-ups; correctness checked over the whole pool first\n")
    print(HEADER)
    generator = torch.Generator().manual_seed(0)
    rows: list[Row] = []
    for variant in SMOKE_VARIANTS if smoke else VARIANTS:
        rows.extend(bench_variant(variant, generator, device))
        if not smoke:
            torch.cuda.empty_cache()
    if smoke:
        print("\nsmoke run: all variants match the reference")
        return 0
    RESULTS_PATH.parent.mkdir(parents=True, exist_ok=True)
    RESULTS_PATH.write_text(json.dumps({
        "device": device_name,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "bandwidth_counts": "bytes read + bytes written",
        "num_warmup": NUM_WARMUP,
        "num_timed": NUM_TIMED,
        "variants": [dict(asdict(v), dtype=str(v.dtype)) for v in VARIANTS],
        "rows": [asdict(row) for row in rows],
    }, indent=2))
    print(f"\nall variants match the reference; wrote {RESULTS_PATH}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
