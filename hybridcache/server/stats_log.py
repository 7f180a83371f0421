"""The periodic stats line of a server, as vLLM logs one: throughput since the last line, queue and memory use,
and the prefix-cache hit rate.

    Avg prompt throughput: 812.0 tokens/s, Avg generation throughput: 95.5 tokens/s, Running: 4 reqs,
    Waiting: 0 reqs, KV cache usage: 37.5%, State slot usage: 18.8%, Prefix cache hit rate: 61.2%

(one line in the log). Prompt throughput counts prompt tokens computed (cache hits skip their computation);
the hit rate is cached / prompt tokens of the requests that finished since the last line ("-" when none did).
A line is written at most every `interval_s` seconds and only when something changed since the last one, so an
idle server writes one line after its last request and then stays quiet. A line covers at most one interval of
activity: when an idle spell ends (`rebase`), the next line's interval starts there, so its throughput is not
averaged over the idle time. A data-parallel replica's lines start with its index, as vLLM's
(`Engine 001: Avg prompt throughput: ...`), so that the replicas' lines in one log can be told apart.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridcache.server.engine_state import EngineState
from hybridcache.server.metrics import usage_percent


@dataclass(frozen=True)
class StatsCounters:
    """Running totals since start: prompt tokens computed, tokens generated, and the prompt and cached tokens
    of finished requests."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    query_tokens: int = 0
    hit_tokens: int = 0


class StatsLogger:
    """Decides when to log and formats the line. The caller owns the clock: `due_in(now, counters)` says how
    long to wait before the next line (None: nothing to report), `line(now, counters, state)` returns the line
    when one is due (and takes it as the new reference) or None. `engine_index`: the data-parallel replica's index,
    which starts each line (`Engine 00N: `), or None."""

    def __init__(self, interval_s: float, start_s: float, engine_index: int | None = None) -> None:
        if interval_s <= 0:
            raise ValueError(f"the stats interval must be > 0 seconds, got {interval_s}")
        self.interval_s = interval_s
        self._prefix = f"Engine {engine_index:03d}: " if engine_index is not None else ""
        self._last_time = start_s
        self._last = StatsCounters()

    def due_in(self, now: float, counters: StatsCounters) -> float | None:
        """Seconds until the next line is due (0 when it is), or None when nothing changed since the last one."""
        if counters == self._last:
            return None
        return max(0.0, self._last_time + self.interval_s - now)

    def rebase(self, now: float, counters: StatsCounters) -> None:
        """An idle spell ended at `now`: when nothing changed since the last line, the next one's interval starts
        here (not at the last line, before the idle time)."""
        if counters == self._last:
            self._last_time = now

    def line(self, now: float, counters: StatsCounters, state: EngineState) -> str | None:
        if self.due_in(now, counters) != 0.0:
            return None
        elapsed = max(now - self._last_time, 1e-9)
        last = self._last
        queries = counters.query_tokens - last.query_tokens
        hit_rate = f"{100.0 * (counters.hit_tokens - last.hit_tokens) / queries:.1f}%" if queries else "-"
        self._last, self._last_time = counters, now
        return (
            f"{self._prefix}"
            f"Avg prompt throughput: {(counters.prompt_tokens - last.prompt_tokens) / elapsed:.1f} tokens/s, "
            f"Avg generation throughput: {(counters.generation_tokens - last.generation_tokens) / elapsed:.1f} "
            f"tokens/s, Running: {state.num_running} reqs, Waiting: {state.num_waiting} reqs, "
            f"KV cache usage: {usage_percent(state.num_blocks_used, state.num_blocks):.1f}%, "
            f"State slot usage: {usage_percent(state.num_slots_used, state.num_slots):.1f}%, "
            f"Prefix cache hit rate: {hit_rate}"
        )
