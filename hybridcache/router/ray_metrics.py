"""/metrics of the Ray Serve ingress (ray_serve.py): the router's counters, and every engine replica's metrics.

Router counters: the standalone router's series (app.py `render_router_metrics`, the same names), counted in the
ingress. Ray picks the replica inside the handle call, so the ingress learns it from the answer's first message
(`"replica"`), and the prediction for it from `PredictedHits`: the request router (ray_router.py) runs in the
ingress's process and stores, under the request's `route_key`, what each candidate was predicted to hit::

    ingress:  key = new route_key            router: predicted = index.predict(...)
              send EngineRequest(key)   ->           PREDICTED_HITS.put(key, {replica: cached_len, ...})
              head = first message             <-    (Ray sends the request to a replica)
              PREDICTED_HITS.take(key, head["replica"])  -> counted with the usage the replica reports

Predicted and reported hit tokens are summed over the requests that had a prediction (a prompt, two or more
candidates, an index that answered) and reported usage. `retried_away` is not exposed: a replica that fails
before answering is not named by Ray's error.

Engine metrics: a handle call goes to the replica the request router picks, so the ingress pins one call per
replica (`EngineRequest.replica_id`, honoured by the request router) to that replica's own `GET /metrics`, for
every replica the cache index knows, and merges the answers into one exposition with a `replica` label. A
replica that does not answer within the timeout (dead, or full of requests) is left out of that scrape.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping

from prometheus_client import generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from hybridcache.router.app import ReplicaView, render_router_metrics
from hybridcache.router.replicas import ReplicaCounters

MAX_PENDING_PREDICTIONS = 4096  # predictions never taken (a request cancelled while routed) are dropped oldest first


class PredictedHits:
    """Thread-safe map route_key -> {replica id: predicted cached tokens}, written by the request router (on
    Ray's routing loop) and taken by the ingress (on its own loop)."""

    def __init__(self, capacity: int = MAX_PENDING_PREDICTIONS) -> None:
        self._lock = threading.Lock()
        self._pending: OrderedDict[str, dict[str, int]] = OrderedDict()
        self._capacity = capacity

    def put(self, route_key: str, predicted: Mapping[str, int]) -> None:
        with self._lock:
            self._pending[route_key] = dict(predicted)
            self._pending.move_to_end(route_key)
            while len(self._pending) > self._capacity:
                self._pending.popitem(last=False)

    def take(self, route_key: str, replica_id: str) -> int | None:
        """The prediction for the replica that took the request (None: none was made), forgetting the key."""
        with self._lock:
            predicted = self._pending.pop(route_key, None)
        return None if predicted is None else predicted.get(replica_id)


PREDICTED_HITS = PredictedHits()


class IngressCounters:
    """What the ingress routed, per replica id, and its totals (retries, failures)."""

    def __init__(self) -> None:
        self.replicas: dict[str, ReplicaCounters] = {}
        self.in_flight: dict[str, int] = {}
        self.num_retries = 0
        self.num_failed = 0

    def of(self, replica_id: str) -> ReplicaCounters:
        return self.replicas.setdefault(replica_id, ReplicaCounters())

    def render(self, index_stats: Mapping[str, dict]) -> str:
        """The router series, for every replica routed to or known to the index (its `up` and checkpoints)."""
        views = [ReplicaView(r, self.of(r), self.in_flight.get(r, 0), bool(index_stats.get(r, {}).get("up")),
                             int(index_stats.get(r, {}).get("indexed_checkpoints", 0)), retried_away=None)
                 for r in sorted(set(self.replicas) | set(index_stats))]
        return render_router_metrics(views, self.num_retries, self.num_failed)


def merge_replica_metrics(texts: Mapping[str, str], label: str = "replica") -> str:
    """The Prometheus texts of several replicas as one, each sample labelled `label` with its key (replacing a
    label of that name it had: the standalone router's `engine`, app.py `engine_metrics`); a family keeps its first
    replica's type and help. Raises ValueError for text that is not Prometheus's format."""
    families: dict[str, Metric] = {}
    for replica, text in texts.items():
        for family in text_string_to_metric_families(text):
            merged = families.setdefault(family.name, Metric(family.name, family.documentation, family.type,
                                                             family.unit))
            merged.samples += [s._replace(labels={**s.labels, label: replica}) for s in family.samples]
    return generate_latest(_Families(families.values())).decode() if families else ""


class _Families:
    """A collector of ready families, for `generate_latest`."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self._families = list(families)

    def collect(self) -> Iterable[Metric]:
        return self._families

