"""A Prometheus histogram that takes an observation many times in one call.

Every sequence a decode step gave a token observes the same inter-token latency (the time since the step before),
so the engine thread observes each step's gap once, weighted by how many completions saw it. prometheus_client's
`Histogram.observe` has no weight: 64 sequences cost 64 calls of ~1.5 us each, twice (ours and vLLM's metric).
`WeightedHistogram.observe(value, count)` costs one bisect and one lock. It is exposed as prometheus_client's
histograms are (`_bucket{le}` cumulative, `_count`, `_sum`), through the library's `HistogramMetricFamily`.

    h = WeightedHistogram("x_seconds", "doc", {"model_name": "m"}, (0.01, 0.1), registry)
    h.observe(0.02, 64)   # x_seconds_bucket{le="0.01"} 0, {le="0.1"} 64, {le="+Inf"} 64; _count 64; _sum 1.28
"""

from __future__ import annotations

import bisect
import itertools
import math
import threading
from collections.abc import Iterator, Mapping, Sequence

from prometheus_client import CollectorRegistry
from prometheus_client.core import HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString


class WeightedHistogram(Collector):
    """One histogram series (fixed `labels`) whose `observe` takes a count; registered in `registry`. Buckets as
    prometheus_client's: an observation lands in the first bucket whose upper bound is >= it."""

    def __init__(self, name: str, documentation: str, labels: Mapping[str, str], buckets: Sequence[float],
                 registry: CollectorRegistry) -> None:
        self._name, self._documentation = name, documentation
        self._labels = dict(labels)
        self._bounds = tuple(float(b) for b in buckets)
        if list(self._bounds) != sorted(set(self._bounds)) or not self._bounds:
            raise ValueError(f"{name}: buckets must be increasing, got {buckets}")
        self._counts = [0] * (len(self._bounds) + 1)  # the last: above every bound (+Inf)
        self._sum = 0.0
        self._lock = threading.Lock()
        registry.register(self)

    def observe(self, value: float, count: int = 1) -> None:
        """Count `value` `count` times."""
        index = bisect.bisect_left(self._bounds, value)
        with self._lock:
            self._counts[index] += count
            self._sum += value * count

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            counts, total = list(self._counts), self._sum
        family = HistogramMetricFamily(self._name, self._documentation, labels=list(self._labels))
        bounds = (*self._bounds, math.inf)
        family.add_metric(list(self._labels.values()),
                          [(floatToGoString(b), c) for b, c in zip(bounds, itertools.accumulate(counts))],
                          sum_value=total)
        yield family

    def describe(self) -> Iterator[Metric]:
        yield HistogramMetricFamily(self._name, self._documentation, labels=list(self._labels))
