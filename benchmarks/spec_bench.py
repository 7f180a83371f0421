"""MTP speculative decoding: acceptance per draft position and decode tokens/s against MTP off.

    PYTHONPATH=. python benchmarks/spec_bench.py [--model-dir DIR] [--k 1 2 3] [--batch 1 8 64] [--max-tokens 128]
                                                 [--prompt-len 256] [--temperature 0] [--device cpu] [--json OUT]

For each batch size b, b greedy requests (prompts cut from the model folder's `training_corpus.txt` when
`benchmarks/train_byte_lm.py --mtp-steps N` wrote it, else random bytes) are prefilled, then decoded to
`--max-tokens`; the decode time is the wall time from the first step that only decodes to the last. Rows: MTP off,
then MTP with each k. Acceptance: accepted / fed draft tokens, and per draft position (accepted at position j /
verify rows). Prints a table and writes the rows as JSON. The engine runs MTP only with the reference kernels for
now (on the CPU): H200 numbers need the CUDA verify path (docs/design.md, "Speculative decoding").
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from hybridcache.config import EngineConfig
from hybridcache.engine.engine import LLMEngine
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


def measure(model_dir: Path, k: int | None, batch: int, args: argparse.Namespace) -> dict:
    """One row: decode tokens/s of `batch` requests with MTP k (None: off), and the acceptance counters."""
    config = EngineConfig(block_size=64, max_num_seqs=max(batch, 1),
                          max_model_len=args.prompt_len + args.max_tokens + 8,
                          max_num_batched_tokens=max(2048, args.prompt_len), device=args.device,
                          speculative_config={"method": "mtp", "num_speculative_tokens": k} if k else None)
    engine = LLMEngine(model_dir, config)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, ignore_eos=True, seed=0)
    for i, prompt in enumerate(prompts(model_dir, batch, args.prompt_len)):
        engine.add_request(str(i), prompt, params)
    start = None
    generated = 0
    while engine.has_unfinished_requests():
        decoding = all(s.num_computed >= s.prompt_len for s in engine.scheduler.running) and engine.scheduler.running
        if decoding and start is None and not engine.scheduler.waiting:
            start, generated = time.perf_counter(), engine.num_decode_tokens
        engine.step()
    seconds = time.perf_counter() - start if start is not None else float("nan")
    tokens = engine.num_decode_tokens - generated
    row = {"k": k or 0, "batch": batch, "decode_tokens": tokens, "decode_seconds": seconds,
           "decode_tokens_per_s": tokens / seconds if seconds else float("nan")}
    stats = engine.drafter.stats if engine.drafter is not None else None
    if stats is not None:
        row.update(verify_rows=stats.num_drafts, draft_tokens=stats.num_draft_tokens,
                   accepted_tokens=stats.num_accepted_tokens,
                   acceptance=stats.num_accepted_tokens / max(1, stats.num_draft_tokens),
                   accepted_per_position=[n / max(1, stats.num_drafts) for n in stats.accepted_per_position])
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, default=None, help="default: the built-in model")
    parser.add_argument("--k", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    model_dir = args.model_dir or ensure_builtin_model()
    rows = []
    for batch in args.batch:
        base = measure(model_dir, None, batch, args)
        rows.append(base)
        for k in args.k:
            row = measure(model_dir, k, batch, args)
            row["speedup"] = row["decode_tokens_per_s"] / base["decode_tokens_per_s"]
            rows.append(row)
    print(f"{'batch':>5} {'k':>2} {'tok/s':>9} {'speedup':>8} {'accept':>7}  per position")
    for row in rows:
        per = " ".join(f"{p:.2f}" for p in row.get("accepted_per_position", []))
        print(f"{row['batch']:>5} {row['k']:>2} {row['decode_tokens_per_s']:>9.1f} {row.get('speedup', 1.0):>8.2f} "
              f"{row.get('acceptance', float('nan')):>7.2f}  {per}")
    if args.json is not None:
        args.json.write_text(json.dumps({"model_dir": str(model_dir), "options": vars(args) | {
            "model_dir": str(model_dir), "json": str(args.json)}, "rows": rows}, indent=1, default=str))


if __name__ == "__main__":
    main()
