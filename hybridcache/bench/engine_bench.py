"""The engine benchmark (`hybridcache bench`): a workload through the real engine, once per cache mode.

For each mode a fresh `LLM(model, cache_mode=MODE, ...)` runs the same workload, driven step by step
through `llm.engine.add_request` / `llm.engine.step()`, so each request's time to first token is the time
from `add_request` to the first step whose outputs include it. Greedy sampling, `ignore_eos`, and
`max_tokens` = the recorded reply length (+1 for the end-of-turn token) capped at `max_reply_tokens`.

Chat workloads are closed-loop clients: every session starts at once, and when turn k finishes its next
prompt is built from the *generated* reply and queued at once (no think time)::

    prompt_{k+1} = prompt_k + generated_k + turns[k].after_ids   (end-of-turn, next message, generation prompt)

Other workloads queue every request at the start, in arrival order (`n` completions per request).

A call whose prompt + `max_tokens` passes the engine's `max_model_len` is dropped before it is queued (the engine
refuses such a prompt, a server answers 400): a request is skipped, a session ends before that turn; the result
counts them (`num_dropped`).

Reported per mode: token hit rate (cached prompt tokens / prompt tokens, each request's prompt counted once: its
`n` completions share one prefill, and the request's cached tokens are `RequestOutput.num_cached_tokens`, the
smallest over them, as a server's usage reports), prefill tokens computed (`engine.num_prefill_tokens`), TTFT
p50/p95 and end-to-end latency p50/p95 per request, output tokens/s over the mode's wall time (every completion's),
and the hit rate per turn; plus whether every mode generated the same tokens.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from hybridcache.bench.workloads import SimRequest, Workload

BENCH_MODES = ("none", "block-aligned", "seed", "hybridcache")
# Warm-up before each mode: several prefill chunks and a few decode steps, so that the first mode measured
# does not pay the process's first-time costs (allocator, kernel selection). Byte ids 1..250 only: no chat
# prompt starts with them, so nothing is shared with the workload.
_WARMUP_PROMPT = [(7 * i) % 250 + 1 for i in range(1500)]


@dataclass(frozen=True)
class BenchConfig:
    """Modes to compare, the reply-length cap and the engine options every mode shares."""

    modes: tuple[str, ...] = ("none", "block-aligned", "hybridcache")
    max_reply_tokens: int = 32
    engine_options: dict = field(default_factory=dict)


@dataclass(frozen=True)
class CallRecord:
    """One request (a model call): its key (session/turn or request id), turn, prompt length, the prompt tokens
    its cache hit skipped (the request's: with `n` > 1 the smallest over its completions, which share one
    prefill), each completion's generated ids (completion 0 first) and its timings (seconds)."""

    key: str
    turn: int
    prompt_len: int
    cached_tokens: int
    output_ids: tuple[tuple[int, ...], ...]
    ttft_s: float
    e2e_s: float

    def completion_outputs(self) -> dict[str, tuple[int, ...]]:
        """Each completion's generated ids by `KEY#INDEX`."""
        return {f"{self.key}#{i}": ids for i, ids in enumerate(self.output_ids)}


@dataclass(frozen=True)
class ModeResult:
    mode: str
    token_hit_rate: float
    prefill_tokens_computed: int
    ttft_p50_s: float
    ttft_p95_s: float
    e2e_p50_s: float
    e2e_p95_s: float
    output_tokens_per_s: float
    wall_s: float
    num_calls: int
    hit_rate_by_turn: dict[int, float]
    ttfts_s: tuple[float, ...]
    max_model_len: int | None = None  # the engine's (the server's, when it says); None: unknown, nothing dropped
    num_dropped: int = 0  # calls not run: prompt + max_tokens over max_model_len (a session's later turns with it)

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class BenchResult:
    workload: str
    model: str
    modes: dict[str, ModeResult]
    outputs_identical: bool
    mismatched_calls: tuple[str, ...]

    def to_json(self) -> dict:
        return {"workload": self.workload, "model": self.model, "outputs_identical": self.outputs_identical,
                "mismatched_calls": list(self.mismatched_calls),
                "modes": {m: r.to_json() for m, r in self.modes.items()}}


def max_tokens_of(reply_len: int, max_reply_tokens: int) -> int:
    """A call's `max_tokens`: the recorded reply length capped at `max_reply_tokens` (at least 1)."""
    return max(1, min(reply_len, max_reply_tokens))


def fits(prompt_len: int, max_tokens: int, max_model_len: int | None) -> bool:
    """Whether a call of `prompt_len` tokens asking for `max_tokens` fits `max_model_len` (None: unknown, yes)."""
    return max_model_len is None or prompt_len + max_tokens <= max_model_len


class _Driver:
    """Steps one engine, timing each request from `add` to its first and last token; counts the calls that do not
    fit its `max_model_len` (`num_dropped`)."""

    def __init__(self, engine, max_reply_tokens: int) -> None:
        from hybridcache import SamplingParams

        self.engine = engine
        self.max_reply_tokens = max_reply_tokens
        self._params = SamplingParams
        self.added: dict[str, tuple[float, int, Callable]] = {}
        self.first: dict[str, float] = {}
        self.records: list[CallRecord] = []
        self.num_dropped = 0

    def fits(self, prompt_ids: tuple[int, ...], reply_len: int) -> bool:
        return fits(len(prompt_ids), max_tokens_of(reply_len, self.max_reply_tokens), self.engine.max_model_len)

    def add(self, request_id: str, turn: int, prompt_ids: tuple[int, ...], reply_len: int, n: int,
            on_done: Callable[[list[tuple[int, ...]]], None]) -> None:
        params = self._params(temperature=0.0, max_tokens=max_tokens_of(reply_len, self.max_reply_tokens),
                              ignore_eos=True, n=n)
        self.engine.add_request(request_id, list(prompt_ids), params)
        self.added[request_id] = (time.perf_counter(), turn, on_done)

    def run(self, on_progress: Callable[[], None] | None = None) -> None:
        engine = self.engine
        while engine.has_unfinished_requests():
            outputs = engine.step()
            now = time.perf_counter()
            for out in outputs:
                self.first.setdefault(out.request_id, now)
                if not out.finished:
                    continue
                start, turn, on_done = self.added.pop(out.request_id)
                outputs = [tuple(c.token_ids) for c in sorted(out.outputs, key=lambda c: c.index)]
                self.records.append(CallRecord(
                    key=out.request_id, turn=turn, prompt_len=len(out.prompt_token_ids),
                    cached_tokens=out.num_cached_tokens, output_ids=tuple(outputs),
                    ttft_s=self.first[out.request_id] - start, e2e_s=now - start,
                ))
                if on_progress is not None:
                    on_progress()
                on_done(outputs)


def _queue_workload(driver: _Driver, workload: Workload) -> None:
    if workload.sessions is None:
        for request in workload:
            _queue_request(driver, request)
        return
    for session in workload.sessions:
        _queue_turn(driver, session, 0, session.first_prompt_ids)


def _queue_request(driver: _Driver, request: SimRequest) -> None:
    if not driver.fits(request.prompt_ids, len(request.output_ids)):
        driver.num_dropped += 1
        return
    driver.add(request.request_id, request.turn, request.prompt_ids, len(request.output_ids), request.n,
               lambda outputs: None)


def _queue_turn(driver: _Driver, session, k: int, prompt_ids: tuple[int, ...]) -> None:
    turn = session.turns[k]
    if not driver.fits(prompt_ids, len(turn.reply_ids) + 1):
        driver.num_dropped += len(session.turns) - k  # the session ends here
        return

    def on_done(outputs: list[tuple[int, ...]]) -> None:
        if k + 1 < len(session.turns):
            _queue_turn(driver, session, k + 1, prompt_ids + outputs[0] + turn.after_ids)

    driver.add(f"{session.session_id}/{k}", k, prompt_ids, len(turn.reply_ids) + 1, 1, on_done)


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else 0.0


def run_mode(model_path: str | Path | None, mode: str, workload: Workload, config: BenchConfig,
             on_progress: Callable[[], None] | None = None) -> tuple[ModeResult, dict[str, tuple[int, ...]]]:
    """One mode: a fresh engine, a warm-up request, then the workload. Returns the summary and every
    completion's generated ids by key."""
    from hybridcache import LLM, SamplingParams

    llm = LLM(model_path, cache_mode=mode, **config.engine_options)
    engine = llm.engine
    warmup = _WARMUP_PROMPT[: max(1, engine.max_model_len - 8)]
    llm.generate([warmup], SamplingParams(temperature=0.0, max_tokens=min(8, engine.max_model_len - len(warmup))),
                 use_tqdm=False)
    prefill_before = engine.num_prefill_tokens
    driver = _Driver(engine, config.max_reply_tokens)
    start = time.perf_counter()
    _queue_workload(driver, workload)
    driver.run(on_progress)
    wall = time.perf_counter() - start
    result = summarize(mode, driver.records, wall, engine.num_prefill_tokens - prefill_before,
                       max_model_len=engine.max_model_len, num_dropped=driver.num_dropped)
    return result, {key: ids for r in driver.records for key, ids in r.completion_outputs().items()}


def summarize(mode: str, records: list[CallRecord], wall: float, prefill_tokens: int, *,
              max_model_len: int | None = None, num_dropped: int = 0) -> ModeResult:
    """One mode's summary of its requests (shared by the offline and the server benchmark)."""
    prompt = sum(r.prompt_len for r in records)
    cached = sum(r.cached_tokens for r in records)
    by_turn: dict[int, list[int]] = {}
    for r in records:
        acc = by_turn.setdefault(r.turn, [0, 0])
        acc[0] += r.cached_tokens
        acc[1] += r.prompt_len
    ttfts = [r.ttft_s for r in records]
    e2es = [r.e2e_s for r in records]
    return ModeResult(
        mode=mode,
        token_hit_rate=cached / prompt if prompt else 0.0,
        prefill_tokens_computed=prefill_tokens,
        ttft_p50_s=_percentile(ttfts, 50), ttft_p95_s=_percentile(ttfts, 95),
        e2e_p50_s=_percentile(e2es, 50), e2e_p95_s=_percentile(e2es, 95),
        output_tokens_per_s=sum(len(ids) for r in records for ids in r.output_ids) / wall if wall > 0 else 0.0,
        wall_s=wall,
        num_calls=len(records),
        hit_rate_by_turn={t: c / p if p else 0.0 for t, (c, p) in sorted(by_turn.items())},
        ttfts_s=tuple(sorted(ttfts)),
        max_model_len=max_model_len,
        num_dropped=num_dropped,
    )


def run_bench(model_path: str | Path | None, workload: Workload, config: BenchConfig,
              on_progress: Callable[[], None] | None = None, model_name: str = "builtin") -> BenchResult:
    """Every mode in `config.modes` over the same workload; compares the generated tokens across modes."""
    results: dict[str, ModeResult] = {}
    outputs: dict[str, dict[str, tuple[int, ...]]] = {}
    for mode in config.modes:
        results[mode], outputs[mode] = run_mode(model_path, mode, workload, config, on_progress)
    reference = outputs[config.modes[0]]
    mismatched = sorted({key for mode in config.modes[1:] for key in set(reference) | set(outputs[mode])
                         if reference.get(key) != outputs[mode].get(key)})
    return BenchResult(workload.name, model_name, results, not mismatched, tuple(mismatched))


def count_calls(workload: Workload) -> int:
    """Requests the benchmark runs per mode (for a progress bar)."""
    if workload.sessions is not None:
        return sum(len(s.turns) for s in workload.sessions)
    return len(workload)
