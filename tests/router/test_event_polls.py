"""How the router reads a replica's cache events (router/replicas.py, server/cache_routes.py): polls of one replica
coalesce (K callers together wait for at most two polls, and no event is applied twice); a snapshot comes in pages,
encoded on the replica off its event loop and built into a new index off the router's, which replaces the old one
only once complete (found by a bug hunt: 64 responses finishing together waited for 64 polls in a row, 2.0 s median
through the router for 1.1 s direct; a 300,000-block snapshot took longer than the 2 s poll timeout to build, so its
replica never came back up, and parsing a 150,000-block one froze every stream through the router for 1.6 s)."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from hybridcache.cache.events import CacheEvent, CacheEventLog, EventKind
from hybridcache.router import replicas
from hybridcache.router.index import ReplicaIndex
from hybridcache.router.replicas import Replica
from hybridcache.server.cache_routes import MAX_EVENTS_PER_POLL, MAX_HELD_SNAPSHOTS, CacheRoutes
from hybridcache.server.errors import APIError


def _checkpoint(i: int) -> CacheEvent:
    return CacheEvent(EventKind.CHECKPOINT_STORED, anchor_hash=i + 1, step=i % 50 + 1, tail_hash=i + 7)


def _block(i: int) -> CacheEvent:
    return CacheEvent(EventKind.BLOCK_STORED, block_hash=i + 1, parent_hash=i, depth=i + 1)


def _slow_replica(rtt_s: float) -> FastAPI:
    """A fake replica whose events answers take `rtt_s`; `app.state.events` (checkpoints: applying one twice
    counts it twice), `app.state.polls` the answers it gave, `app.state.max_concurrent` the most at a time."""
    app = FastAPI()
    app.state.events, app.state.polls, app.state.running, app.state.max_concurrent = [], 0, 0, 0

    @app.get("/v1/cache/events")
    async def cache_events(since: int | None = None):
        app.state.running += 1
        app.state.max_concurrent = max(app.state.max_concurrent, app.state.running)
        upto = len(app.state.events)  # what the cache holds when the request arrives
        await asyncio.sleep(rtt_s)
        app.state.running -= 1
        app.state.polls += 1
        return {"block_size": 16, "full_prompt_hits": False, "reset": since is None, "next": upto,
                "events": [e.to_json() for e in app.state.events[since or 0:upto]], "epoch": "e"}

    return app


def test_polls_of_one_replica_coalesce_and_apply_each_event_once():
    app = _slow_replica(rtt_s=0.05)

    async def run() -> tuple[Replica, list[int]]:
        replica = Replica("http://replica")
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app)) as client:
            await replica.poll(client, 5.0)  # the snapshot
            app.state.polls = 0

            async def respond_then_poll(i: int) -> int:
                app.state.events.append(_checkpoint(i))  # this response's checkpoint, stored before the poll
                await replica.poll(client, 5.0)
                return replica.index.num_checkpoints - (i + 1)  # >= 0: the poll saw this response's event

            return replica, await asyncio.gather(*(respond_then_poll(i) for i in range(32)))

    replica, missing = asyncio.run(run())
    assert min(missing) >= 0  # each caller's poll started after its event was stored
    assert app.state.polls <= 2 and app.state.max_concurrent == 1  # was 32 polls, one after another
    assert replica.index.num_checkpoints == 32 and replica.next_seq == 32  # none applied twice


def test_a_poll_called_while_one_runs_waits_for_the_next_one():
    """The running poll may have been answered before the caller's events were stored: the caller waits for a poll
    that starts after its call, and the callers after it share that one."""
    app = _slow_replica(rtt_s=0.1)

    async def run() -> list[int]:
        replica = Replica("http://replica")
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app)) as client:
            await replica.poll(client, 5.0)
            app.state.polls = 0
            running = asyncio.ensure_future(replica.poll(client, 5.0))
            await asyncio.sleep(0.05)  # the first poll's answer is taken (0 events), not yet sent
            app.state.events.append(_checkpoint(0))
            late = [asyncio.ensure_future(replica.poll(client, 5.0)) for _ in range(5)]
            await running
            seen_by_first = replica.index.num_checkpoints
            await asyncio.gather(*late)
            return [seen_by_first, replica.index.num_checkpoints, app.state.polls]

    assert asyncio.run(run()) == [0, 1, 2]


def _served_cache(events: list[CacheEvent], threads: set[str]) -> tuple[FastAPI, CacheRoutes]:
    """A replica app serving CacheRoutes over a fake engine whose cache holds `events`; the names of the threads
    that encode them go into `threads`."""

    class Recorded(CacheEvent):
        def to_json(self) -> dict:
            threads.add(threading.current_thread().name)
            return super().to_json()

    stored = [Recorded(**{**e.to_json(), "kind": e.kind}) for e in events]
    app = FastAPI()
    app.state.num_snapshots = 0  # snapshots taken (each a walk of the whole cache on the engine thread)

    def snapshot_events() -> list[CacheEvent]:
        app.state.num_snapshots += 1
        return list(stored)

    cache = SimpleNamespace(events=None, block_size=16, config=SimpleNamespace(full_prompt_hits=False),
                            snapshot_events=snapshot_events)
    cache.enable_events = lambda capacity: setattr(cache, "events", CacheEventLog(capacity)) or cache.events
    engine = SimpleNamespace(scheduler=SimpleNamespace(cache=cache))

    class EngineLoop:
        async def call(self, fn):
            return fn(engine)

    async def no_body(request):
        return None

    routes = CacheRoutes(EngineLoop(), lambda request: None, no_body, no_body)

    @app.exception_handler(APIError)  # as server/app.py
    async def api_error(request, error: APIError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    app.add_api_route("/v1/cache/events", routes.events, methods=["GET"])
    return app, routes


def test_a_large_snapshot_comes_in_pages_encoded_and_applied_off_the_event_loops(monkeypatch):
    num_blocks = 2 * MAX_EVENTS_PER_POLL + 100
    encoders: set[str] = set()
    app, routes = _served_cache([_block(i) for i in range(num_blocks)], encoders)
    asked, applied = [], []
    apply = ReplicaIndex.apply

    def recorded_apply(index, events):
        events = list(events)
        applied.append((threading.current_thread().name, len(events)))
        apply(index, events)

    monkeypatch.setattr(ReplicaIndex, "apply", recorded_apply)

    async def run() -> tuple[Replica, str]:
        replica = Replica("http://replica")
        loop_thread = threading.current_thread().name

        async def record(request: httpx.Request) -> None:
            asked.append(dict(request.url.params))

        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, event_hooks={"request": [record]}) as client:
            await replica.poll(client, 5.0)
            assert replica.up and len(replica.index.blocks) == num_blocks
            routes.log.emit(_block(num_blocks))  # the cache stores one more block: the next poll reads it
            await replica.poll(client, 5.0)
        return replica, loop_thread

    replica, loop_thread = asyncio.run(run())
    assert len(replica.index.blocks) == num_blocks + 1 and replica.next_seq == 1
    assert [set(params) for params in asked] == [{"paged"}, {"cursor"}, {"cursor"}, {"since", "paged"}]
    assert routes.snapshots == {}  # read to its end: no longer held
    assert encoders and loop_thread not in encoders
    snapshot_pages, the_next_poll = applied[:-1], applied[-1]
    assert [n for _, n in snapshot_pages] == [MAX_EVENTS_PER_POLL, MAX_EVENTS_PER_POLL, 100]
    assert loop_thread not in {thread for thread, _ in snapshot_pages}  # a new index: built on a thread
    assert the_next_poll == (loop_thread, 1)  # the index in use: changed on the event loop, between predictions


def test_a_snapshot_replaces_the_index_only_once_its_last_page_is_read():
    """A replica whose snapshot pages stop answering keeps no half-built index: it stays down, predicting nothing,
    and the next poll takes a new snapshot."""
    app, routes = _served_cache([_block(i) for i in range(MAX_EVENTS_PER_POLL + 1)], set())
    failing = {"on": True}

    async def cut_pages(request: httpx.Request) -> None:
        if failing["on"] and "cursor" in request.url.params:
            raise httpx.ConnectError("replica gone", request=request)

    async def run() -> list:
        replica = Replica("http://replica")
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     event_hooks={"request": [cut_pages]}) as client:
            await replica.poll(client, 5.0)
            seen = [replica.up, replica.index]
            failing["on"] = False
            await replica.poll(client, 5.0)
            return [*seen, replica.up, len(replica.index.blocks)]

    assert asyncio.run(run()) == [False, None, True, MAX_EVENTS_PER_POLL + 1]
    assert len(routes.snapshots) <= 1  # the abandoned one is held until it goes stale or unread (10 s)


class _SmallPages(httpx.AsyncBaseTransport):
    """`inner` asked for pages of `limit` events; counts the answers by status in `statuses`."""

    def __init__(self, inner: httpx.AsyncBaseTransport, limit: int) -> None:
        self.inner, self.limit, self.statuses = inner, limit, {}

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        request.url = request.url.copy_merge_params({"limit": str(self.limit)})
        response = await self.inner.handle_async_request(request)
        self.statuses[response.status_code] = self.statuses.get(response.status_code, 0) + 1
        return response


def test_routers_reading_snapshots_together_do_not_evict_each_other():
    """Eight routers reading a multi-page snapshot of one healthy replica together (found by a bug hunt: a fifth
    reader's snapshot evicted the oldest one being read, whose next page got a 409 that marked the replica down; 8
    routers polling for 20 s saw it up 0% of the time and made it walk its cache 116 times). Now a reader past the
    cap gets 503 with Retry-After before a snapshot is taken, which its router reads as "at the next poll"."""
    num_readers = 2 * MAX_HELD_SNAPSHOTS
    app, routes = _served_cache([_block(i) for i in range(100)], set())

    async def run() -> tuple[list[Replica], int, _SmallPages]:
        transport = _SmallPages(httpx.ASGITransport(app=app), limit=10)
        readers = [Replica("http://replica") for _ in range(num_readers)]
        async with httpx.AsyncClient(transport=transport) as client:

            async def poll_until_up(replica: Replica) -> int:
                for polls in range(1, 51):
                    await replica.poll(client, 5.0)
                    if replica.up:
                        return polls
                    await asyncio.sleep(0.01)
                return 0

            polls = await asyncio.gather(*(poll_until_up(r) for r in readers))
            return readers, min(polls), transport

    readers, fewest_polls, transport = asyncio.run(run())
    assert fewest_polls > 0 and all(r.up and len(r.index.blocks) == 100 for r in readers)
    assert 409 not in transport.statuses and transport.statuses[503] >= 1  # some waited their turn
    assert app.state.num_snapshots == num_readers and routes.snapshots == {}  # one walk each, none left held


def test_a_single_page_or_unpaged_snapshot_is_never_held():
    """Only a reader with pages to come holds a snapshot: the unpaged ones (the Ray replicas' pushes) and single
    pages took room under the cap (and were dropped from it at once)."""
    app, routes = _served_cache([_block(i) for i in range(30)], set())

    async def run() -> list[int]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://r") as client:
            for _ in range(2 * MAX_HELD_SNAPSHOTS):
                assert (await client.get("/v1/cache/events")).status_code == 200
                assert (await client.get("/v1/cache/events", params={"paged": "true"})).status_code == 200
            held = len(routes.snapshots)
            pages = [await client.get("/v1/cache/events", params={"paged": "true", "limit": 10})
                     for _ in range(MAX_HELD_SNAPSHOTS + 1)]
            taken = app.state.num_snapshots
            return [held, *(p.status_code for p in pages), int(pages[-1].headers["retry-after"]) > 0,
                    app.state.num_snapshots - taken]

    assert asyncio.run(run()) == [0, *[200] * MAX_HELD_SNAPSHOTS, 503, True, 0]  # refused before taking one


@pytest.mark.parametrize("status,headers,stays_up", [(409, {}, True), (503, {"Retry-After": "1"}, True),
                                                     (503, {}, False), (500, {}, False)],
                         ids=["snapshot_gone", "busy_retry_after", "503_down", "500_down"])
def test_an_events_answer_to_ask_later_keeps_the_replica_up(status, headers, stays_up):
    app = FastAPI()
    answer = {"status": 200}

    @app.get("/v1/cache/events")
    async def cache_events(since: int | None = None):
        if answer["status"] != 200:
            return JSONResponse({"error": {"message": "later", "code": None}}, status_code=status, headers=headers)
        return {"block_size": 16, "full_prompt_hits": False, "reset": since is None, "next": 1,
                "events": [] if since is not None else [_block(0).to_json()], "epoch": "e"}

    async def run() -> tuple[bool, bool]:
        replica = Replica("http://replica")
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app)) as client:
            await replica.poll(client, 5.0)
            answer["status"] = status
            await replica.poll(client, 5.0)
            return replica.up, replica.index is not None and len(replica.index.blocks) == 1

    assert asyncio.run(run()) == (stays_up, stays_up)


def test_an_unpaged_reader_still_gets_the_whole_snapshot_and_apply_refuses_a_page():
    """A reader that does not ask for pages (the Ray replicas' pushes to FleetIndex) gets the whole snapshot in one
    answer, as before; `Replica.apply` of a page (it has a cursor) raises instead of indexing part of it."""
    app, _ = _served_cache([_block(i) for i in range(MAX_EVENTS_PER_POLL + 1)], set())

    async def run() -> tuple[dict, dict]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://r") as client:
            whole = (await client.get("/v1/cache/events")).json()
            page = (await client.get("/v1/cache/events", params={"paged": "true"})).json()
        return whole, page

    whole, page = asyncio.run(run())
    assert whole["reset"] and len(whole["events"]) == MAX_EVENTS_PER_POLL + 1 and "cursor" not in whole
    assert len(page["events"]) == MAX_EVENTS_PER_POLL and page["cursor"]
    replica = Replica("r")
    with pytest.raises(ValueError, match="page"):
        replica.apply(page)
    assert replica.index is None and not replica.up
    replica.apply(whole)
    assert replica.up and len(replica.index.blocks) == MAX_EVENTS_PER_POLL + 1


def test_a_large_answer_is_parsed_off_the_event_loop(monkeypatch):
    parsers = []
    decode = replicas.EventsAnswer.decode.__func__

    def recorded_decode(cls, content):
        parsers.append((threading.current_thread().name, len(content)))
        return decode(cls, content)

    monkeypatch.setattr(replicas.EventsAnswer, "decode", classmethod(recorded_decode))
    app, _ = _served_cache([_block(i) for i in range(5000)], set())

    async def run() -> str:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app)) as client:
            await Replica("http://replica").poll(client, 5.0)
        return threading.current_thread().name

    loop_thread = asyncio.run(run())
    assert [size > replicas.INLINE_PARSE_BYTES for _, size in parsers] == [True]
    assert parsers[0][0] != loop_thread


def test_an_event_written_and_read_back_is_the_same_event():
    from dataclasses import asdict, fields

    for event in (_block(3), _checkpoint(4), CacheEvent(EventKind.BLOCK_STORED, 5, 6, 7, adapter="lora-a"),
                  CacheEvent(EventKind.CHECKPOINT_REMOVED, anchor_hash=2**64 - 1, step=9, tail_hash=3)):
        record = event.to_json()
        assert record == {**asdict(event), "kind": event.kind.value} and list(record) == [f.name for f in fields(event)]
        assert CacheEvent.from_json(record) == event


def test_an_index_of_chains_holds_nothing_the_garbage_collector_walks_per_block():
    """A block's only child is kept as an int, a set only where a block has several: a 300,000-block snapshot
    made 300,000 sets, and every full collection while they were built paused the router's streams."""
    import gc
    import random

    chain = ReplicaIndex(16)
    chain.apply(_block(i) for i in range(1000))
    assert not any(gc.is_tracked(kids) for kids in chain.children.values())
    rng, index, reference = random.Random(0), ReplicaIndex(16), {}  # reference: parent -> set of children
    stored: list[tuple[int, int]] = []
    for step in range(3000):
        if stored and rng.random() < 0.4:
            block, parent = stored.pop(rng.randrange(len(stored)))
            index.apply([CacheEvent(EventKind.BLOCK_REMOVED, block_hash=block)])
            reference[parent].discard(block)
        else:
            parent = rng.choice([0] + [b for b, _ in stored[-20:]])
            block = 10_000 + step
            index.apply([CacheEvent(EventKind.BLOCK_STORED, block_hash=block, parent_hash=parent, depth=1)])
            reference.setdefault(parent, set()).add(block)
            stored.append((block, parent))
        seen = {p: kids if isinstance(kids, set) else {kids} for p, kids in index.children.items()}
        assert seen == {p: kids for p, kids in reference.items() if kids}
        assert all(len(kids) > 1 for kids in index.children.values() if isinstance(kids, set))
