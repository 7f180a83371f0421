"""`WeightedHistogram` against prometheus_client's `Histogram`: the same exposition for the same observations."""

from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from hybridcache.server.weighted_histogram import WeightedHistogram

BUCKETS = (0.01, 0.025, 0.05, 0.1, 1.0, 7.5)


def _samples(registry: CollectorRegistry) -> list[tuple[str, dict, float]]:
    text = generate_latest(registry).decode()
    samples = [(s.name, s.labels, s.value) for family in text_string_to_metric_families(text)
               for s in family.samples if not s.name.endswith("_created")]
    return sorted(samples, key=lambda s: (s[0], sorted(s[1].items())))


def test_weighted_observations_expose_what_repeated_ones_do():
    """Values on the bounds (an observation equal to a bound lands in that bucket), between them and above the
    last, each observed `count` times at once in ours and one by one in prometheus_client's."""
    rng = random.Random(0)
    values = [*BUCKETS, 0.0, 9.0, *(rng.uniform(0, 10) for _ in range(40))]
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    weighted = WeightedHistogram("x_seconds", "doc", {"model_name": "m", "engine": "0"}, BUCKETS, ours)
    plain = Histogram("x_seconds", "doc", ["model_name", "engine"], buckets=BUCKETS,
                      registry=theirs).labels(model_name="m", engine="0")
    for value in values:
        count = rng.randrange(1, 70)
        weighted.observe(value, count)
        for _ in range(count):
            plain.observe(value)
    ours_samples, theirs_samples = _samples(ours), _samples(theirs)
    assert [s[:2] for s in ours_samples] == [s[:2] for s in theirs_samples]
    assert [s[2] for s in ours_samples] == pytest.approx([s[2] for s in theirs_samples], rel=1e-12)
    assert any(name == "x_seconds_bucket" and labels["le"] == "0.01" and value > 0
               for name, labels, value in ours_samples)


def test_buckets_must_increase():
    with pytest.raises(ValueError, match="increasing"):
        WeightedHistogram("y_seconds", "doc", {}, (0.1, 0.1, 1.0), CollectorRegistry())
