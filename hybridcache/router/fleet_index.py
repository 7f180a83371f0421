"""`FleetIndex`: the router's index of many replicas' caches, fed by the replicas themselves (push, not poll).

The HTTP router polls each replica's `GET /v1/cache/events` (replicas.py). Under Ray Serve (ray_serve.py) a
router cannot address one replica, so each replica pushes the same answers here instead, and every router asks
here for predictions::

    replica r:  since = None
                loop (after each response it served, and every poll interval):
                    body  = its own GET /v1/cache/events?since=...   (a snapshot when since is None)
                    since = fleet.publish(r, body)                   (None: send a snapshot next time)
    router:     probes = fleet.predict(prompts, [r1, r2, ...], salt)  (kv_len, cached_len) per replica

`publish` applies an answer exactly as the HTTP router's poll does (`Replica.apply`: a restarted replica's new
epoch, or an index that lost its state, is answered with None, and the replica sends a snapshot). A replica this
index has never seen and an unknown one in `predict` predict nothing ((0, 0)). Not thread-safe: one caller at a
time (a Ray actor runs its methods one by one).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

from hybridcache.cache.request import Probe
from hybridcache.router.policy import CHAIN_SHARE
from hybridcache.router.replicas import Replica

logger = logging.getLogger("hybridcache.router")


class FleetIndex:
    """Replicas by id, each with the index its pushed event answers built (module docstring)."""

    def __init__(self) -> None:
        self.replicas: dict[str, Replica] = {}

    def publish(self, replica_id: str, body: dict) -> int | None:
        """Apply one events answer of `replica_id`; the `since` its next answer must be asked with (None: a
        snapshot). A malformed answer drops the replica's index (it predicts nothing until a snapshot)."""
        replica = self.replicas.setdefault(replica_id, Replica(replica_id))
        if not body.get("reset") and replica.next_seq is None:  # this index lost its state (a restart)
            return None
        try:
            replica.apply(body)
        except (ValueError, KeyError, TypeError) as error:
            replica.mark_down(f"malformed events answer: {type(error).__name__}: {error}")
            return None
        return replica.next_seq

    def predict(self, prompts: list[list[int]], replica_ids: Sequence[str], salt: str | None = None) -> list[Probe]:
        """The summed (kv_len, cached_len) of `prompts` (of a request with cache salt `salt`) on each of
        `replica_ids`, in that order."""
        return [self.replicas[r].predict(prompts, salt) if r in self.replicas else Probe(0, 0) for r in replica_ids]

    def chains(self, prompts: list[list[int]], probes: Sequence[Probe], replica_ids: Sequence[str],
               salt: str | None = None) -> list[int]:
        """Each replica's `Replica.chain` of `prompts` (cache salt `salt`), up to what the checkpoint policy needs
        to know (`CHAIN_SHARE`: the limit is `kv_len / CHAIN_SHARE` of its probe, plus one)."""
        return [self.replicas[r].chain(prompts, int(p.kv_len / CHAIN_SHARE) + 1, salt) if r in self.replicas else 0
                for r, p in zip(replica_ids, probes, strict=True)]

    def drop(self, replica_ids: Iterable[str]) -> None:
        """Forget replicas that are gone (their ids are never reused)."""
        for replica_id in replica_ids:
            if self.replicas.pop(replica_id, None) is not None:
                logger.info("replica %s left the index", replica_id)

    def stats(self) -> dict[str, dict]:
        """Per replica: whether indexed, and its indexed blocks and checkpoints."""
        return {r.url: {"up": r.up, "indexed_blocks": len(r.index.blocks) if r.index else 0,
                        "indexed_checkpoints": r.index.num_checkpoints if r.index else 0}
                for r in self.replicas.values()}
