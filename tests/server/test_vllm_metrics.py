"""vLLM's metrics (`vllm:*`) read the way vLLM's Grafana dashboard queries them: selected by `model_name`, counters
as increases between two scrapes, latencies as `histogram_quantile` over bucket increases and as sum / count.
`vllm:kv_cache_usage_perc` is the fraction of blocks running requests hold: 0 when idle even though the prefix cache
keeps its contents (their own gauge), above 0 while a request runs."""

from __future__ import annotations

import math
import threading
import time

import httpx
import pytest
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from hybridcache.config import EngineConfig
from hybridcache.models.builtin import BUILTIN_NAME

from .inprocess_server import serving

MODEL = BUILTIN_NAME
SELECT = {"model_name": MODEL}


@pytest.fixture(scope="module")
def server():
    with serving(EngineConfig(block_size=16, max_model_len=1024, num_blocks=512)) as base_url:
        yield base_url, OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def scrape(base_url: str) -> dict[tuple[str, tuple], float]:
    """Every sample of /metrics: (sample name, sorted labels) -> value."""
    text = httpx.get(f"{base_url}/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def select(samples, name: str, **match: str) -> dict[tuple, float]:
    """`name{model_name="..."}`: the samples of `name` whose labels include the dashboard's selector."""
    wanted = {**SELECT, **match}
    return {labels: value for (sample, labels), value in samples.items()
            if sample == name and wanted.items() <= dict(labels).items()}


def value(samples, name: str, **match: str) -> float:
    found = select(samples, name, **match)
    assert found, f"{name} is not exported"
    return sum(found.values())


def increase(before, after, name: str, **match: str) -> float:
    return value(after, name, **match) - (sum(select(before, name, **match).values()))


def histogram_quantile(q: float, before, after, name: str) -> float:
    """`histogram_quantile(q, sum by(le) (increase(name_bucket{model_name=...}[...])))`, as Prometheus computes it."""
    buckets: dict[float, float] = {}
    for moment, sign in ((after, 1), (before, -1)):
        for labels, count in select(moment, f"{name}_bucket").items():
            le = float(dict(labels)["le"])
            buckets[le] = buckets.get(le, 0.0) + sign * count
    bounds = sorted(buckets)
    total = buckets[math.inf]
    rank = q * total
    lower, below = 0.0, 0.0
    for bound in bounds:
        if buckets[bound] >= rank:
            if bound == math.inf:
                return lower
            return lower + (bound - lower) * (rank - below) / (buckets[bound] - below)
        lower, below = bound, buckets[bound]
    return math.nan


def test_dashboard_queries(server):
    base_url, client = server
    idle = scrape(base_url)
    assert value(idle, "vllm:kv_cache_usage_perc") == 0.0
    assert value(idle, "vllm:num_requests_running") == 0.0
    prompts = [f"request {i}: " + "the quick brown fox jumps over the lazy dog " * 4 for i in range(3)]
    usages = []
    for prompt in prompts * 2:  # the second round hits the prefix cache
        response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0,
                                             extra_body={"ignore_eos": True})
        usages.append(response.usage)
    after = scrape(base_url)

    # Request rate, token throughput, prefix-cache hit rate
    assert increase(idle, after, "vllm:request_success_total", finished_reason="length") == len(usages)
    assert increase(idle, after, "vllm:prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert increase(idle, after, "vllm:generation_tokens_total") == sum(u.completion_tokens for u in usages)
    queries = increase(idle, after, "vllm:prefix_cache_queries_total")
    hits = increase(idle, after, "vllm:prefix_cache_hits_total")
    assert queries == sum(u.prompt_tokens for u in usages)
    assert hits == sum(u.prompt_tokens_details.cached_tokens for u in usages) > 0
    # Latency panels: percentiles and averages
    for name in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
                 "vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
                 "vllm:request_decode_time_seconds", "vllm:inter_token_latency_seconds"):
        count = increase(idle, after, f"{name}_count")
        expected = len(usages) * 4 if name == "vllm:inter_token_latency_seconds" else len(usages)
        assert count == expected, name
        p99 = histogram_quantile(0.99, idle, after, name)
        assert 0.0 <= p99 < 10.0, (name, p99)
    mean = {name: increase(idle, after, f"{name}_sum") / len(usages)
            for name in ("vllm:e2e_request_latency_seconds", "vllm:time_to_first_token_seconds",
                         "vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
                         "vllm:request_decode_time_seconds")}
    assert mean["vllm:time_to_first_token_seconds"] > 0
    assert mean["vllm:e2e_request_latency_seconds"] >= mean["vllm:time_to_first_token_seconds"]
    phases = sum(mean[f"vllm:request_{p}_time_seconds"] for p in ("queue", "prefill", "decode"))
    assert phases <= mean["vllm:e2e_request_latency_seconds"] + 1e-6
    assert increase(idle, after, "vllm:num_preemptions_total") == 0
    # Idle again: no running request holds a block, while the prefix cache keeps what it saved
    assert value(after, "vllm:kv_cache_usage_perc") == 0.0
    assert value(after, "vllm:num_requests_waiting") == 0.0
    assert 0.0 < value(after, "hybridcache_prefix_cache_usage_perc") <= 1.0
    assert value(after, "hybridcache_kv_cache_usage_percent") > 0.0  # the older gauge counts the cache contents


def test_kv_cache_usage_while_a_request_runs(server):
    base_url, client = server
    seen: list[tuple[float, float]] = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            samples = scrape(base_url)
            seen.append((value(samples, "vllm:num_requests_running"), value(samples, "vllm:kv_cache_usage_perc")))
            time.sleep(0.02)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        client.completions.create(model=MODEL, prompt="a fresh prompt " * 10, max_tokens=200, temperature=0,
                                  extra_body={"ignore_eos": True})
    finally:
        done.set()
        watcher.join()
    running = [usage for count, usage in seen if count >= 1]
    assert running, "no scrape saw the request running"
    assert all(0.0 < usage <= 1.0 for usage in running)
    assert value(scrape(base_url), "vllm:kv_cache_usage_perc") == 0.0


def test_echo_only_completions_generate_no_tokens(server):
    """`max_tokens: 0` with echo: the engine samples one token that no choice shows and `usage` reports 0
    completion tokens (docs/server.md); the generation counters counted that token."""
    base_url, _ = server
    before = scrape(base_url)
    response = httpx.post(f"{base_url}/v1/completions", timeout=60,
                          json={"model": MODEL, "prompt": "score this prompt " * 5, "max_tokens": 0, "echo": True,
                                "logprobs": 1})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 0
    after = scrape(base_url)
    assert increase(before, after, "vllm:request_success_total") == 1
    for name in ("vllm:generation_tokens_total", "hybridcache_generation_tokens_total",
                 "vllm:request_generation_tokens_sum"):
        assert increase(before, after, name) == 0, name
