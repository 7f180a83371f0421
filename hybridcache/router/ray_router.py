"""`CheckpointRequestRouter`: the checkpoint-aware policy as a Ray Serve custom request router.

Ray Serve calls `choose_replicas(candidates, pending_request)` for every request sent through a handle of the
engine deployment (ray_serve.py), in the process holding the handle (the OpenAI ingress). The request's first
argument carries the prompt's token ids (`EngineRequest.prompt_ids`, tokenized by the ingress as the replicas
will), so the router asks the index deployment (`FleetIndex` behind `CacheIndex`) what each candidate would hit
and the chain its KV match sits on, and applies the HTTP router's rule (policy.py: the longest usable hit, or with
none the conversation's own chain, unless that replica is too loaded; else the least-loaded one). It answers ranks,
best first::

    [[chosen], [next-best by predicted hit], ...]

and Ray sends the request to the first rank's replica unless it is full (`max_ongoing_requests`), then tries the
next rank. Loads are Ray's own queue lengths of the replicas (`replica_queue_len_cache`: requests this process
sent, corrected by the replicas' reports). A request without prompt ids (another method) or an index that does not
answer within `index_timeout_s` gets every candidate in one rank (Ray takes the shortest queue). Replicas that
leave (died, scaled down, replaced after a failed health check) are dropped from the index.

Two requests are routed otherwise: one pinned to a replica (`EngineRequest.replica_id`: the ingress's /metrics
scrape, ray_metrics.py; a stored response and its continuation, router/responses.py) goes to that replica only
while it is a candidate, and to any once it is not (it died or left: what it held is gone, and the replica that
takes the request answers for itself, e.g. 404 for an unknown response); and the predictions of a request with a
`route_key` are stored in `ray_metrics.PREDICTED_HITS`, so the ingress counts the prediction of the replica that
took it.

Which request takes the replica found (Ray 2.60, `ray/serve/_private/request_router/request_router.py`): a routing
task calls `choose_replicas` for one pending request and hands the replica it finds to
`_fulfill_next_pending_request`, which in the base `RequestRouter` (this class's) gives it to the pending request
with the same `internal_request_id`: under queueing, each request still gets the replica chosen for it. Two cases
differ, neither met here. A router that mixes in `FIFOMixin` (Ray's default PowerOfTwoChoices router does) gives it
to the oldest pending request instead. And handle calls made while serving one HTTP request share that request's
internal id (`default_impl.get_request_metadata` copies the serve request context's): of two such calls pending at
once, the first takes the replica chosen for either, and the second is no longer matched by id. The ingress
never has two calls of one HTTP request pending at once (its /metrics scrape and stored-response lookups ask
replicas one at a time, a retry follows a failure), and it counts each answer against the replica that sent it
(the answer's first message), not the one predicted.

Ray's request-router API is alpha (ray.serve.request_router); this follows Ray 2.60's.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from ray import serve
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from hybridcache.cache.request import Probe
from hybridcache.router import ray_metrics
from hybridcache.router.policy import Chooser, RoutingConfig

logger = logging.getLogger("hybridcache.router")
INDEX_DEPLOYMENT = "CacheIndex"


class CheckpointRequestRouter(RequestRouter):
    """The checkpoint-aware request router (module docstring)."""

    index_deployment: str = INDEX_DEPLOYMENT
    index_timeout_s: float = 2.0
    _index: Any = None

    def initialize_state(self, policy: str = "checkpoint", abs_margin: int = 2, rel_margin: float = 1.5,
                         min_hit_fraction: float = 0.3, index_deployment: str = INDEX_DEPLOYMENT,
                         index_timeout_s: float = 2.0) -> None:
        """Called by Ray Serve with `RequestRouterConfig.request_router_kwargs`: the routing rule's options
        (`RoutingConfig`), the index deployment's name (in this application) and how long to wait for it."""
        self.chooser = Chooser(RoutingConfig(policy, abs_margin, rel_margin, min_hit_fraction))
        self.index_deployment = index_deployment
        self.index_timeout_s = index_timeout_s

    def _index_handle(self) -> Any:
        if self._index is None:
            self._index = serve.get_deployment_handle(self.index_deployment, self.app_name)
        return self._index

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        pinned = _arg(pending_request, "replica_id")
        if pinned:
            chosen = [r for r in candidate_replicas if r.replica_id.to_full_id_str() == pinned]
            return [chosen or list(candidate_replicas)]
        prompts = _arg(pending_request, "prompt_ids")
        if not prompts or len(candidate_replicas) < 2:
            return [list(candidate_replicas)]
        ids = [r.replica_id.to_full_id_str() for r in candidate_replicas]
        try:
            salt = _arg(pending_request, "cache_salt")  # its prompts hit only what that salt stored
            predicted = await asyncio.to_thread(self._call_index, "predict", prompts, ids, salt)
            probes = [Probe(kv, cached) for kv, cached, *_ in predicted]
            chains = [chain[0] if chain else 0 for _, _, *chain in predicted]
        except Exception as error:  # noqa: BLE001 - an index down or restarting must not stop routing
            logger.warning("the cache index did not answer (%s: %s): routing by load", type(error).__name__, error)
            return [list(candidate_replicas)]
        route_key = _arg(pending_request, "route_key")
        if route_key:
            # through the module: Ray may pickle this class by value, with copies of the names it binds
            ray_metrics.PREDICTED_HITS.put(route_key, {r: p.cached_len for r, p in zip(ids, probes, strict=True)})
        loads = [self.replica_queue_len_cache.get(r.replica_id) or 0 for r in candidate_replicas]
        first = self.chooser.choose(probes, loads, sum(len(p) for p in prompts), lambda i, limit: min(chains[i], limit))
        rest = sorted((i for i in range(len(ids)) if i != first), key=lambda i: (-probes[i].cached_len, loads[i]))
        return [[candidate_replicas[i]] for i in (first, *rest)]

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        before = set(self.curr_replicas)
        super().update_replicas(replicas)
        self._forget(before - set(self.curr_replicas))

    def on_replica_actor_died(self, replica_id: Any) -> None:
        super().on_replica_actor_died(replica_id)
        self._forget({replica_id})

    def _forget(self, replica_ids: set) -> None:
        if not replica_ids:
            return
        ids = [r.to_full_id_str() for r in replica_ids]
        task = asyncio.ensure_future(asyncio.to_thread(self._call_index, "drop", ids))
        task.add_done_callback(lambda t: t.cancelled() or t.exception() is None or logger.warning(
            "could not drop replicas %s from the cache index: %s", ids, t.exception()))

    def _call_index(self, method: str, *args: Any) -> Any:
        """Call the index deployment and wait for its answer, on a thread: a handle's response must not be
        awaited on the routing event loop, which the handle itself needs to route the call."""
        return getattr(self._index_handle(), method).remote(*args).result(timeout_s=self.index_timeout_s)


def _arg(pending_request: PendingRequest | None, field: str) -> Any:
    """A field of the request's first argument (an `EngineRequest`: its `prompt_ids`, `route_key`,
    `replica_id`, `cache_salt`), None when it has none or it is empty."""
    if pending_request is None or not pending_request.args:
        return None
    return getattr(pending_request.args[0], field, None) or None
