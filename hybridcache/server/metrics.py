"""Prometheus metrics of one server (its own registry: no process-wide state).

Request-level metrics are recorded by the engine thread as outputs come out of `engine.step()`:

    hybridcache_prefix_cache_queries_tokens_total   prompt tokens of finished requests (as in `usage`)
    hybridcache_prefix_cache_hit_tokens_total       their `cached_tokens` (as in `usage`), so the two move by
                                                    exactly what the responses reported
    hybridcache_prompt_tokens_total / hybridcache_generation_tokens_total
    hybridcache_request_finished_total{finish_reason}   completions (choices) that ended, by reason
                                                    (stop, length, abort, error); n choices count n
    hybridcache_time_to_first_token_seconds         arrival -> first sampled token
    hybridcache_inter_token_latency_seconds         time between a request's consecutive token steps
    hybridcache_e2e_request_latency_seconds         arrival -> finish

Engine-level metrics are read from the latest `EngineState` snapshot at scrape time:

    hybridcache_checkpoint_saves_total{reason}      published state checkpoints, by save reason
    hybridcache_checkpoint_evictions_total{kind}    evictions, by kind
    hybridcache_kv_blocks_used / _total, hybridcache_state_slots_used / _total (cache contents included)
    hybridcache_checkpoints, hybridcache_num_requests_running / _waiting, hybridcache_preemptions_total
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from hybridcache.server.engine_state import EngineState

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ServerMetrics:
    """The metric objects of one server; `render()` is the /metrics body. Thread-safe (prometheus-client)."""

    def __init__(self) -> None:
        self.registry = registry = CollectorRegistry()
        self.query_tokens = Counter(
            "hybridcache_prefix_cache_queries_tokens", "Prompt tokens of finished requests", registry=registry)
        self.hit_tokens = Counter(
            "hybridcache_prefix_cache_hit_tokens", "Prompt tokens of finished requests whose computation the "
            "prefix cache skipped (usage.prompt_tokens_details.cached_tokens)", registry=registry)
        self.prompt_tokens = Counter("hybridcache_prompt_tokens", "Prompt tokens of finished requests",
                                     registry=registry)
        self.generation_tokens = Counter("hybridcache_generation_tokens", "Generated tokens", registry=registry)
        self.finished = Counter("hybridcache_request_finished", "Completions (choices) that ended, by reason",
                                ["finish_reason"], registry=registry)
        self.ttft = Histogram("hybridcache_time_to_first_token_seconds", "Time to first token",
                              buckets=_LATENCY_BUCKETS, registry=registry)
        self.itl = Histogram("hybridcache_inter_token_latency_seconds", "Time between a request's token steps",
                             buckets=_LATENCY_BUCKETS, registry=registry)
        self.e2e = Histogram("hybridcache_e2e_request_latency_seconds", "Arrival to finish",
                             buckets=_LATENCY_BUCKETS, registry=registry)

    def watch_engine(self, engine_state: Callable[[], EngineState]) -> None:
        """Export the engine-level metrics, read from `engine_state()` at every scrape."""
        self.registry.register(_EngineCollector(engine_state))

    def request_finished(self, num_prompt_tokens: int, num_cached_tokens: int, finish_reasons: list[str],
                         latency_s: float) -> None:
        """A request ended (finished or aborted after its prompt was computed)."""
        self.query_tokens.inc(num_prompt_tokens)
        self.hit_tokens.inc(num_cached_tokens)
        self.prompt_tokens.inc(num_prompt_tokens)
        for reason in finish_reasons:
            self.finished.labels(finish_reason=reason).inc()
        self.e2e.observe(latency_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector(Collector):
    """Reads the engine snapshot at scrape time (the engine thread refreshes it after every step)."""

    def __init__(self, engine_state: Callable[[], EngineState]) -> None:
        self._engine_state = engine_state

    def collect(self) -> Iterator[Metric]:
        state = self._engine_state()
        saves = CounterMetricFamily("hybridcache_checkpoint_saves", "Published state checkpoints, by reason",
                                    labels=["reason"])
        for reason, count in sorted(state.checkpoint_saves.items()):
            saves.add_metric([str(reason)], count)
        yield saves
        evictions = CounterMetricFamily("hybridcache_checkpoint_evictions", "Cache evictions, by kind",
                                        labels=["kind"])
        for kind, count in sorted(state.checkpoint_evictions.items()):
            evictions.add_metric([str(kind)], count)
        yield evictions
        yield CounterMetricFamily("hybridcache_preemptions", "Preempted sequences", value=state.num_preemptions)
        gauges = (
            ("hybridcache_kv_blocks_used", "KV blocks in use (running sequences and the prefix cache)",
             state.num_blocks_used),
            ("hybridcache_kv_blocks_total", "KV blocks in the pool", state.num_blocks),
            ("hybridcache_state_slots_used", "State slots in use (running sequences and checkpoints)",
             state.num_slots_used),
            ("hybridcache_state_slots_total", "State slots in the pool", state.num_slots),
            ("hybridcache_checkpoints", "Published state checkpoints held", state.num_checkpoints),
            ("hybridcache_num_requests_running", "Sequences running", state.num_running),
            ("hybridcache_num_requests_waiting", "Sequences waiting", state.num_waiting),
        )
        for name, documentation, value in gauges:
            yield GaugeMetricFamily(name, documentation, value=value)
