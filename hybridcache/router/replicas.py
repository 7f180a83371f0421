"""The router's view of each replica: its cache index (from `GET /v1/cache/events`), whether it answers, and
what was routed to it.

A replica is *up* while its last events poll succeeded. A failed poll, or a request that cannot reach it,
marks it down: its index is dropped (it predicts nothing) and it gets no requests; the next successful poll
(a `reset` snapshot, since its cache may have restarted) brings it back. A poll that finds another event log
(its `epoch` changed: the replica restarted between two polls) drops the index; the next poll takes a snapshot.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import httpx

from hybridcache.cache.events import CacheEvent
from hybridcache.cache.request import Probe
from hybridcache.router.index import ReplicaIndex, prompt_hashes

logger = logging.getLogger("hybridcache.router")


@dataclass
class ReplicaCounters:
    """Per-replica totals for /metrics. predicted / reported: hit tokens of the requests whose responses
    reported usage (the router's prediction at routing time, and the replica's `cached_tokens`)."""

    routed: int = 0
    retried_away: int = 0
    predicted_hit_tokens: int = 0
    reported_hit_tokens: int = 0
    prompt_tokens: int = 0


@dataclass
class Replica:
    url: str
    index: ReplicaIndex | None = None
    up: bool = False
    in_flight: int = 0
    next_seq: int | None = None
    epoch: str | None = None
    full_prompt_hits: bool = False
    counters: ReplicaCounters = field(default_factory=ReplicaCounters)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def predict(self, prompts: list[list[int]], salt: str | None = None) -> Probe:
        """The summed (kv_len, cached_len) of `prompts` (of a request with cache salt `salt`) here; (0, 0) while
        down or not yet indexed."""
        if not self.up or self.index is None:
            return Probe(0, 0)
        kv = cached = 0
        for ids in prompts:
            max_step = len(ids) - (0 if self.full_prompt_hits else 1)
            hashes = prompt_hashes(ids, self.index.block_size, salt=salt)
            probe = self.index.predict(ids, max_step, block_hashes=hashes, salt=salt)
            kv, cached = kv + probe.kv_len, cached + probe.cached_len
        return Probe(kv, cached)

    def chain(self, prompts: list[list[int]], limit: int, salt: str | None = None) -> int:
        """The summed `ReplicaIndex.chain_len` of `prompts` (cache salt `salt`) here, up to `limit`; 0 while down
        or not indexed."""
        if not self.up or self.index is None:
            return 0
        size = self.index.block_size
        return min(limit, sum(self.index.chain_len(ids, limit, block_hashes=prompt_hashes(ids, size, salt=salt))
                              for ids in prompts))

    def mark_down(self, reason: str) -> None:
        if self.up:
            logger.warning("replica %s is down: %s", self.url, reason)
        self.up = False
        self.index = None
        self.next_seq = None
        self.epoch = None

    async def poll(self, client: httpx.AsyncClient, timeout_s: float, headers: dict[str, str] | None = None) -> None:
        """Bring the index up to date with the replica's events (a snapshot when it has none or lost some);
        marks the replica down on any failure. `headers`: sent with the request (the API key)."""
        async with self.lock:
            params = {} if self.next_seq is None else {"since": self.next_seq}
            try:
                response = await client.get(f"{self.url}/v1/cache/events", params=params, timeout=timeout_s,
                                            headers=headers)
                response.raise_for_status()
                self.apply(response.json())
            except (httpx.HTTPError, ValueError, KeyError, TypeError) as error:
                self.mark_down(f"events poll failed: {type(error).__name__}: {error}")

    def apply(self, body: dict) -> None:
        """Apply one `GET /v1/cache/events` answer (asked with `since=self.next_seq`, or none when that is None)
        and mark the replica up. An answer of another event log (its epoch changed: the replica restarted) drops
        the index instead: `next_seq` is then None, so the next answer asked for is a snapshot. Raises
        ValueError, KeyError or TypeError for a malformed answer, changing nothing."""
        events = [CacheEvent.from_json(e) for e in body["events"]]
        block_size, next_seq = int(body["block_size"]), int(body["next"])
        if not body["reset"] and body.get("epoch") != self.epoch:  # another log (a restart): start again
            self.index, self.next_seq, self.epoch = None, None, None
            return
        if body["reset"] or self.index is None or self.index.block_size != block_size:
            self.index = ReplicaIndex(block_size)
        self.epoch = body.get("epoch")
        self.index.apply(events)
        self.full_prompt_hits = bool(body.get("full_prompt_hits", False))
        self.next_seq = next_seq
        if not self.up:
            logger.info("replica %s is up (%d blocks, %d checkpoints indexed)", self.url,
                        len(self.index.blocks), self.index.num_checkpoints)
        self.up = True
