"""One line per `gpu_bench.py` JSON under a folder (issue 30's H200 runs): for each phase its hit rate, p50, p95
and max latency (ms), the p50 of the requests that hit and of those that did not, CH's cold and filler requests
(ms), and the host tier's counters (hits, checkpoints and blocks promoted and demoted, promotions skipped).

    python benchmarks/host_tier_summary.py DIR
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

HOST_NAMES = {"num_host_hits": "hits", "num_promoted_checkpoints": "prom_ckpt", "num_promoted_blocks": "prom_blk",
              "num_demoted_checkpoints": "dem_ckpt", "num_demoted_blocks": "dem_blk",
              "num_promotions_skipped": "skipped"}


def median_ms(values: list[float]) -> str:
    """The median of `values`, rounded to a millisecond, or "-" where there are none."""
    return f"{statistics.median(values):.0f}" if values else "-"


def phase_line(run: str, phase: str, row: dict) -> str:
    """The summary line of one phase of one run."""
    if "error" in row:
        return f"{run} {phase}: ERROR {row['error']}"
    hits = [t for t, c in zip(row["latencies_ms"], row["cached_per_request"], strict=True) if c]
    misses = [t for t, c in zip(row["latencies_ms"], row["cached_per_request"], strict=True) if not c]
    host = row.get("cache", {}).get("host", {})
    counters = " ".join(f"{short}={host.get(name, 0)}" for name, short in HOST_NAMES.items())
    extra = "".join(f" {key}={row[key]:.0f}" for key in ("cold_ms", "filler_ms") if key in row)
    return (f"{run} {phase}: hit {row['hit_rate']:.3f} p50 {row['p50_ms']:.0f} p95 {row['p95_ms']:.0f} "
            f"max {row['max_ms']:.0f} ms (p50 hit {median_ms(hits)} / miss {median_ms(misses)}, "
            f"n {len(hits)}/{len(misses)}){extra} | host {counters}")


def main() -> None:
    folder = Path(sys.argv[1])
    for path in sorted(folder.glob("*/gpu_bench_*.json")):
        result = json.loads(path.read_text())
        run = f"{path.parent.name} (start-up {result.get('engine_init_s', 0):.0f} s)"
        for phase, row in result["phases"].items():
            print(phase_line(run, phase, row))


if __name__ == "__main__":
    main()
