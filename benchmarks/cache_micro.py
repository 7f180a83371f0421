"""Micro-benchmark of the prefix cache: match + admit + plan cost per request.

For each prompt length (1k .. 128k tokens, B = 64) and number of cached checkpoints, the cache holds
  - the prompt's chain, with a chunk_end checkpoint every 8k tokens and a finish checkpoint at its end;
  - (num_checkpoints - that many) other finished prompts that share a random prefix of it and then differ,
    so the request's path carries many checkpoints whose tails do not match it, and the trie branches;
and a request = prompt + 32 new tokens is timed: `match`, `admit`, `commit_step({})` (the restore plan),
then `abort` (untimed) to reset. Median of `--repeats` runs.

    .venv/bin/python benchmarks/cache_micro.py            # prints a table, writes results/cache_micro.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

from hybridcache.cache import CacheConfig, CacheRequest, CopyKind, PrefixCache

BLOCK = 64
CHUNK = 8192


def run_prompt(cache: PrefixCache, rid, prompt: tuple[int, ...], chunk: int) -> None:
    match = cache.match(CacheRequest(rid, prompt))
    assert cache.admit(match) is not None
    pos = cache.num_computed(rid)
    while pos < len(prompt):
        end = min(len(prompt), pos + chunk)
        assert cache.ensure_capacity(rid, end)
        cache.reserve_save(rid, end, "chunk_end" if end < len(prompt) else "prefill_end")
        cache.commit_step({rid: prompt[pos:end]})
        pos = end
    cache.finish(rid)


def build(prompt_len: int, num_checkpoints: int, rng: random.Random) -> tuple[PrefixCache, tuple[int, ...]]:
    num_others = max(0, num_checkpoints - (prompt_len // CHUNK + 1))
    config = CacheConfig(
        block_size=BLOCK,
        num_blocks=2 * (prompt_len // BLOCK) + 8 + num_others * 3,
        num_slots=num_checkpoints + 8,
        max_checkpoints_per_anchor=8,
    )
    cache = PrefixCache(config)
    prompt = tuple(rng.randrange(50000) for _ in range(prompt_len))
    run_prompt(cache, "main", prompt, CHUNK)
    for i in range(num_others):
        shared = prompt[: rng.randrange(BLOCK, prompt_len)]
        other = shared + tuple(rng.randrange(50000) for _ in range(rng.randrange(1, 100)))
        run_prompt(cache, f"other{i}", other, CHUNK)
    return cache, prompt


def measure(cache: PrefixCache, prompt: tuple[int, ...], repeats: int) -> dict:
    request = CacheRequest("query", prompt + tuple(range(32)))
    match_s, total_s = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        match = cache.match(request)
        t1 = time.perf_counter()
        admitted = cache.admit(match)
        copies = cache.commit_step({})
        t2 = time.perf_counter()
        assert admitted is not None and match.cached_len == len(prompt), match
        assert len(copies.pairs(CopyKind.STATE_RESTORE)) == 1
        cache.abort("query")
        match_s.append(t1 - t0)
        total_s.append(t2 - t0)
    return {"match_us": statistics.median(match_s) * 1e6, "match_admit_plan_us": statistics.median(total_s) * 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384, 65536, 131072])
    parser.add_argument("--checkpoints", type=int, nargs="+", default=[16, 256, 1024])
    parser.add_argument("--out", default="results/cache_micro.json")
    args = parser.parse_args()
    rng = random.Random(0)
    rows = []
    print(f"{'prompt':>8} {'ckpts':>6} {'nodes':>6} {'match us':>10} {'match+admit+plan us':>20} {'us/1k tok':>10}")
    for prompt_len in args.lengths:
        for num_checkpoints in args.checkpoints:
            cache, prompt = build(prompt_len, num_checkpoints, rng)
            stats = cache.stats
            row = {
                "prompt_len": prompt_len,
                "num_checkpoints": stats.num_checkpoints,
                "num_nodes": stats.num_nodes,
                **measure(cache, prompt, args.repeats),
            }
            cache.check_integrity()
            rows.append(row)
            print(
                f"{prompt_len:>8} {row['num_checkpoints']:>6} {row['num_nodes']:>6} {row['match_us']:>10.0f} "
                f"{row['match_admit_plan_us']:>20.0f} {row['match_admit_plan_us'] / prompt_len * 1000:>10.1f}"
            )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"block_size": BLOCK, "repeats": args.repeats, "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
