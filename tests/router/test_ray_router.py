"""CheckpointRequestRouter (Ray Serve's custom request router) with fake replicas and a stubbed index: the
predicted usable hit ranks first unless that replica is too loaded (Ray's queue lengths), then the rest by
predicted hit; a request without prompt ids, or an index that fails, leaves the choice to Ray (one rank); a
replica that dies is dropped from the index; under queueing, the replica found for a request is given to that
request, where Ray's FIFO routers give it to the oldest pending one. Skipped without the `ray` extra."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

pytest.importorskip("ray.serve")

from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID  # noqa: E402
from ray.serve.request_router import PendingRequest  # noqa: E402

from hybridcache.router.ray_router import CheckpointRequestRouter  # noqa: E402
from hybridcache.router.ray_serve import EngineRequest  # noqa: E402

DEPLOYMENT = DeploymentID("HybridcacheEngine", "app")
PROMPT = tuple(range(200))


def _router(predictions: dict[str, tuple[int, int]], calls: list) -> tuple[CheckpointRequestRouter, list]:
    router = CheckpointRequestRouter(DEPLOYMENT, DeploymentHandleSource.UNKNOWN)
    router.initialize_state()  # the defaults: checkpoint, margins 2 and 1.5, cache threshold 0.3

    def call_index(method: str, *args):
        calls.append((method, *args))
        if method == "predict":
            if predictions is None:
                raise TimeoutError("index down")
            return [predictions[r.rsplit("#", 1)[1]] for r in args[1]]
        return None

    router._call_index = call_index
    replicas = [SimpleNamespace(replica_id=ReplicaID(name, DEPLOYMENT)) for name in ("a", "b", "c")]
    return router, replicas


def _choose(router, replicas, prompt_ids=(PROMPT,), cache_salt: str = "") -> list[list[str]]:
    async def run():
        request = PendingRequest(args=[EngineRequest("POST", "/v1/completions", prompt_ids=prompt_ids,
                                                     cache_salt=cache_salt)], kwargs={}, metadata=None)
        ranks = await router.choose_replicas(replicas, request)
        return [[r.replica_id.unique_id for r in rank] for rank in ranks]

    return asyncio.run(run())


def test_the_usable_hit_ranks_first_then_by_predicted_hit():
    calls: list = []
    # a holds the prompt's KV without a state; b a state at step 150; c nothing
    router, replicas = _router({"a": (192, 0), "b": (144, 150), "c": (0, 0)}, calls)
    router.replica_queue_len_cache.update(replicas[0].replica_id, 1)
    assert _choose(router, replicas) == [["b"], ["c"], ["a"]]  # the rest: hit, then load (c is idle)
    assert calls[0] == ("predict", (PROMPT,), [r.replica_id.to_full_id_str() for r in replicas], None)
    router.replica_queue_len_cache.update(replicas[1].replica_id, 6)  # b: 6 in flight against c's 0
    assert _choose(router, replicas)[0] == ["c"]
    router.replica_queue_len_cache.update(replicas[1].replica_id, 2)  # within the margin again
    assert _choose(router, replicas)[0] == ["b"]


def test_the_request_s_cache_salt_goes_to_the_index():
    calls: list = []
    router, replicas = _router({"a": (0, 0), "b": (144, 150), "c": (0, 0)}, calls)
    assert _choose(router, replicas, cache_salt="tenant-a")[0] == ["b"]
    assert calls[0] == ("predict", (PROMPT,), [r.replica_id.to_full_id_str() for r in replicas], "tenant-a")


def test_a_miss_a_short_hit_no_prompt_or_no_index_leave_the_choice_to_load():
    calls: list = []
    router, replicas = _router({"a": (0, 0), "b": (0, 40), "c": (0, 0)}, calls)  # 40 < 0.3 x 200
    router.replica_queue_len_cache.update(replicas[0].replica_id, 3)
    router.replica_queue_len_cache.update(replicas[1].replica_id, 1)
    assert _choose(router, replicas)[0] == ["c"]  # the least loaded
    assert _choose(router, replicas, prompt_ids=()) == [["a", "b", "c"]]
    down, _ = _router(None, calls)
    assert _choose(down, replicas) == [["a", "b", "c"]]


def test_a_dead_replica_leaves_the_index():
    calls: list = []
    router, replicas = _router({}, calls)

    async def run():
        router.on_replica_actor_died(replicas[1].replica_id)
        await asyncio.sleep(0.2)  # the drop runs on a thread

    asyncio.run(run())
    assert ("drop", [replicas[1].replica_id.to_full_id_str()]) in calls


def test_a_pinned_request_goes_to_its_replica_only_and_predictions_are_kept_for_the_ingress():
    from hybridcache.router.ray_metrics import PREDICTED_HITS

    calls: list = []
    router, replicas = _router({"a": (192, 0), "b": (144, 150), "c": (0, 0)}, calls)
    ids = [r.replica_id.to_full_id_str() for r in replicas]

    async def ranks(request: EngineRequest) -> list[list[str]]:
        chosen = await router.choose_replicas(replicas, PendingRequest(args=[request], kwargs={}, metadata=None))
        return [[r.replica_id.unique_id for r in rank] for rank in chosen]

    assert asyncio.run(ranks(EngineRequest("GET", "/metrics", replica_id=ids[2]))) == [["c"]]
    # a replica no longer running: any may take it (a stored response there is gone; the taker answers 404)
    assert asyncio.run(ranks(EngineRequest("GET", "/metrics", replica_id="gone"))) == [["a", "b", "c"]]
    assert calls == []  # a pinned request asks the index nothing
    routed = EngineRequest("POST", "/v1/completions", prompt_ids=(PROMPT,), route_key="key-1")
    assert asyncio.run(ranks(routed))[0] == ["b"]
    assert PREDICTED_HITS.take("key-1", ids[1]) == 150  # the usable hit (cached_len) of the replica taken
    assert PREDICTED_HITS.take("key-1", ids[1]) is None  # taken once
    asyncio.run(ranks(routed))
    assert PREDICTED_HITS.take("key-1", ids[0]) == 0  # a's KV without a state predicts no hit


def test_under_queueing_the_replica_found_for_a_request_goes_to_that_request():
    """Ray 2.60 gives the replica a routing task found to the pending request with the same internal request id
    (`RequestRouter._fulfill_next_pending_request`); a router with `FIFOMixin` (Ray's default one) gives it to
    the oldest pending request, and two calls sharing one id (calls made while serving one HTTP request) take
    each other's (ray_router.py's docstring)."""
    from ray.serve._private.common import RequestMetadata
    from ray.serve._private.request_router.request_router import FIFOMixin

    class FifoCheckpointRequestRouter(FIFOMixin, CheckpointRequestRouter):
        pass

    def taken(router_class, ids: tuple[str, str]) -> list[str | None]:
        async def run() -> list[str | None]:
            router = router_class(DEPLOYMENT, DeploymentHandleSource.UNKNOWN)
            replicas = [SimpleNamespace(replica_id=ReplicaID(name, DEPLOYMENT)) for name in ("a", "b")]
            waiting = [PendingRequest(args=[], kwargs={}, metadata=RequestMetadata(request_id=i, internal_request_id=i))
                       for i in ids]
            for pending in waiting:  # queued in arrival order, as `_choose_replica_for_request` queues them
                router._pending_requests_to_fulfill.append(pending)
                router._add_pending_request_to_indices(pending)
            router._fulfill_next_pending_request(replicas[1], waiting[1].metadata)  # b was found for the second
            return [p.future.result().replica_id.unique_id if p.future.done() else None for p in waiting]

        return asyncio.run(run())

    assert taken(CheckpointRequestRouter, ("first", "second")) == [None, "b"]
    assert taken(FifoCheckpointRequestRouter, ("first", "second")) == ["b", None]  # Ray's FIFO routers hand it on
    assert taken(CheckpointRequestRouter, ("shared", "shared")) == ["b", None]  # one id: the first takes it


def test_without_a_usable_hit_the_conversations_own_chain_ranks_first():
    """The index answers (kv_len, cached_len, chain): no usable hit anywhere, so the most KV is followed when it
    is at least half its chain (a later turn of the conversation there), else the least loaded goes first."""
    calls: list = []
    for chain, first in ((400, "c"), (200, "b")):  # b's 180 tokens: a short prefix of 400, most of 200
        router, replicas = _router({"a": (0, 0, 0), "b": (180, 0, chain), "c": (0, 0, 0)}, calls)
        for replica in replicas[:2]:
            router.replica_queue_len_cache.update(replica.replica_id, 1)  # c is the least loaded
        assert _choose(router, replicas)[0] == [first]
