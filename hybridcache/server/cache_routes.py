"""What the prefix cache holds, for a router (hybridcache/router/): its events, and a dry-run match.

    GET  /v1/cache/events?since=N[&limit=M]   the cache events numbered >= N (cache/events.py), or, when N is
         [&paged=true]                        left out or older than the log keeps, `reset: true` and a
                                              snapshot of everything held, to replace what the reader had;
                                              with the log's `epoch` (numbers are only valid within one).
                                              `paged=true`: a snapshot comes in pages of at most M events,
                                              each but the last with a `cursor` for the next; 503 with
                                              `Retry-After` while `MAX_HELD_SNAPSHOTS` are being read
    GET  /v1/cache/events?cursor=C[&limit=M]  the snapshot's next page: `reset: false`, its `next` and
                                              `epoch`; 409 `snapshot_gone` when the snapshot is no longer
                                              held (ask for a new one)
    POST /v1/cache/match                      a completions or chat body -> per prompt: prompt_tokens,
                                              kv_tokens (full blocks in the trie), cached_tokens (what a
                                              request sent now would skip, under its `cache_salt`: 0 for
                                              one that asks for prompt logprobs, or echo with logprobs,
                                              which computes every prompt position);
                                              generates nothing, changes nothing

Both read the cache on the engine thread (`EngineLoop.call`), between steps; a match's prompts are rendered and
tokenized off the event loop, and a text too long to fit is refused before tokenizing, as for a completion. The
event log is enabled by the first events request (which gets a snapshot), so a server nobody routes to keeps no
log. Answers are encoded on a thread, not on the event loop (a snapshot of 300,000 blocks is 45 MB of JSON).

A snapshot is taken on the engine thread and held, to be read page by page::

    snapshot (next = S, events e_0 .. e_n-1)     page 1: e_0 .. e_M-1, cursor "<id>.M"
                                                 page 2: e_M .. e_2M-1, cursor "<id>.2M"   ...   last: no cursor

Each paged reader gets a snapshot of its own, held from its first page until its last page is served, the log
lost some event numbered S or later (the reader could not catch up from it), or no one read it for
`SNAPSHOT_KEEP_S` seconds; a snapshot that one answer holds whole (unpaged, or a single page) is never held. A
snapshot being read is never dropped for a new one: while `MAX_HELD_SNAPSHOTS` are held, a new paged reader gets 503
with `Retry-After`, before a snapshot is taken (five routers starting together used to evict each other's, each
evicted one's next page a 409, every retry a walk of the whole cache).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from hybridcache.cache import CacheRequest
from hybridcache.cache.events import CacheEvent
from hybridcache.cache.request import check_cache_salt
from hybridcache.server.engine_loop import EngineFailure, EngineLoop
from hybridcache.server.errors import APIError
from hybridcache.server.protocol import ChatCompletionRequest, CompletionRequest, parse_request

EVENT_LOG_CAPACITY = 1 << 16
MAX_EVENTS_PER_POLL = 1 << 14
SNAPSHOT_KEEP_S = 10.0  # a held snapshot no one read for this long is dropped (its reader gave up on it)
MAX_HELD_SNAPSHOTS = 4
SNAPSHOTS_BUSY_RETRY_S = 1  # the Retry-After of a paged reader refused while MAX_HELD_SNAPSHOTS are held


@dataclass
class Snapshot:
    """Everything the cache held when the log's next event number was `next_seq`, as stored events; `read_at`:
    `time.monotonic()` when it was taken or a page of it last served."""

    snapshot_id: str
    next_seq: int
    events: Sequence[CacheEvent]
    read_at: float


class CacheRoutes:
    """The two routes above over `engine_loop`'s engine; `authorize(request)` raises for a bad API key,
    `read_json(request)` reads a body within the server's limits, `prompt_ids(body)` renders and tokenizes a
    completions or chat body as the server does (`body_prompt_ids`, off the event loop)."""

    def __init__(self, engine_loop: EngineLoop, authorize: Callable[[Request], None],
                 read_json: Callable[[Request], Awaitable[Any]],
                 prompt_ids: Callable[[Any], Awaitable[list[list[int]]]]) -> None:
        self.engine_loop = engine_loop
        self.prompt_ids = prompt_ids
        self.authorize = authorize
        self.read_json = read_json
        self.log: Any = None  # the cache's CacheEventLog, once enabled
        self.head: dict[str, Any] = {}  # block_size, full_prompt_hits: what a reader needs to match prompts
        self.snapshots: dict[str, Snapshot] = {}  # the held ones by id (module docstring)
        self.num_taking = 0  # paged snapshots being taken on the engine thread, not held yet

    async def events(self, request: Request, since: int | None = None, limit: int = MAX_EVENTS_PER_POLL,
                     paged: bool = False, cursor: str | None = None) -> JSONResponse:
        self.authorize(request)
        if limit < 1:
            raise APIError(400, f"limit must be >= 1, got {limit}", param="limit")
        limit = min(limit, MAX_EVENTS_PER_POLL)
        self._drop_old_snapshots()  # (on every request: a reader that gave up frees its snapshot in time)
        if cursor is not None:
            if since is not None:
                raise APIError(400, "cursor continues a snapshot: leave since out", param="since")
            snapshot, offset = self._page_start(cursor)
            return await self._page(snapshot, offset, limit, False)
        if since is not None and self.log is not None:
            try:
                batch = self.log.since(since, limit)
            except ValueError as error:
                raise APIError(400, str(error), param="since") from None
            if not batch.lost:
                return await run_in_threadpool(self._answer, False, batch.next_seq, batch.events)
        if not paged:
            return await self._page(await self._new_snapshot(), 0, None, True)
        self._check_room()
        self.num_taking += 1  # counted as held while taken: readers arriving together cannot pass the cap
        try:
            snapshot = await self._new_snapshot()
        finally:
            self.num_taking -= 1
        return await self._page(snapshot, 0, limit, True)

    def _check_room(self) -> None:
        """Raise 503 with `Retry-After` while `MAX_HELD_SNAPSHOTS` snapshots are held (or being taken) and read."""
        if len(self.snapshots) + self.num_taking >= MAX_HELD_SNAPSHOTS:
            raise APIError(503, f"{MAX_HELD_SNAPSHOTS} cache snapshots are being read, the most held at a time: ask "
                           "again shortly", headers={"Retry-After": str(SNAPSHOTS_BUSY_RETRY_S)})

    def _drop_old_snapshots(self) -> None:
        """Drop the held snapshots that are stale or were not read for `SNAPSHOT_KEEP_S` (run on every events
        request, and `SNAPSHOT_KEEP_S` after each page of a held snapshot: one is dropped with no request after it)."""
        now = time.monotonic()
        for snapshot in list(self.snapshots.values()):
            if now - snapshot.read_at > SNAPSHOT_KEEP_S or self.log.since(snapshot.next_seq, 0).lost:
                self.snapshots.pop(snapshot.snapshot_id)

    async def _new_snapshot(self) -> Snapshot:
        def take(engine: Any) -> Snapshot:
            cache = engine.scheduler.cache
            if self.log is None:
                log = cache.events or cache.enable_events(EVENT_LOG_CAPACITY)
                self.head = {"block_size": cache.block_size, "full_prompt_hits": cache.config.full_prompt_hits,
                             "epoch": log.epoch}
                self.log = log
            return Snapshot(uuid.uuid4().hex, self.log.next_seq, cache.snapshot_events(), time.monotonic())

        return await self._call(take)

    def _page_start(self, cursor: str) -> tuple[Snapshot, int]:
        snapshot_id, _, offset = cursor.partition(".")
        if not offset.isdigit():
            raise APIError(400, f"malformed snapshot cursor {cursor!r}", param="cursor")
        snapshot = self.snapshots.get(snapshot_id)
        if snapshot is None:
            raise APIError(409, "the snapshot this cursor reads is no longer held (read to its end, the event log "
                           "moved past it, or unread for a while): ask for a new one",
                           param="cursor", code="snapshot_gone")
        if int(offset) > len(snapshot.events):
            raise APIError(400, f"snapshot cursor {cursor!r} is past the snapshot's end", param="cursor")
        return snapshot, int(offset)

    async def _page(self, snapshot: Snapshot, offset: int, limit: int | None, reset: bool) -> JSONResponse:
        """Events [offset, offset + limit) of `snapshot` (to its end when `limit` is None), with the cursor of the
        next page when there is one; held while there is (module docstring)."""
        snapshot.read_at = time.monotonic()
        end = len(snapshot.events) if limit is None else min(len(snapshot.events), offset + limit)
        more = {"cursor": f"{snapshot.snapshot_id}.{end}"} if end < len(snapshot.events) else {}
        if more:
            self.snapshots[snapshot.snapshot_id] = snapshot
            asyncio.get_running_loop().call_later(SNAPSHOT_KEEP_S + 1, self._drop_old_snapshots)
        else:  # its last page: no one reads it again
            self.snapshots.pop(snapshot.snapshot_id, None)
        return await run_in_threadpool(self._answer, reset, snapshot.next_seq, snapshot.events[offset:end], more)

    def _answer(self, reset: bool, next_seq: int, events: Sequence[CacheEvent],
                extra: dict[str, Any] | None = None) -> JSONResponse:
        """An events answer, encoded (run on a thread: a snapshot's is megabytes)."""
        return JSONResponse({**self.head, "reset": reset, "next": next_seq, "events": [e.to_json() for e in events],
                             **(extra or {})})

    async def match(self, request: Request) -> JSONResponse:
        self.authorize(request)
        body = await self.read_json(request)
        prompts = await self.prompt_ids(body)
        if not all(prompts):
            raise APIError(400, "a prompt is empty", param="prompt")
        chat = isinstance(body, dict) and "messages" in body
        parsed = await run_in_threadpool(parse_request, ChatCompletionRequest if chat else CompletionRequest, body)
        skips_cache = parsed.engine_prompt_logprobs() is not None  # computes every prompt position, as vLLM's
        salt = body.get("cache_salt") if isinstance(body, dict) else None
        try:
            check_cache_salt(salt)
        except ValueError as error:
            raise APIError(400, str(error), param="cache_salt") from None

        def probe(engine: Any) -> list:
            cache = engine.scheduler.cache
            return [cache.probe(CacheRequest(f"probe-{i}", tuple(ids), cache_salt=salt))
                    for i, ids in enumerate(prompts)]

        probes = await self._call(probe)
        return JSONResponse({"matches": [
            {"prompt_tokens": len(ids), "kv_tokens": p.kv_len, "cached_tokens": 0 if skips_cache else p.cached_len}
            for ids, p in zip(prompts, probes)]})

    async def _call(self, fn: Callable[[Any], Any]) -> Any:
        try:
            return await self.engine_loop.call(fn)
        except EngineFailure as error:
            raise APIError(503, str(error)) from None
