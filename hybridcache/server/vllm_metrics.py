"""vLLM's Prometheus metrics, under vLLM's names, next to the `hybridcache_*` ones (metrics.py), so that a vLLM
dashboard or autoscaler reads this server unchanged. Every sample carries vLLM's labels `model_name` (the first
served model name) and `engine` ("0": one engine).

    vllm:num_requests_running / vllm:num_requests_waiting   gauges: sequences running / waiting
    vllm:kv_cache_usage_perc        gauge in [0, 1]: the pool's blocks held by running requests (0 when idle);
                                    what the prefix cache alone holds is hybridcache_prefix_cache_usage_perc
    vllm:prefix_cache_queries_total / vllm:prefix_cache_hits_total   prompt tokens of computed requests and their
                                    cached tokens (as in `usage`), counted at the first token (as vLLM's), or at
                                    the end of a request that ended before it
    vllm:prompt_tokens_total / vllm:generation_tokens_total   (prompt tokens: as the two above)
    vllm:request_success_total{finished_reason}   completions that ended, by reason (stop, length, abort, error;
                                    each at 0 from the start, as vLLM's),
                                    as hybridcache_request_finished_total: aborted ones whether queued or
                                    running (vLLM declares `abort` but its client aborts never reach it,
                                    vllm-project/vllm#31503)
    vllm:num_preemptions_total
    vllm:spec_decode_num_drafts_total, vllm:spec_decode_num_draft_tokens_total,
    vllm:spec_decode_num_accepted_tokens_total, vllm:spec_decode_num_accepted_tokens_per_pos_total{position}
                                    with speculative decoding (vLLM's SpecDecodingProm): verify rows, draft tokens
                                    fed, accepted, and accepted by draft position (numbered from 0, as vLLM's)
    vllm:time_to_first_token_seconds, vllm:inter_token_latency_seconds, vllm:e2e_request_latency_seconds
                                    with vLLM's buckets; TTFT and e2e count from the request's arrival (when the
                                    server queued it for the engine thread, even while that thread runs a step).
                                    These and the three below are observed per completion (n completions: n
                                    observations, as vLLM's n child requests)
    vllm:request_queue_time_seconds     the engine thread's pickup -> the first step that computes the request
    vllm:request_prefill_time_seconds   that step's start -> the first token
    vllm:request_decode_time_seconds    the first token -> the last
    vllm:request_prompt_tokens          histogram, per completion: its prompt's tokens (vLLM counts each of n
                                        completions as a request of its own)
    vllm:request_generation_tokens      histogram, per completion: the tokens it generated
    vllm:request_max_num_generation_tokens   histogram, per request: the most tokens one of its completions generated
    (the token histograms have vLLM's 1-2-5 buckets up to max_model_len)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from hybridcache.server.engine_state import EngineState
from hybridcache.server.weighted_histogram import WeightedHistogram

_LABELS = ("model_name", "engine")
ENGINE_LABEL = "0"
# every finish reason a completion can end with (vLLM's FinishReason): their counters exist, at 0, from the start
FINISH_REASONS = ("stop", "length", "abort", "error")
# vLLM's buckets for request latencies (seconds)
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                    480.0, 960.0, 1920.0, 7680.0)
# vLLM's buckets for the time to first token, and for the inter-token latency (seconds)
_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                  40.0, 80.0, 160.0, 640.0, 2560.0)
_INTER_TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                        40.0, 80.0)


DEFAULT_MAX_TOKEN_BUCKET = 1_000_000  # the token histograms' top bucket when max_model_len is not given


def token_count_buckets(max_value: int) -> tuple[int, ...]:
    """vLLM's buckets for token counts: 1, 2, 5, 10, 20, 50, ... up to `max_value` (`build_1_2_5_buckets`)."""
    buckets = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return tuple(buckets)
            buckets.append(mantissa * scale)
        scale *= 10


class VllmMetrics:
    """vLLM's request-level metrics in `registry`; `watch_engine` adds the engine-level ones. `max_model_len`:
    the top of the token histograms' buckets (None: `DEFAULT_MAX_TOKEN_BUCKET`)."""

    def __init__(self, registry: CollectorRegistry, model_name: str, max_model_len: int | None = None) -> None:
        self.model_name = model_name
        labels = {"model_name": model_name, "engine": ENGINE_LABEL}

        def counter(name: str, documentation: str) -> Any:
            return Counter(name, documentation, _LABELS, registry=registry).labels(**labels)

        def histogram(name: str, documentation: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(name, documentation, _LABELS, buckets=buckets, registry=registry).labels(**labels)

        self.prefix_cache_queries = counter("vllm:prefix_cache_queries", "Prompt tokens queried in the prefix cache")
        self.prefix_cache_hits = counter("vllm:prefix_cache_hits", "Prompt tokens the prefix cache skipped")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens of computed requests")
        self.generation_tokens = counter("vllm:generation_tokens", "Generated tokens")
        self._success = Counter("vllm:request_success", "Completions that ended, by finish reason",
                                [*_LABELS, "finished_reason"], registry=registry)
        for reason in FINISH_REASONS:  # as vLLM: a series per reason from the start, so rate() sees the first one
            self.success(reason)
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to first token", _TOKEN_BUCKETS)
        self.itl = WeightedHistogram("vllm:inter_token_latency_seconds", "Time between a request's token steps",
                                     labels, _INTER_TOKEN_BUCKETS, registry)  # one observe a step (engine_loop)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Arrival to finish", _REQUEST_BUCKETS)
        self.queue_time = histogram("vllm:request_queue_time_seconds", "Arrival to the first step that computes "
                                    "the request", _REQUEST_BUCKETS)
        self.prefill_time = histogram("vllm:request_prefill_time_seconds", "The first computing step's start to "
                                      "the first token", _REQUEST_BUCKETS)
        self.decode_time = histogram("vllm:request_decode_time_seconds", "The first token to the last",
                                     _REQUEST_BUCKETS)
        tokens = token_count_buckets(max_model_len or DEFAULT_MAX_TOKEN_BUCKET)
        self.request_prompt_tokens = histogram("vllm:request_prompt_tokens", "Prompt tokens of each ended "
                                               "completion", tokens)
        self.request_generation_tokens = histogram("vllm:request_generation_tokens", "Tokens each ended completion "
                                                   "generated", tokens)
        self.request_max_generation_tokens = histogram(
            "vllm:request_max_num_generation_tokens", "Per ended request, the most tokens one of its completions "
            "generated", tokens)

    def request_ended(self, num_prompt_tokens: int, generation_lens: list[int]) -> None:
        """Observe the token histograms of an ended request whose completions generated `generation_lens` tokens."""
        for generated in generation_lens:
            self.request_prompt_tokens.observe(num_prompt_tokens)
            self.request_generation_tokens.observe(generated)
        if generation_lens:
            self.request_max_generation_tokens.observe(max(generation_lens))

    def success(self, finished_reason: str) -> Any:
        return self._success.labels(model_name=self.model_name, engine=ENGINE_LABEL, finished_reason=finished_reason)

    def watch_engine(self, registry: CollectorRegistry, engine_state: Callable[[], EngineState]) -> None:
        registry.register(_VllmEngineCollector(engine_state, self.model_name))


class _VllmEngineCollector(Collector):
    """vLLM's engine-level metrics from the latest engine snapshot, at scrape time."""

    def __init__(self, engine_state: Callable[[], EngineState], model_name: str) -> None:
        self._engine_state = engine_state
        self._labels = [model_name, ENGINE_LABEL]

    def collect(self) -> Iterator[Metric]:
        state = self._engine_state()
        total = state.num_blocks
        running_blocks = min(state.num_blocks_running, state.num_blocks_used)
        gauges = (
            ("vllm:num_requests_running", "Sequences running", state.num_running),
            ("vllm:num_requests_waiting", "Sequences waiting", state.num_waiting),
            ("vllm:kv_cache_usage_perc", "Fraction of the pool's blocks held by running requests (0-1)",
             running_blocks / total if total else 0.0),
            ("hybridcache_prefix_cache_usage_perc", "Fraction of the pool's blocks that only the prefix cache "
             "holds (0-1): cached KV and checkpoint states no running request uses",
             (state.num_blocks_used - running_blocks) / total if total else 0.0),
        )
        for name, documentation, value in gauges:
            labels = ["model_name", "engine"] if name.startswith("vllm:") else ["model_name"]
            gauge = GaugeMetricFamily(name, documentation, labels=labels)
            gauge.add_metric(self._labels[:len(labels)], value)
            yield gauge
        preemptions = CounterMetricFamily("vllm:num_preemptions", "Preempted sequences", labels=list(_LABELS))
        preemptions.add_metric(self._labels, state.num_preemptions)
        yield preemptions
        if state.spec_decode is not None:
            yield from self._spec_decode(state.spec_decode)

    def _spec_decode(self, spec: dict) -> Iterator[Metric]:
        """vLLM's `SpecDecodingProm` counters; `position` numbers the draft positions from 0, as vLLM's."""
        for key, documentation in (("num_drafts", "Number of spec decoding drafts."),
                                   ("num_draft_tokens", "Number of draft tokens."),
                                   ("num_accepted_tokens", "Number of accepted tokens.")):
            family = CounterMetricFamily(f"vllm:spec_decode_{key}", documentation, labels=list(_LABELS))
            family.add_metric(self._labels, spec[key])
            yield family
        per_position = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                           "Accepted tokens per draft position.", labels=[*_LABELS, "position"])
        for position, count in enumerate(spec["accepted_per_position"]):
            per_position.add_metric([*self._labels, str(position)], count)
        yield per_position
