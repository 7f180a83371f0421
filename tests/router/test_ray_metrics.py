"""/metrics of the Ray Serve ingress outside Ray: the ingress's routes run against one real engine replica in
process behind a fake handle (Ray's routing replaced by what `CheckpointRequestRouter` does: it stores each
candidate's prediction under the request's route key), so the router's counters (routed, predicted against
reported hit tokens, in flight) are exactly the engine's answers, and every replica's own metrics come back
labelled by the replica that answered; a replica that does not answer its pinned scrape is left out. Skipped
without the `ray` extra."""

from __future__ import annotations

import asyncio
import functools
import json
from types import SimpleNamespace

import pytest

pytest.importorskip("ray.serve")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from hybridcache.models.builtin import ensure_builtin_model  # noqa: E402
from hybridcache.router import ray_serve  # noqa: E402
from hybridcache.router.ray_metrics import (  # noqa: E402
    PREDICTED_HITS,
    IngressCounters,
    PredictedHits,
    merge_replica_metrics,
)
from hybridcache.router.ray_serve import EngineRequest, HybridcacheEngine, OpenAIIngress  # noqa: E402
from tests.router.test_ray_engine_replica import FIRST, SECOND, SERVE_ARGS, _Index  # noqa: E402

LIVE, GONE, SWAPPED = "replica-1", "replica-gone", "replica-swapped"


class _Handle:
    """The engine deployment's handle: requests go to the one live engine; a call pinned to GONE never gets an
    answer (a replica still running but hung or full: Ray waits for it), one pinned to SWAPPED is answered by the
    live engine (the replica left meanwhile: Ray gives the call to any other)."""

    def __init__(self, engine: HybridcacheEngine, index: _Index) -> None:
        self.engine, self.index, self.pinned = engine, index, []

    def options(self, stream: bool) -> _Handle:
        return self

    def remote(self, request: EngineRequest):
        if request.replica_id:
            self.pinned.append(request.replica_id)
            if request.replica_id == GONE:
                return _never()
        if request.route_key:  # as CheckpointRequestRouter does for every candidate
            predicted = self.index.fleet.predict([list(p) for p in request.prompt_ids], [LIVE, GONE])
            PREDICTED_HITS.put(request.route_key, {LIVE: predicted[0].cached_len, GONE: predicted[1].cached_len})
        return self.engine(request)


async def _never():
    await asyncio.Event().wait()
    yield b""


class _Request:
    """What the ingress reads of a Starlette request."""

    def __init__(self, body: dict) -> None:
        self.url = SimpleNamespace(path="/v1/completions")
        self.headers = {"content-type": "application/json"}
        self._body = json.dumps(body).encode()

    async def stream(self):
        yield self._body


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    names = [f.name for f in text_string_to_metric_families(text)]
    assert len(names) == len(set(names)), names  # each family once: a valid exposition
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def test_the_ingress_counts_what_it_routed_and_gathers_each_replicas_engine_metrics(monkeypatch):
    ensure_builtin_model()
    context = SimpleNamespace(replica_id=SimpleNamespace(to_full_id_str=lambda: LIVE))
    monkeypatch.setattr(ray_serve.serve, "get_replica_context", lambda: context)
    monkeypatch.setattr(ray_serve, "METRICS_TIMEOUT_S", 1.0)
    index = _Index()
    others = {GONE: {"up": True}, SWAPPED: {"up": True}}
    index.stats = SimpleNamespace(remote=lambda: _async({**index.fleet.stats(), **others}))

    async def run() -> None:
        engine = HybridcacheEngine.__new__(HybridcacheEngine)
        await engine.__init__(SERVE_ARGS, index, poll_interval_s=30.0)
        try:
            handle = _Handle(engine, index)
            ingress = SimpleNamespace(engine=handle, index=index, counters=IngressCounters(), max_request_bytes=1 << 20,
                                      tokenizer=None, template_kwargs={})
            for name in ("_send", "_ended", "_replica_metrics", "_pinned_get", "_forward"):
                setattr(ingress, name, functools.partial(getattr(OpenAIIngress, name), ingress))
            first = await ingress._forward(_Request({"prompt": FIRST, "max_tokens": 2}))
            assert first.status_code == 200
            second = await ingress._forward(_Request({"prompt": SECOND, "max_tokens": 2, "stream": True,
                                                      "stream_options": {"include_usage": True}}))
            body = b"".join([piece async for piece in second.body_iterator])
            usage = [json.loads(line[6:]) for line in body.decode().splitlines() if line.startswith("data: {")][-1]
            reported = usage["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert reported >= len(FIRST) - 1  # the second turn hit the first's checkpoint
            assert ingress.counters.in_flight[LIVE] == 0
            models = await ingress._send(EngineRequest("GET", "/v1/models"))  # answered, not counted
            assert models.status_code == 200 and json.loads(models.body)["data"]

            text = (await OpenAIIngress.metrics(ingress)).body.decode()
            assert sorted(handle.pinned) == sorted([LIVE, GONE, SWAPPED])  # one scrape per indexed replica
            samples = _samples(text)
            live, gone = (("replica", LIVE),), (("replica", GONE),)
            assert samples[("hybridcache_router_requests_routed_total", live)] == 2
            assert samples[("hybridcache_router_requests_routed_total", gone)] == 0
            assert samples[("hybridcache_router_predicted_hit_tokens_total", live)] == reported  # exact prediction
            assert samples[("hybridcache_router_reported_hit_tokens_total", live)] == reported
            assert samples[("hybridcache_router_prompt_tokens_total", live)] == len(FIRST) + len(SECOND)
            assert samples[("hybridcache_router_replica_up", live)] == 1
            assert samples[("hybridcache_router_indexed_checkpoints", live)] >= 1
            assert samples[("hybridcache_router_retries_total", ())] == 0
            assert not any(name == "hybridcache_router_requests_retried_away_total" for name, _ in samples)
            engine_prompt = {labels: v for (name, labels), v in samples.items()
                             if name == "hybridcache_prompt_tokens_total"}
            # labelled by the replica that answered: SWAPPED's scrape (LIVE's text) is not counted twice
            assert len(engine_prompt) == 1 and all(dict(k)["replica"] == LIVE for k in engine_prompt)
            assert list(engine_prompt.values()) == [len(FIRST) + len(SECOND)]  # the engine's own count
            assert not any(dict(labels).get("replica") in (GONE, SWAPPED) and not name.startswith("hybridcache_router_")
                           for name, labels in samples)  # the replicas that did not answer are left out
        finally:
            engine.__del__()

    asyncio.run(run())


async def _async(value):
    return value


def test_merging_keeps_one_family_per_name_and_labels_each_replica():
    text = ('# HELP x_total things\n# TYPE x_total counter\nx_total{model_name="m"} 3.0\n'
            '# HELP y gauge\n# TYPE y gauge\ny 1.0\n')
    merged = _samples(merge_replica_metrics({"a": text, "b": text.replace("3.0", "5.0")}))
    assert merged[("x_total", (("model_name", "m"), ("replica", "a")))] == 3.0
    assert merged[("x_total", (("model_name", "m"), ("replica", "b")))] == 5.0
    assert merged[("y", (("replica", "b"),))] == 1.0
    assert merge_replica_metrics({}) == ""


def test_predictions_are_taken_once_and_bounded():
    hits = PredictedHits(capacity=2)
    hits.put("k1", {"a": 10, "b": 0})
    assert hits.take("k1", "a") == 10 and hits.take("k1", "a") is None
    hits.put("k2", {"a": 1})
    hits.put("k3", {"a": 2})
    hits.put("k4", {"a": 3})  # k2 was never taken: dropped, oldest first
    assert hits.take("k2", "a") is None and hits.take("k4", "a") == 3 and hits.take("k3", "b") is None
