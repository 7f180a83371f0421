"""Routing under cache salts (vLLM's `cache_salt`): a salted request's blocks chain from its salted root, so the
router predicts its hit from the salt in the request body, exactly as the replica's cache would probe it, and a
request with another salt (or none) is predicted to hit nothing there."""

from __future__ import annotations

import httpx
import pytest
from fastapi import Request

from hybridcache.cache import CacheConfig, CacheRequest, PrefixCache
from hybridcache.cache.request import Probe
from hybridcache.router.app import RouterConfig, build_router_app
from hybridcache.router.fleet_index import FleetIndex
from hybridcache.router.index import ReplicaIndex, prompt_hashes
from hybridcache.router.policy import RoutingConfig
from hybridcache.router.replicas import Replica
from hybridcache.router.responses import routed_cache_salt
from tests.cache.fake_engine import Driver
from tests.router.serving import replica_app, serving_app

B = 16
PROMPT = tuple((7 * i + 5) % 251 for i in range(3 * B + 5))
SALTS = (None, "tenant-a", "tenant-b")


def _cache_after(*requests: CacheRequest) -> PrefixCache:
    """A replica's cache (B = 16, as the fake replicas' events say) after running `requests` to their finish."""
    driver = Driver(PrefixCache(CacheConfig(block_size=B, num_blocks=64, num_slots=8)))
    for request in requests:
        driver.run(request, decode=[3, 4])
    return driver.cache


@pytest.mark.parametrize("stored", ["tenant-a", None], ids=["stored-salted", "stored-unsalted"])
def test_the_index_predicts_what_the_cache_probes_for_each_salt(stored):
    cache = _cache_after(CacheRequest("r", PROMPT, cache_salt=stored))
    index = ReplicaIndex(B)
    index.apply(cache.snapshot_events())
    asked = PROMPT + (1, 2, 3)
    for salt in SALTS:
        probe = cache.probe(CacheRequest("p", asked, cache_salt=salt))
        assert index.predict(asked, salt=salt) == probe, salt
        assert (probe.cached_len > 0) == (salt == stored)
        hashes = prompt_hashes(asked, B, salt=salt)
        assert index.predict(asked, block_hashes=hashes, salt=salt) == probe
        assert index.chain_len(asked, 10 * B, salt=salt) == (probe.kv_len and len(PROMPT) + 2) // B * B


def test_replicas_and_the_fleet_index_predict_under_the_salt():
    cache = _cache_after(CacheRequest("r", PROMPT, cache_salt="tenant-a"))
    answer = {"block_size": B, "full_prompt_hits": False, "reset": True, "next": 0, "epoch": "e",
              "events": [e.to_json() for e in cache.snapshot_events()]}
    replica = Replica("r1")
    replica.apply(answer)
    fleet = FleetIndex()
    fleet.publish("r1", answer)
    asked = [list(PROMPT + (9,))]
    salted = cache.probe(CacheRequest("p", tuple(asked[0]), cache_salt="tenant-a"))
    assert salted.cached_len > 0
    assert replica.predict(asked, "tenant-a") == salted and fleet.predict(asked, ["r1"], "tenant-a") == [salted]
    for salt in (None, "tenant-b"):
        assert replica.predict(asked, salt) == Probe(0, 0) and fleet.predict(asked, ["r1"], salt) == [Probe(0, 0)]
        assert replica.chain(asked, 10 * B, salt) == 0
    assert replica.chain(asked, 10 * B, "tenant-a") > 0


def test_the_salt_is_read_from_the_body():
    assert routed_cache_salt({"prompt": [1], "cache_salt": "s"}) == "s"
    for body in ({"prompt": [1]}, {"cache_salt": ""}, {"cache_salt": 5}, {"cache_salt": None}, [1, 2], None):
        assert routed_cache_salt(body) is None


def test_the_router_sends_a_salted_prompt_where_its_salt_hit_is():
    """Replica b holds tenant-a's salted prompt (its events, from a real cache); a is empty. The salted request goes
    to b (its predicted hit), the same prompt unsalted or with another salt to a (no hit anywhere: the replica with
    the smaller index), and each replica gets the body as sent."""
    def recording_replica(events: list[dict]):
        app = replica_app()
        app.state.events = events
        app.state.bodies = []

        @app.post("/v1/completions")
        async def completions(request: Request):
            app.state.bodies.append(await request.json())
            return {"choices": [{"index": 0, "text": "ok"}]}

        return app

    cache = _cache_after(CacheRequest("r", PROMPT, cache_salt="tenant-a"))
    empty, holder = recording_replica([]), recording_replica([e.to_json() for e in cache.snapshot_events()])
    with serving_app(empty) as a, serving_app(holder) as b:
        config = RouterConfig((a, b), RoutingConfig("checkpoint"), poll_interval_s=30.0)
        with serving_app(build_router_app(config, tokenizer=None)) as router:
            for salt in ("tenant-a", None, "tenant-b"):
                body = {"prompt": list(PROMPT) + [1, 2], "max_tokens": 1,
                        **({} if salt is None else {"cache_salt": salt})}
                response = httpx.post(f"{router}/v1/completions", json=body, timeout=30)
                assert response.status_code == 200
    assert [body.get("cache_salt") for body in holder.state.bodies] == ["tenant-a"]
    assert [body.get("cache_salt") for body in empty.state.bodies] == [None, "tenant-b"]
