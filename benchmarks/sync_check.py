"""Where engine steps make the host wait for the device (a step that waits cannot overlap the next one).

    PYTHONUNBUFFERED=1 PYTHONPATH=. python benchmarks/sync_check.py [--model next-1b] [--model-dir DIR]

Builds the random model folder of `benchmarks/gpu_bench.py`, warms up (phase D's shapes: 16 fresh 1,024-token
prompts per prefill step, then decode), then runs the same workload again with
`torch.cuda.set_sync_debug_mode("warn")`: torch warns at every operation that synchronises the host with the
device. Prints each distinct call site (the innermost frames of this project, with the operation's warning) and
how often it fired, split by prefill and decode calls of `step()`; writes DIR/sync_check_<model>.json (DIR:
--out, else $OUT, else .). The one expected wait per call is `PendingSample.result()` (the previous step's tokens).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import sys
import traceback
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_bench import letters, model_folder  # noqa: E402  (benchmarks/ is not a package)

from hybridcache import LLM  # noqa: E402
from hybridcache.sampling import RequestOutputKind, SamplingParams  # noqa: E402

_PROJECT = os.sep + "hybridcache" + os.sep


def call_site(message: str) -> str:
    """The warning's operation and the innermost frames of this project that led to it."""
    frames = [f for f in traceback.extract_stack() if _PROJECT in f.filename and "sync_check" not in f.filename]
    where = " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(frames[-4:]))
    return f"{message.splitlines()[0][:100]} @ {where or 'outside hybridcache'}"


def run(llm: LLM, rng: random.Random, sites: dict[str, collections.Counter] | None) -> None:
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)
    for i in range(64):
        engine.add_request(f"s{rng.random()}-{i}", letters(rng, 1024), params)
    while engine.has_unfinished_requests():
        kind = "prefill" if engine.scheduler.waiting or any(
            s.num_computed < s.prompt_len for s in engine.scheduler.running) else "decode"
        if sites is None:
            engine.step()
            continue

        def record(message, category, filename, lineno, file=None, line=None, counter=sites[kind]) -> None:
            if "synchroniz" in str(message).lower():  # called where the warning is issued: the stack is the caller's
                counter[call_site(str(message))] += 1

        with warnings.catch_warnings():  # restores showwarning afterwards
            warnings.simplefilter("always")
            warnings.showwarning = record
            torch.cuda.set_sync_debug_mode("warn")
            try:
                engine.step()
            finally:
                torch.cuda.set_sync_debug_mode("default")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="next-1b")
    parser.add_argument("--model-dir", default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    folder = model_folder(args.model, args.model_dir)
    llm = LLM(folder, dtype="bfloat16", device="cuda", block_size=64, max_num_seqs=64, max_num_batched_tokens=16384)
    rng = random.Random(0)
    run(llm, rng, None)  # warm-up: every kernel compiled, pinned buffers allocated
    sites: dict[str, collections.Counter] = {"prefill": collections.Counter(), "decode": collections.Counter()}
    run(llm, rng, sites)
    for kind, counter in sites.items():
        print(f"\n{kind} steps: {sum(counter.values())} synchronising operations")
        for site, count in counter.most_common():
            print(f"  {count:5d}  {site}")
    out = Path(args.out or os.environ.get("OUT") or ".") / f"sync_check_{args.model}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({k: dict(v) for k, v in sites.items()}, indent=1))


if __name__ == "__main__":
    main()
