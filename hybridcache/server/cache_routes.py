"""What the prefix cache holds, for a router (hybridcache/router/): its events, and a dry-run match.

    GET  /v1/cache/events?since=N[&limit=M]   the cache events numbered >= N (cache/events.py), or, when N is
                                              left out or older than the log keeps, `reset: true` and a
                                              snapshot of everything held, to replace what the reader had;
                                              with the log's `epoch` (numbers are only valid within one)
    POST /v1/cache/match                      a completions or chat body -> per prompt: prompt_tokens,
                                              kv_tokens (full blocks in the trie), cached_tokens (what a
                                              request sent now would skip, under its `cache_salt`);
                                              generates nothing, changes nothing

Both read the cache on the engine thread (`EngineLoop.call`), between steps; a match's prompts are rendered and
tokenized off the event loop, and a text too long to fit is refused before tokenizing, as for a completion. The
event log is enabled by the first events request (which gets a snapshot), so a server nobody routes to keeps no
log.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from hybridcache.cache import CacheRequest
from hybridcache.cache.request import check_cache_salt
from hybridcache.server.engine_loop import EngineFailure, EngineLoop
from hybridcache.server.errors import APIError

EVENT_LOG_CAPACITY = 1 << 16
MAX_EVENTS_PER_POLL = 1 << 14


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

    async def events(self, request: Request, since: int | None = None, limit: int = MAX_EVENTS_PER_POLL,
                     ) -> JSONResponse:
        self.authorize(request)
        if limit < 1:
            raise APIError(400, f"limit must be >= 1, got {limit}", param="limit")
        limit = min(limit, MAX_EVENTS_PER_POLL)
        if since is not None and self.log is not None:
            try:
                batch = self.log.since(since, limit)
            except ValueError as error:
                raise APIError(400, str(error), param="since") from None
            if not batch.lost:
                return JSONResponse({**self.head, "reset": False, "next": batch.next_seq,
                                     "events": [e.to_json() for e in batch.events]})

        def snapshot(engine: Any) -> tuple[int, list]:
            cache = engine.scheduler.cache
            if self.log is None:
                log = cache.events or cache.enable_events(EVENT_LOG_CAPACITY)
                self.head = {"block_size": cache.block_size, "full_prompt_hits": cache.config.full_prompt_hits,
                             "epoch": log.epoch}
                self.log = log
            return self.log.next_seq, cache.snapshot_events()

        next_seq, events = await self._call(snapshot)
        return JSONResponse({**self.head, "reset": True, "next": next_seq,
                             "events": [e.to_json() for e in events]})

    async def match(self, request: Request) -> JSONResponse:
        self.authorize(request)
        body = await self.read_json(request)
        prompts = await self.prompt_ids(body)
        if not all(prompts):
            raise APIError(400, "a prompt is empty", param="prompt")
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
            {"prompt_tokens": len(ids), "kv_tokens": p.kv_len, "cached_tokens": p.cached_len}
            for ids, p in zip(prompts, probes)]})

    async def _call(self, fn: Callable[[Any], Any]) -> Any:
        try:
            return await self.engine_loop.call(fn)
        except EngineFailure as error:
            raise APIError(503, str(error)) from None
