"""`hybridcache bench --server URL`: the same workload against a running `hybridcache serve`, with concurrent
clients over HTTP.

Every chat session is one client that sends its turns one after another (closed loop, like the offline
benchmark); all sessions run at once, up to `concurrency` requests in flight. Other workloads send every
request at once (up to `concurrency`). Each call is a streaming `POST /v1/completions` with the prompt as
token ids, greedy, `ignore_eos`, `stream_options.include_usage` and `return_token_ids`, so that:
time to first token = first streamed chunk; end-to-end = the `[DONE]` event; `cached_tokens` =
`usage.prompt_tokens_details.cached_tokens` (the request's, once for its `n` choices, as the offline benchmark
counts it); the generated token ids (for the next turn's prompt) are each choice's chunks' `token_ids` joined (a
chunk carries the ids generated since the choice's previous one, as vLLM's). The server runs one cache mode, so
the result has one mode, named `server`. Calls whose prompt + `max_tokens` pass the server's `max_model_len` (its
`/v1/models` card; it would answer 400) are dropped as the offline benchmark drops them (a session ends before
such a turn).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable

from hybridcache.bench.engine_bench import BenchConfig, BenchResult, CallRecord, fits, max_tokens_of, summarize
from hybridcache.bench.workloads import Workload


class ServerError(ConnectionError):
    """The server could not be reached or answered a request with an error."""


async def _call(client, url: str, model: str, prompt_ids: tuple[int, ...], max_tokens: int, n: int,
                key: str, turn: int) -> CallRecord:
    body = {
        "model": model, "prompt": list(prompt_ids), "max_tokens": max_tokens, "temperature": 0.0, "n": n,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True,
    }
    start = time.perf_counter()
    first = None
    token_ids: dict[int, list[int]] = {}
    cached = 0
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise ServerError(f"{url} answered {response.status_code}: {(await response.aread()).decode()}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            if "error" in event:
                raise ServerError(f"{url} failed the request: {event['error']}")
            if event.get("choices") and first is None:
                first = time.perf_counter()
            for choice in event.get("choices", []):  # each chunk carries the ids since the choice's last one
                token_ids.setdefault(choice["index"], []).extend(choice.get("token_ids") or ())
            if event.get("usage"):
                cached = event["usage"]["prompt_tokens_details"]["cached_tokens"]
    end = time.perf_counter()
    outputs = tuple(tuple(token_ids.get(i, ())) for i in range(n))
    return CallRecord(key=key, turn=turn, prompt_len=len(prompt_ids), cached_tokens=cached, output_ids=outputs,
                      ttft_s=(first or end) - start, e2e_s=end - start)


async def _run(url: str, workload: Workload, config: BenchConfig, concurrency: int,
               on_progress: Callable[[], None] | None) -> tuple[str, list[CallRecord], float, int | None, int]:
    """The workload against the server: its model, the records, the wall time, its `max_model_len` (None when its
    model card does not say) and the calls dropped for it."""
    import httpx

    limit = asyncio.Semaphore(concurrency)
    records: list[CallRecord] = []
    num_dropped = 0
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        models = (await client.get(f"{url}/v1/models")).json()["data"]
        model, max_model_len = models[0]["id"], models[0].get("max_model_len")

        def fit(prompt_ids: tuple[int, ...], reply_len: int) -> bool:
            return fits(len(prompt_ids), max_tokens_of(reply_len, config.max_reply_tokens), max_model_len)

        async def call(key: str, turn: int, prompt_ids: tuple[int, ...], reply_len: int, n: int) -> CallRecord:
            async with limit:
                max_tokens = max_tokens_of(reply_len, config.max_reply_tokens)
                result = await _call(client, url, model, prompt_ids, max_tokens, n, key, turn)
            records.append(result)
            if on_progress is not None:
                on_progress()
            return result

        async def session(s) -> None:
            nonlocal num_dropped
            prompt_ids = s.first_prompt_ids
            for k, turn in enumerate(s.turns):
                if not fit(prompt_ids, len(turn.reply_ids) + 1):
                    num_dropped += len(s.turns) - k  # the session ends here
                    return
                result = await call(f"{s.session_id}/{k}", k, prompt_ids, len(turn.reply_ids) + 1, 1)
                prompt_ids = prompt_ids + result.output_ids[0] + turn.after_ids

        start = time.perf_counter()
        if workload.sessions is not None:
            await asyncio.gather(*(session(s) for s in workload.sessions))
        else:
            requests = list(workload)
            kept = [r for r in requests if fit(r.prompt_ids, len(r.output_ids))]
            num_dropped = len(requests) - len(kept)
            await asyncio.gather(*(call(r.request_id, r.turn, r.prompt_ids, len(r.output_ids), r.n) for r in kept))
        return model, records, time.perf_counter() - start, max_model_len, num_dropped


def run_server_bench(url: str, workload: Workload, config: BenchConfig, *, concurrency: int = 64,
                     on_progress: Callable[[], None] | None = None) -> BenchResult:
    """Run `workload` against the server at `url` (e.g. http://127.0.0.1:8000); one mode, `server`.
    `prefill_tokens_computed` is the prompt tokens the server did not take from its cache (each request's once)."""
    import httpx

    try:
        model, records, wall, max_model_len, num_dropped = asyncio.run(
            _run(url.rstrip("/"), workload, config, concurrency, on_progress))
    except httpx.HTTPError as error:
        raise ServerError(f"cannot benchmark {url}: {error!r}") from error
    prefill = sum(r.prompt_len - r.cached_tokens for r in records)
    result = summarize("server", records, wall, prefill, max_model_len=max_model_len, num_dropped=num_dropped)
    return BenchResult(workload.name, model, {"server": result}, True, ())
