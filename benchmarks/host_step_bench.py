"""Host time of one decode step of 64 sequences, by part, with the model's forward replaced by stored logits.

The engine runs the built-in tiny model on the CPU, but `ModelRunner.execute` returns a fixed logits tensor (one
row per sampled sequence, its argmax a plain token) from the first step on, so what is timed is what the host does
around a forward: `_prepare`, `Scheduler.schedule` (planning and the cache's commit), `_launch` (the input build,
the stubbed forward, queueing the sampling), `_complete` (the sampled tokens into the sequences, the scheduler's and
the cache's `accept`, outputs). Contexts of 1,100 and 16,000 tokens (the prompts are fed as stubbed prefill steps,
then every step is a decode step of 64 rows), each with its requests' outputs returned once at the end (FINAL_ONLY,
as `LLM.generate` runs them), at every step (CUMULATIVE and DELTA), and run by the server's engine thread
(`EngineLoop`, its metrics, one asyncio handler per request draining its outputs: the time between the thread's
decode steps), streamed (DELTA) and not (FINAL_ONLY). Mean over the timed steps, after `--warm` untimed ones (the
outputs are that many tokens long when timing starts: `--warm 4000` shows what long completions cost).

    .venv/bin/python benchmarks/host_step_bench.py                  # prints a table, writes results/host_step.json
    PYTHONPATH=<another tree> python benchmarks/host_step_bench.py --out /tmp/other.json   # the same on that tree
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import json
import random
import time
from pathlib import Path

import torch

from hybridcache import LLM, RequestOutputKind, SamplingParams
from hybridcache.engine import runner as runner_mod
from hybridcache.server.engine_loop import EngineLoop
from hybridcache.server.metrics import ServerMetrics

PARTS = {"_prepare": "prepare", "schedule": "schedule", "_launch": "launch", "_complete": "complete"}


def stub_forward(vocab: int, token: int) -> None:
    """Replace the forward: logits whose argmax is `token`, one row per sequence that samples."""
    stored: dict[int, torch.Tensor] = {}

    def execute(self, batch, feed=None):  # noqa: ANN001, ANN202 (ModelRunner.execute's signature)
        n = int(batch.logits_indices.shape[0])
        if n not in stored:
            stored[n] = torch.zeros(n, vocab)
            stored[n][:, token] = 1.0
        return stored[n]

    runner_mod.ModelRunner.execute = execute


def stubbed_llm(context: int, seqs: int, max_tokens: int) -> tuple[LLM, list[list[int]], SamplingParams]:
    """The built-in model with its forward stubbed, room for `seqs` sequences of `context` + `max_tokens`
    tokens, `seqs` random prompts of `context` tokens, and greedy parameters for `max_tokens` tokens."""
    llm = LLM(None, device="cpu", max_num_seqs=seqs, max_model_len=context + max_tokens + 8,
              max_num_batched_tokens=max(8192, context), num_blocks=seqs * (context + max_tokens) // 16 + 512)
    stub_forward(llm.engine.model_config.vocab_size, token=7)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 200) for _ in range(context)] for _ in range(seqs)]
    return llm, prompts, SamplingParams(max_tokens=max_tokens + 4, ignore_eos=True, temperature=0.0)


def time_served(context: int, seqs: int, steps: int, warm: int, final_only: bool) -> dict[str, float]:
    """Mean ms between the engine thread's decode steps when the server's `EngineLoop` runs the requests (with
    its metrics) and one asyncio handler per request drains its output queue; `final_only`: as the server runs a
    request that is not streamed."""
    llm, prompts, params = stubbed_llm(context, seqs, warm + 2 * steps)
    engine = llm.engine
    starts: list[float] = []
    step = engine.step

    def timed_step():  # noqa: ANN202
        if not any(s.num_computed < s.prompt_len for s in engine.scheduler.running) and not engine.scheduler.waiting:
            starts.append(time.perf_counter())
        return step()

    engine.step = timed_step

    async def serve() -> None:
        loop = EngineLoop(engine, metrics=ServerMetrics())
        loop.start()
        extra = {"final_only": True} if final_only else {}  # (a tree from before it runs the streamed rows only)
        sinks = await loop.add_many([str(i) for i in range(seqs)], prompts, params, **extra)

        async def drain(sink: asyncio.Queue) -> None:
            while not (await sink.get()).finished:
                pass

        await asyncio.gather(*(drain(sink) for sink in sinks))
        loop.stop()

    asyncio.run(serve())
    llm.close()
    gaps = [b - a for a, b in zip(starts[warm:], starts[warm + 1:warm + steps + 1])]
    return {"step": sum(gaps) / len(gaps) * 1e3}


def time_steps(context: int, seqs: int, steps: int, warm: int, kind: RequestOutputKind) -> dict[str, float]:
    """Mean ms per decode step, whole and by part, of `seqs` sequences whose prompts are `context` tokens;
    `kind`: what the requests' outputs hold (`RequestOutputKind`)."""
    llm, prompts, params = stubbed_llm(context, seqs, warm + 2 * steps)
    engine = llm.engine
    params = dataclasses.replace(params, output_kind=kind)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    while engine.scheduler.waiting or any(s.num_computed < s.prompt_len for s in engine.scheduler.running):
        engine.step()
    for _ in range(warm):
        engine.step()
    totals: collections.Counter[str] = collections.Counter()
    for owner, name in [(engine, "_prepare"), (engine.scheduler, "schedule"), (engine, "_launch"),
                        (engine, "_complete")]:
        inner = getattr(owner, name)

        def timed(*args, _inner=inner, _label=PARTS[name], **kwargs):  # noqa: ANN002, ANN003, ANN202
            start = time.perf_counter()
            try:
                return _inner(*args, **kwargs)
            finally:
                totals[_label] += time.perf_counter() - start

        setattr(owner, name, timed)
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    wall = time.perf_counter() - start
    engine.check_integrity()
    llm.close()
    return {"step": wall / steps * 1e3, **{label: totals[label] / steps * 1e3 for label in PARTS.values()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", default="1100,16000", help="prompt lengths, comma-separated")
    parser.add_argument("--seqs", type=int, default=64)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warm", type=int, default=20)
    parser.add_argument("--out", default="results/host_step.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    print("| context | outputs | step ms | " + " | ".join(PARTS.values()) + " |\n| --- | --- | --- |"
          + " --- |" * len(PARTS))
    for context in (int(c) for c in args.contexts.split(",")):
        for outputs in ("final", "every step", "every step, delta", "server, streamed", "server, not streamed"):
            if outputs.startswith("server"):
                try:
                    times = time_served(context, args.seqs, args.steps, args.warm,
                                        final_only=outputs.endswith("not streamed"))
                except TypeError as error:  # an older tree's EngineLoop
                    print(f"| {context:,} | {outputs} | not in this tree: {error} |")
                    continue
            else:
                kind = {"final": RequestOutputKind.FINAL_ONLY, "every step": RequestOutputKind.CUMULATIVE}.get(
                    outputs, RequestOutputKind.DELTA)
                times = time_steps(context, args.seqs, args.steps, args.warm, kind)
            row = {"context": context, "outputs": outputs, **{k: round(v, 4) for k, v in times.items()}}
            rows.append(row)
            print(f"| {context:,} | {outputs} | {row['step']:.3f} | "
                  + " | ".join(f"{row[p]:.3f}" if p in row else "" for p in PARTS.values()) + " |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"seqs": args.seqs, "steps": args.steps, "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
