"""The server's decode step under 64 concurrent HTTP requests, streamed and not, with the model's forward stubbed.

A real server (uvicorn, the app, the engine thread; `tests/server/inprocess_server.serving`) runs the built-in
model on the CPU with `ModelRunner.execute` returning fixed logits (`host_step_bench.stub_forward`), so what is
timed is the host: the engine's step, the engine thread's bookkeeping and the event loop's handlers (SSE chunks
for streamed requests, every step and with `--stream-interval 4`). A client process sends 64 `/v1/completions`
requests at once (1,100 prompt tokens, 400 generated (`--tokens`), greedy, `ignore_eos`). Printed per mode: the
median and mean time between the engine thread's steps while all 64 run, the server process's CPU time per step, the
client's wall time (after one untimed streamed run: a process's first is slower). The client shares the
machine's cores with the server: on a machine with few cores its own work slows the server's.

    .venv/bin/python benchmarks/server_step_bench.py          # prints a table, writes results/server_step.json
    .venv/bin/python benchmarks/server_step_bench.py --tokens 4000 --out results/server_step_4000.json  # long outputs
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SEQS, PROMPT, TOKENS = 64, 1_100, 400


async def _client(base_url: str, model: str, stream: bool, tokens: int) -> None:
    import httpx

    async def one(client: httpx.AsyncClient, i: int) -> None:
        rng = random.Random(i)
        body = {"model": model, "prompt": [rng.randrange(3, 200) for _ in range(PROMPT)], "max_tokens": tokens,
                "ignore_eos": True, "temperature": 0, "stream": stream}
        if stream:
            async with client.stream("POST", "/v1/completions", json=body) as response:
                response.raise_for_status()
                async for _ in response.aiter_lines():
                    pass
        else:
            (await client.post("/v1/completions", json=body)).raise_for_status()

    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=httpx.Limits(max_connections=SEQS)) as c:
        await asyncio.gather(*(one(c, i) for i in range(SEQS)))


def serve_once(stream: bool, stream_interval: int = 1, tokens: int = TOKENS) -> dict[str, float]:
    """One server (`--stream-interval stream_interval`), one client run; the step figures of the engine thread while
    all SEQS run."""
    sys.path[:0] = [p for p in (str(ROOT), str(ROOT / "benchmarks")) if p not in sys.path]
    import httpx
    from host_step_bench import stub_forward

    from hybridcache.config import EngineConfig
    from hybridcache.engine.engine import LLMEngine
    from tests.server.inprocess_server import serving

    starts: list[tuple[float, int]] = []
    step = LLMEngine.step

    def timed_step(self):  # noqa: ANN001, ANN202
        starts.append((time.perf_counter(), len(self.scheduler.running)))
        return step(self)

    LLMEngine.step = timed_step
    config = EngineConfig(block_size=16, max_model_len=max(4096, PROMPT + tokens + 16),
                          num_blocks=SEQS * (PROMPT + tokens) // 16 + 512,
                          max_num_seqs=SEQS, **({"stream_interval": stream_interval} if stream_interval > 1 else {}))
    with serving(config) as base_url:
        models = httpx.get(f"{base_url}/v1/models").json()["data"]
        stub_forward(320, token=7)  # (the built-in model's vocabulary)
        starts.clear()
        cpu = resource.getrusage(resource.RUSAGE_SELF)
        began = time.perf_counter()
        subprocess.run([sys.executable, __file__, "--client", base_url, models[0]["id"], str(stream), str(tokens)],
                       check=True)
        wall = time.perf_counter() - began
        after = resource.getrusage(resource.RUSAGE_SELF)
    LLMEngine.step = step
    full = [b[0] - a[0] for a, b in zip(starts, starts[1:]) if a[1] == b[1] == SEQS]
    seconds = after.ru_utime - cpu.ru_utime + after.ru_stime - cpu.ru_stime
    return {"median_step_ms": statistics.median(full) * 1e3, "mean_step_ms": statistics.mean(full) * 1e3,
            "cpu_ms_per_step": seconds / len(starts) * 1e3, "client_wall_s": wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--client", nargs=4, metavar=("URL", "MODEL", "STREAM", "TOKENS"), help=argparse.SUPPRESS)
    parser.add_argument("--tokens", type=int, default=TOKENS, help="tokens each request generates")
    parser.add_argument("--runs", type=int, default=2, help="alternating runs of each mode")
    parser.add_argument("--out", default="results/server_step.json")
    args = parser.parse_args()
    if args.client:
        url, model, stream, tokens = args.client
        asyncio.run(_client(url, model, stream == "True", int(tokens)))
        return
    # untimed: the process's first server and connections run slower than the rest
    serve_once(True, tokens=min(args.tokens, TOKENS))
    rows = []
    print("| requests | median step ms | mean step ms | server CPU ms a step | client wall s |")
    print("| --- | --- | --- | --- | --- |")
    for _ in range(args.runs):
        for stream, interval in ((True, 1), (True, 4), (False, 1)):
            try:
                times = serve_once(stream, interval, args.tokens)
            except TypeError as error:  # a tree from before `stream_interval`
                print(f"| streamed, --stream-interval {interval} | not in this tree: {error} |")
                continue
            row = {"stream": stream, "stream_interval": interval, **{k: round(v, 3) for k, v in times.items()}}
            rows.append(row)
            name = f"streamed, --stream-interval {interval}" if stream else "not streamed"
            print(f"| {name} | {row['median_step_ms']:.2f} | {row['mean_step_ms']:.2f} | "
                  f"{row['cpu_ms_per_step']:.2f} | {row['client_wall_s']:.2f} |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"seqs": SEQS, "prompt": PROMPT, "tokens": args.tokens, "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
