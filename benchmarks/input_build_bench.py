"""Host time of one decode step's input build: 64 one-token chunks whose contexts are 1,100, 16,000 and 32,000
tokens, with 64- and 256-token blocks (kernel pages of 64), through `build_forward_batch` on the CPU, the engine's
`PageRows` kept across the timed steps (a tree without it builds every table afresh). Median of 50 builds after
10 untimed ones.

    .venv/bin/python benchmarks/input_build_bench.py                 # prints a table, writes results/input_build.json
    PYTHONPATH=<another tree> python benchmarks/input_build_bench.py --out /tmp/other.json   # the same on that tree
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from hybridcache.engine import input_builder

SEQS = 64
PAGE = 64


def time_build(context: int, block_size: int, repeats: int = 50, warm: int = 10) -> float:
    """Median seconds of one build of SEQS decode chunks of `context` tokens each."""
    num_blocks = (context + SEQS) // block_size + 1
    blocks = [tuple(range(i * num_blocks, (i + 1) * num_blocks)) for i in range(SEQS)]
    kept = getattr(input_builder, "PageRows", None)
    extra = {"page_rows": kept(block_size // PAGE)} if kept is not None else {}
    times = []
    for run in range(warm + repeats):
        chunks = [input_builder.SeqChunk(token_ids=[5], start=context + i, block_ids=blocks[i], slot=i)
                  for i in range(SEQS)]
        start = time.perf_counter()
        input_builder.build_forward_batch(chunks, block_size=block_size, kernel_block_size=PAGE, **extra)
        if run >= warm:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="results/input_build.json")
    args = parser.parse_args()
    rows = []
    print("| context | block | ms per build |\n| --- | --- | --- |")
    for context in (1_100, 16_000, 32_000):
        for block_size in (64, 256):
            ms = time_build(context, block_size) * 1e3
            rows.append({"context": context, "block_size": block_size, "ms": round(ms, 4)})
            print(f"| {context:,} | {block_size} | {ms:.3f} |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"seqs": SEQS, "kernel_page": PAGE, "page_rows": hasattr(input_builder, "PageRows"),
                               "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
