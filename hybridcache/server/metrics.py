"""Prometheus metrics of one server (its own registry: no process-wide state).

Every metric carries a `model_name` label (the first served model name), as vLLM's do, so one dashboard can
show several servers. vLLM's own metrics (`vllm:*`, vllm_metrics.py) are recorded next to these. Request-level
metrics are recorded by the engine thread as outputs come out of `engine.step()`:

    hybridcache_prefix_cache_queries_tokens_total   prompt tokens of computed requests (as in `usage`), counted
                                                    when every completion has its first token (or at the end
                                                    of one that ended before)
    hybridcache_prefix_cache_hit_tokens_total       their `cached_tokens` (as in `usage`), so the two move by
                                                    exactly what the responses reported
    hybridcache_prompt_tokens_total / hybridcache_generation_tokens_total   (generated: as `usage` reports them,
                                                    0 for an echo-only request's one sampled token)
    hybridcache_request_finished_total{finish_reason}   completions (choices) that ended, by reason
                                                    (stop, length, abort, error); n choices count n
                                                    (every reason's series exists, at 0, from the start)
    hybridcache_time_to_first_token_seconds         arrival (the server queued it for the engine thread) ->
                                                    first sampled token
    hybridcache_inter_token_latency_seconds         time between a completion's consecutive token steps
    hybridcache_e2e_request_latency_seconds         arrival -> finish
                                                    (the three per completion: n completions, n observations)
    hybridcache_spec_decode_request_acceptance_rate per completion that fed drafts (speculative decoding): its
                                                    accepted / fed draft tokens

Engine-level metrics are read from the latest `EngineState` snapshot at scrape time:

    hybridcache_checkpoint_saves_total{reason}      published state checkpoints, by save reason
    hybridcache_checkpoint_hits_total{reason}       prefix-cache hits, by the save reason of the checkpoint
                                                    restored (finish: a conversation's previous turn, ...)
    hybridcache_checkpoint_saves_declined_total{cause}  saves not made, by cause: policy (learned admission
                                                    declined it: the pool was full and its kind pays too
                                                    little), no_room, duplicate, anchor_full, ...
    hybridcache_checkpoint_evictions_total{kind}    evictions, by kind
                                                    (these four: a series per reason / cause / kind from the start,
                                                    at 0 until its first event, so rate() sees that one)
    hybridcache_kv_blocks_used / _total, hybridcache_state_slots_used / _total (cache contents included)
    hybridcache_kv_cache_usage_percent / hybridcache_state_slot_usage_percent   the same as percentages (0-100)
    hybridcache_checkpoints, hybridcache_num_requests_running / _waiting, hybridcache_preemptions_total,
    hybridcache_vision_encoded_images_total, hybridcache_vision_encoder_cache_hits_total
    hybridcache_cache_hits_total{tier}              prefix-cache hits by where the checkpoint was: device, host
    hybridcache_cache_bytes_used{tier} / hybridcache_cache_bytes_total{tier}   the pools' bytes (host: the host
                                                    tier, `--host-cache-gib`; 0 without one)
    hybridcache_host_checkpoints                    checkpoints held in the host tier
    hybridcache_host_promotions_total{what} / hybridcache_host_demotions_total{what}   checkpoints and trie
                                                    blocks copied host -> device on a hit / device -> host by
                                                    eviction
    hybridcache_host_promotions_skipped_total       deeper host hits not taken: the copy cost more than
                                                    recomputing
    hybridcache_host_dropped_total                  host checkpoints the host tier's own eviction dropped (gone,
                                                    or to the disk tier)
    hybridcache_disk_bytes, hybridcache_disk_promotions_total{what} / _demotions_total{what}   the disk tier
                                                    (`--disk-cache-dir`): its files' bytes, checkpoints and
                                                    blocks read back into the host tier (disk hits) / written
                                                    as they fell out of it
    hybridcache_disk_lost_total{why}                states the cap evicted, files skipped as corrupt, failed
                                                    writes, host fall-outs that could not be kept

With speculative decoding (vLLM's spec_decode counters, under our prefix):

    hybridcache_spec_decode_num_drafts_total         verify rows (a sequence's decode step that fed drafts)
    hybridcache_spec_decode_num_draft_tokens_total   draft tokens fed
    hybridcache_spec_decode_num_accepted_tokens_total  draft tokens accepted
    hybridcache_spec_decode_num_accepted_tokens_per_pos_total{position}  accepted drafts by position (1 = first)
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from hybridcache.cache.request import SaveReason
from hybridcache.cache.stats import DeclineCause, EvictionKind
from hybridcache.server.engine_state import EngineState
from hybridcache.server.vllm_metrics import FINISH_REASONS, VllmMetrics
from hybridcache.server.weighted_histogram import WeightedHistogram

# seconds; up to vLLM's top request bucket (7,680 s): an agent's long generation or a queued request takes minutes
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
                    300.0, 600.0, 1800.0, 7680.0)


class ServerMetrics:
    """The metric objects of one server; `render()` is the /metrics body. Thread-safe (prometheus-client)."""

    def __init__(self, model_name: str = "hybridcache", max_model_len: int | None = None) -> None:
        self.model_name = model_name
        self.registry = registry = CollectorRegistry()
        model = {"model_name": model_name}

        def counter(name: str, documentation: str) -> Any:
            return Counter(name, documentation, ["model_name"], registry=registry).labels(**model)

        def histogram(name: str, documentation: str) -> Any:
            return Histogram(name, documentation, ["model_name"], buckets=_LATENCY_BUCKETS,
                             registry=registry).labels(**model)

        self.vllm = vllm = VllmMetrics(registry, model_name, max_model_len)  # vLLM's names, for vLLM's dashboards
        self.query_tokens = counter("hybridcache_prefix_cache_queries_tokens", "Prompt tokens of computed requests")
        self.hit_tokens = counter(
            "hybridcache_prefix_cache_hit_tokens", "Prompt tokens of computed requests whose computation the "
            "prefix cache skipped (usage.prompt_tokens_details.cached_tokens)")
        self.prompt_tokens = counter("hybridcache_prompt_tokens", "Prompt tokens of computed requests")
        self.generation_tokens = _Both(counter("hybridcache_generation_tokens", "Generated tokens"),
                                       vllm.generation_tokens)
        self._finished = Counter("hybridcache_request_finished", "Completions (choices) that ended, by reason",
                                 ["model_name", "finish_reason"], registry=registry)
        for reason in FINISH_REASONS:  # a series per reason from the start, so rate() sees the first one
            self.finished(reason)
        self.ttft = _Both(histogram("hybridcache_time_to_first_token_seconds", "Time to first token"), vllm.ttft)
        self.itl = _Both(WeightedHistogram("hybridcache_inter_token_latency_seconds", "Time between a request's token "
                                           "steps", model, _LATENCY_BUCKETS, registry), vllm.itl)
        self.e2e = histogram("hybridcache_e2e_request_latency_seconds", "Arrival to finish")
        self.acceptance = Histogram(
            "hybridcache_spec_decode_request_acceptance_rate", "Per completion that fed drafts: accepted / fed "
            "draft tokens", ["model_name"], buckets=tuple(i / 10 for i in range(11)), registry=registry,
        ).labels(**model)

    def finished(self, finish_reason: str) -> Any:
        """The counter of completions that ended for `finish_reason`."""
        return self._finished.labels(model_name=self.model_name, finish_reason=finish_reason)

    def watch_engine(self, engine_state: Callable[[], EngineState]) -> None:
        """Export the engine-level metrics, read from `engine_state()` at every scrape."""
        self.registry.register(_EngineCollector(engine_state, self.model_name))
        self.vllm.watch_engine(self.registry, engine_state)

    def prompt_computed(self, num_prompt_tokens: int, num_cached_tokens: int) -> None:
        """Count a request's prompt tokens and its cached tokens (as `usage` reports them) once its prompt has been
        computed, as vLLM counts them at the request's first token, not at its end."""
        vllm = self.vllm
        for counters, value in (((self.query_tokens, vllm.prefix_cache_queries), num_prompt_tokens),
                                ((self.hit_tokens, vllm.prefix_cache_hits), num_cached_tokens),
                                ((self.prompt_tokens, vllm.prompt_tokens), num_prompt_tokens)):
            for counter in counters:
                counter.inc(value)

    def request_finished(self, num_prompt_tokens: int, finish_reasons: list[str],
                         latency_s: float | Sequence[float], drafts: list[tuple[int, int]] = (),
                         phases: RequestPhases | Sequence[RequestPhases] | None = None,
                         generation_lens: list[int] = ()) -> None:
        """A request ended (finished or aborted after its prompt was computed; its prompt's tokens were counted by
        `prompt_computed`). Its n completions are observed each on its own in the latency histograms, as vLLM's n
        child requests: `latency_s` (arrival -> end) and `phases` (queue, prefill and decode times where known) are
        per completion, or one value for all. `drafts`: per completion, (draft tokens fed, accepted) with
        speculative decoding; `generation_lens`: per completion, the tokens it generated."""
        for fed, accepted in drafts:
            if fed:
                self.acceptance.observe(accepted / fed)
        vllm = self.vllm
        self.completions_ended(finish_reasons)
        num_completions = len(finish_reasons)
        for latency in _per_completion(latency_s, num_completions):
            self.e2e.observe(latency)
            vllm.e2e.observe(latency)
        vllm.request_ended(num_prompt_tokens, list(generation_lens))
        for completion_phases in _per_completion(phases, num_completions):
            if completion_phases is None:
                continue
            for histogram, value in ((vllm.queue_time, completion_phases.queue_s),
                                     (vllm.prefill_time, completion_phases.prefill_s),
                                     (vllm.decode_time, completion_phases.decode_s)):
                if value is not None:
                    histogram.observe(value)

    def completions_ended(self, finish_reasons: list[str]) -> None:
        """Count ended completions by finish reason, in `hybridcache_request_finished_total` and vLLM's
        `vllm:request_success_total` alike. A request aborted before its prompt was computed (still queued) counts
        here only: it queried and computed nothing, so no token counter or latency histogram sees it."""
        for reason in finish_reasons:
            self.finished(reason).inc()
            self.vllm.success(reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


@dataclass(frozen=True)
class RequestPhases:
    """Where a request's time went (seconds; None for a phase it never reached): queued (arrival -> its first
    computing step), prefill (that step's start -> the first token), decode (the first token -> the last)."""

    queue_s: float | None = None
    prefill_s: float | None = None
    decode_s: float | None = None


def _per_completion(value: Any, num_completions: int) -> list:
    """`value` for each of `num_completions` completions: a sequence is one per completion already, anything
    else (a float, a `RequestPhases`, None) is the same for all."""
    if isinstance(value, Sequence):
        if len(value) != num_completions:
            raise ValueError(f"{len(value)} values for {num_completions} completions")
        return list(value)
    return [value] * num_completions


class _Both:
    """One hybridcache metric and its vLLM twin, recorded together."""

    def __init__(self, *metrics: Any) -> None:
        self._metrics = metrics

    def inc(self, amount: float = 1) -> None:
        for metric in self._metrics:
            metric.inc(amount)

    def observe(self, value: float, *count: int) -> None:
        """Observe `value` (`count` times: `WeightedHistogram`s only)."""
        for metric in self._metrics:
            metric.observe(value, *count)


class _EngineCollector(Collector):
    """Reads the engine snapshot at scrape time (the engine thread refreshes it after every step)."""

    def __init__(self, engine_state: Callable[[], EngineState], model_name: str) -> None:
        self._engine_state = engine_state
        self._model_name = model_name

    def collect(self) -> Iterator[Metric]:
        state = self._engine_state()
        model = self._model_name
        yield _by_label("hybridcache_checkpoint_saves", "Published state checkpoints, by reason", "reason",
                        _every(SaveReason, state.checkpoint_saves), model)
        yield _by_label("hybridcache_checkpoint_hits", "Prefix-cache hits, by the reason of the checkpoint restored",
                        "reason", _every(SaveReason, state.checkpoint_hits), model)
        yield _by_label("hybridcache_checkpoint_saves_declined", "Checkpoint saves not made, by cause", "cause",
                        _every(DeclineCause, state.declined_saves), model)
        yield _by_label("hybridcache_checkpoint_evictions", "Cache evictions, by kind", "kind",
                        _every(EvictionKind, state.checkpoint_evictions), model)
        preemptions = CounterMetricFamily("hybridcache_preemptions", "Preempted sequences", labels=["model_name"])
        preemptions.add_metric([model], state.num_preemptions)
        yield preemptions
        for name, text, value in (
            ("hybridcache_vision_encoded_images", "Images the vision tower encoded", state.num_encoded_images),
            ("hybridcache_vision_encoder_cache_hits", "Images served by the encoder cache (no vision tower run)",
             state.num_encoder_cache_hits),
        ):
            counter = CounterMetricFamily(name, text, labels=["model_name"])
            counter.add_metric([model], value)
            yield counter
        yield from _tier_metrics(state, model)
        gauges = (
            ("hybridcache_kv_blocks_used", "KV blocks in use (running sequences and the prefix cache)",
             state.num_blocks_used),
            ("hybridcache_kv_blocks_total", "KV blocks in the pool", state.num_blocks),
            ("hybridcache_kv_cache_usage_percent", "KV blocks in use, percent of the pool (0-100)",
             usage_percent(state.num_blocks_used, state.num_blocks)),
            ("hybridcache_state_slots_used", "Runtime state slots in use (one per running sequence)",
             state.num_slots_used),
            ("hybridcache_state_slots_total", "State slots in the pool", state.num_slots),
            ("hybridcache_state_slot_usage_percent", "State slots in use, percent of the pool (0-100)",
             usage_percent(state.num_slots_used, state.num_slots)),
            ("hybridcache_checkpoints", "Published state checkpoints held", state.num_checkpoints),
            ("hybridcache_num_requests_running", "Sequences running", state.num_running),
            ("hybridcache_num_requests_waiting", "Sequences waiting", state.num_waiting),
        )
        for name, documentation, value in gauges:
            gauge = GaugeMetricFamily(name, documentation, labels=["model_name"])
            gauge.add_metric([model], value)
            yield gauge
        if state.spec_decode is not None:
            yield from _spec_decode_metrics(state.spec_decode, model)


def _spec_decode_metrics(spec: dict, model: str) -> Iterator[Metric]:
    for key, documentation in (("num_drafts", "Verify rows of speculative decoding"),
                               ("num_draft_tokens", "Draft tokens fed"),
                               ("num_accepted_tokens", "Draft tokens accepted")):
        family = CounterMetricFamily(f"hybridcache_spec_decode_{key}", documentation, labels=["model_name"])
        family.add_metric([model], spec[key])
        yield family
    yield _by_label("hybridcache_spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by position",
                    "position", {str(j + 1): n for j, n in enumerate(spec["accepted_per_position"])}, model)


def _tier_metrics(state: EngineState, model: str) -> Iterator[Metric]:
    """The per-tier families (device, host) of the module docstring."""
    yield _by_label("hybridcache_cache_hits", "Prefix-cache hits, by the tier the checkpoint was in", "tier",
                    {"device": state.num_hits - state.num_host_hits, "host": state.num_host_hits}, model)
    for name, documentation, device, host in (
        ("hybridcache_cache_bytes_used", "Bytes of the pool in use, by tier", state.num_blocks_used,
         state.num_host_blocks_used),
        ("hybridcache_cache_bytes_total", "Bytes of the pool, by tier", state.num_blocks, state.num_host_blocks),
    ):
        gauge = GaugeMetricFamily(name, documentation, labels=["model_name", "tier"])
        gauge.add_metric([model, "device"], device * state.block_bytes)
        gauge.add_metric([model, "host"], host * state.block_bytes)
        yield gauge
    gauge = GaugeMetricFamily("hybridcache_host_checkpoints", "Checkpoints held in the host tier",
                              labels=["model_name"])
    gauge.add_metric([model], state.num_host_checkpoints)
    yield gauge
    yield _by_label("hybridcache_host_promotions", "Copied host -> device on a hit", "what",
                    {"checkpoints": state.num_promotions, "blocks": state.num_promoted_blocks}, model)
    yield _by_label("hybridcache_host_demotions", "Moved device -> host by eviction", "what",
                    {"checkpoints": state.num_demotions, "blocks": state.num_demoted_blocks}, model)
    skipped = CounterMetricFamily("hybridcache_host_promotions_skipped",
                                  "Host hits not taken: the copy cost more than recomputing", labels=["model_name"])
    skipped.add_metric([model], state.num_promotions_skipped)
    yield skipped
    dropped = CounterMetricFamily("hybridcache_host_dropped",
                                  "Host checkpoints dropped by the host tier's own eviction (gone)",
                                  labels=["model_name"])
    dropped.add_metric([model], state.num_host_dropped)
    yield dropped
    if state.disk is not None:
        yield from _disk_metrics(state.disk, model)


def _disk_metrics(disk: dict[str, int], model: str) -> Iterator[Metric]:
    """The disk tier's families (`--disk-cache-dir`; see the module docstring)."""
    gauge = GaugeMetricFamily("hybridcache_disk_bytes", "Bytes of the disk tier's files", labels=["model_name"])
    gauge.add_metric([model], disk["num_bytes"])
    yield gauge
    yield _by_label("hybridcache_disk_promotions", "Read back from disk into the host tier (disk hits)", "what",
                    {"checkpoints": disk["num_promoted_checkpoints"], "blocks": disk["num_promoted_blocks"]}, model)
    yield _by_label("hybridcache_disk_demotions", "Written to disk as they fell out of the host tier", "what",
                    {"checkpoints": disk["num_demoted_checkpoints"], "blocks": disk["num_demoted_blocks"]}, model)
    yield _by_label("hybridcache_disk_lost", "What the disk tier did not keep or serve", "why",
                    {"evicted": disk["num_evicted_states"], "corrupt": disk["num_corrupt"],
                     "write_error": disk["num_write_errors"], "not_kept": disk["num_not_kept"]}, model)


def _every(values: type[enum.Enum], counts: dict[str, int]) -> dict[str, int]:
    """`counts` with every value of the enum `values` present (0 where none happened yet), so each labelled series
    exists from the start and rate() / increase() see its first event."""
    return {**{value.value: 0 for value in values}, **counts}


def _by_label(name: str, documentation: str, label: str, counts: dict[str, int], model: str) -> Metric:
    """A counter family with one sample per key of `counts` (label `label`), sorted by key."""
    family = CounterMetricFamily(name, documentation, labels=["model_name", label])
    for key, count in sorted(counts.items()):
        family.add_metric([model, str(key)], count)
    return family


def usage_percent(used: int, total: int) -> float:
    """`used` as a percentage of `total` (0 when the pool is empty)."""
    return 100.0 * used / total if total else 0.0
