"""The router's view of each replica: its cache index (from `GET /v1/cache/events`), whether it answers, and
what was routed to it.

A replica is *up* while its last events poll succeeded. A failed poll, or a request that cannot reach it,
marks it down: its index is dropped (it predicts nothing) and it gets no requests; the next successful poll
(a `reset` snapshot, since its cache may have restarted) brings it back. Going down is logged with its reason,
and so is each new reason while down (`mark_down`): a replica that never comes up is named too. A poll that finds
another event log (its `epoch` changed: the replica restarted between two polls) drops the index; the next poll
takes a snapshot.

Polls of one replica run one at a time (two polls asking with the same `since` would apply the same events
twice) and coalesce, so that K responses finishing together wait for at most two polls, not K in a row::

    poll() while none runs           ->  starts one (running)
    poll() while one runs            ->  waits for the next (pending), which starts once the running one ends
    poll() while one runs and one waits  ->  waits for that pending one too (it starts after the call, so
                                             it sees what the caller's response stored)

A snapshot is read in pages (`paged=true`, then the answer's `cursor` until none is left) and built into a new
index off the event loop, which replaces the old one once complete; an answer's JSON is parsed off the event
loop when large, so a replica with a big cache neither stalls the streams relayed meanwhile nor runs past the
poll timeout (which bounds each page's request). A replica that cannot give a snapshot now (a 409 `snapshot_gone`
on a page, a 503 with `Retry-After`: other readers hold its snapshots, `snapshot_later`) is not down: the poll
ends changing nothing, and the next one asks again.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass, field
from typing import Any

import httpx

from hybridcache.cache.events import CacheEvent
from hybridcache.cache.request import Probe
from hybridcache.router.index import ReplicaIndex, prompt_hashes

logger = logging.getLogger("hybridcache.router")

INLINE_PARSE_BYTES = 1 << 16  # an events answer up to this size is parsed on the event loop, a larger on a thread


@dataclass
class ReplicaCounters:
    """Per-replica totals for /metrics. predicted / reported: hit tokens of the requests whose responses
    reported usage (the router's prediction at routing time, and the replica's `cached_tokens`)."""

    routed: int = 0
    retried_away: int = 0
    predicted_hit_tokens: int = 0
    reported_hit_tokens: int = 0
    prompt_tokens: int = 0


@dataclass(frozen=True)
class EventsAnswer:
    """One `GET /v1/cache/events` answer, its events parsed. `cursor`: where a paged snapshot's next page starts
    (None on its last page and on every other answer)."""

    reset: bool
    next_seq: int
    block_size: int
    epoch: str | None
    full_prompt_hits: bool
    events: list[CacheEvent]
    cursor: str | None = None

    @classmethod
    def parse(cls, body: Any) -> EventsAnswer:
        """Raises ValueError, KeyError or TypeError for a malformed answer (ValueError for one that is no JSON
        object, `[]` or `null` from a URL that points at another service, and for a number past a float's range)."""
        if not isinstance(body, dict):
            raise ValueError(f"an events answer is a JSON object, not {type(body).__name__}")
        cursor = body.get("cursor")
        if cursor is not None and not isinstance(cursor, str):
            raise ValueError(f"malformed snapshot cursor {cursor!r}")
        try:
            return cls(bool(body["reset"]), int(body["next"]), int(body["block_size"]), body.get("epoch"),
                       bool(body.get("full_prompt_hits", False)), [CacheEvent.from_json(e) for e in body["events"]],
                       cursor)
        except OverflowError as error:  # int(1e999)
            raise ValueError(f"malformed events answer: {error}") from None

    @classmethod
    def decode(cls, content: bytes) -> EventsAnswer:
        """`parse` of an answer's bytes; raises ValueError for JSON nested too deeply to parse."""
        try:
            body = json.loads(content)
        except RecursionError:
            raise ValueError("an events answer nested too deeply to parse") from None
        return cls.parse(body)


def snapshot_later(response: httpx.Response) -> bool:
    """Whether an events answer says "read the snapshot at a later poll", not that the replica is down: a 409 (the
    snapshot being read is no longer held: `snapshot_gone`) or a 503 with `Retry-After` (as many snapshots as the
    replica holds are being read by others). The replica keeps its state (`up`, and its index while up)."""
    return response.status_code == 409 or response.status_code == 503 and "retry-after" in response.headers


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
    down_reason: str | None = field(default=None, init=False, compare=False)  # the last one logged while down
    _running: asyncio.Task | None = field(default=None, init=False, repr=False, compare=False)
    _pending: asyncio.Task | None = field(default=None, init=False, repr=False, compare=False)

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
        """Mark the replica down, dropping its index. Logged (WARNING) when it was up, and while down whenever the
        reason changes, the first failure included: a replica that never comes up (a wrong port, a 401 for the
        router's key) is named in the log once, not at every poll, nor never."""
        if self.up or reason != self.down_reason:
            logger.warning("replica %s is down: %s", self.url, reason)
        self.down_reason = reason
        self.up = False
        self.index = None
        self.next_seq = None
        self.epoch = None

    async def poll(self, client: httpx.AsyncClient, timeout_s: float, headers: dict[str, str] | None = None) -> None:
        """Bring the index up to date with the replica's events (a snapshot when it has none or lost some);
        marks the replica down on any failure. `timeout_s` bounds each request (a snapshot's page); `headers`:
        sent with the requests (the API key). Returns once a poll that started after this call has ended (the
        module docstring: a call joins the pending poll, made with the arguments of the call that started it)."""
        if self._pending is None or self._pending.done():  # done: cancelled before it ran (its loop ended)
            running = self._running if self._running is not None and not self._running.done() else None
            self._pending = asyncio.ensure_future(self._poll_after(running, client, timeout_s, headers))
        await asyncio.shield(self._pending)

    async def _poll_after(self, previous: asyncio.Task | None, client: httpx.AsyncClient, timeout_s: float,
                          headers: dict[str, str] | None) -> None:
        if previous is not None:
            await asyncio.wait([previous])
        this = asyncio.current_task()
        self._running, self._pending = this, None
        try:
            await self._poll_once(client, timeout_s, headers)
        finally:
            if self._running is this:
                self._running = None

    async def _poll_once(self, client: httpx.AsyncClient, timeout_s: float, headers: dict[str, str] | None) -> None:
        params = {"paged": "true"} if self.next_seq is None else {"since": self.next_seq, "paged": "true"}
        try:
            answer = await self._get(client, params, timeout_s, headers)
            if answer.reset:
                await self._take_snapshot(answer, client, timeout_s, headers)
            else:
                self.apply_answer(answer)
        except httpx.HTTPStatusError as error:
            if not snapshot_later(error.response):
                self.mark_down(f"events poll failed: {type(error).__name__}: {error}")
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as error:
            self.mark_down(f"events poll failed: {type(error).__name__}: {error}")
        except Exception as error:  # noqa: BLE001 - a poll must end in up or down: not end the poll loop, fail a request
            logger.exception("events poll of %s failed unexpectedly", self.url)
            self.mark_down(f"events poll failed: {type(error).__name__}: {error}")

    async def _get(self, client: httpx.AsyncClient, params: dict, timeout_s: float,
                   headers: dict[str, str] | None) -> EventsAnswer:
        response = await client.get(f"{self.url}/v1/cache/events", params=params, timeout=timeout_s, headers=headers)
        response.raise_for_status()
        if len(response.content) <= INLINE_PARSE_BYTES:
            return EventsAnswer.decode(response.content)
        return await asyncio.to_thread(EventsAnswer.decode, response.content)

    async def _take_snapshot(self, first: EventsAnswer, client: httpx.AsyncClient, timeout_s: float,
                             headers: dict[str, str] | None) -> None:
        """Read a snapshot's pages from `first` on into a new index (built on a thread: no one else sees it yet),
        then put it in place of the old one."""
        index = ReplicaIndex(first.block_size)
        page = first
        await asyncio.to_thread(index.apply, page.events)
        while page.cursor is not None:
            page = await self._get(client, {"cursor": page.cursor}, timeout_s, headers)
            if (page.reset, page.next_seq, page.epoch, page.block_size) != (False, first.next_seq, first.epoch,
                                                                            first.block_size):
                raise ValueError(f"a snapshot page does not continue its snapshot (epoch {first.epoch!r}, "
                                 f"next {first.next_seq}): {page.epoch!r}, {page.next_seq}")
            await asyncio.to_thread(index.apply, page.events)
        self._install(index, first)

    def apply(self, body: dict) -> None:
        """Apply one whole `GET /v1/cache/events` answer (asked with `since=self.next_seq`, or none when that is
        None, and without `paged`) and mark the replica up: `apply_answer`. Raises ValueError, KeyError or
        TypeError for a malformed answer or a snapshot's page (one with a `cursor`), changing nothing."""
        answer = EventsAnswer.parse(body)
        if answer.cursor is not None:
            raise ValueError("a page of a paged snapshot, not a whole answer")
        self.apply_answer(answer)

    def apply_answer(self, answer: EventsAnswer) -> None:
        """Apply a whole answer and mark the replica up. An answer of another event log (its epoch changed: the
        replica restarted) drops the index instead: `next_seq` is then None, so the next answer asked for is a
        snapshot."""
        if not answer.reset and answer.epoch != self.epoch:  # another log (a restart): start again
            self.index, self.next_seq, self.epoch = None, None, None
            return
        index = self.index
        if answer.reset or index is None or index.block_size != answer.block_size:
            index = ReplicaIndex(answer.block_size)
        index.apply(answer.events)
        self._install(index, answer)

    def _install(self, index: ReplicaIndex, answer: EventsAnswer) -> None:
        self.index, self.epoch, self.next_seq = index, answer.epoch, answer.next_seq
        self.full_prompt_hits = answer.full_prompt_hits
        self._mark_up()

    def _mark_up(self) -> None:
        if not self.up:
            logger.info("replica %s is up (%d blocks, %d checkpoints indexed)", self.url,
                        len(self.index.blocks), self.index.num_checkpoints)
        self.up, self.down_reason = True, None
