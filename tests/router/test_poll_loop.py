"""The router's background polls (router/app.py, router/replicas.py) against fake replicas: an answer that is no
events answer marks its replica down and nothing else (found by a bug hunt: `[]` from one replica ended the poll
loop for good, so no replica's index was updated again and a replica marked down never came back)."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from fastapi import FastAPI, Response

from hybridcache.cache.events import CacheEvent, EventKind
from hybridcache.router.app import RouterConfig, build_router_app
from hybridcache.router.replicas import Replica
from tests.router.serving import replica_app, serving_app, wait_until


def _block(i: int) -> dict:
    return CacheEvent(EventKind.BLOCK_STORED, block_hash=i + 1, parent_hash=i, depth=i + 1).to_json()


def _odd_replica() -> FastAPI:
    """A replica whose events route answers `app.state.odd` (raw bytes) while it is set, else an empty cache."""
    app = replica_app("odd")
    app.state.odd = None

    @app.middleware("http")
    async def odd_answers(request, call_next):
        if request.url.path == "/v1/cache/events" and app.state.odd is not None:
            return Response(app.state.odd, media_type="application/json")
        return await call_next(request)

    return app


ODD_ANSWERS = {"list": b"[]", "null": b"null", "string": b'"ok"',
               "huge_number": b'{"reset": true, "next": 1e999, "block_size": 16, "events": []}',
               "huge_block_size": b'{"reset": true, "next": 0, "block_size": -1e999, "events": []}',
               "deep": b"[" * 100_000 + b"]" * 100_000, "events_not_records": b'{"reset": true, "next": 0, '
               b'"block_size": 16, "events": [1, null]}'}


@pytest.mark.parametrize("odd", ODD_ANSWERS.values(), ids=ODD_ANSWERS.keys())
def test_an_answer_that_is_no_events_answer_marks_the_replica_down_and_the_next_good_one_up(odd):
    app = _odd_replica()
    app.state.events.append(_block(0))

    async def run() -> list:
        replica = Replica("http://replica")
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app)) as client:
            await replica.poll(client, 5.0)
            seen = [replica.up]
            app.state.odd = odd
            await replica.poll(client, 5.0)  # raised AttributeError / OverflowError / RecursionError
            seen += [replica.up, replica.index]
            app.state.odd = None
            await replica.poll(client, 5.0)
            return [*seen, replica.up, len(replica.index.blocks)]

    assert asyncio.run(run()) == [True, False, None, True, 1]


def test_the_poll_loop_outlives_an_odd_answer_of_one_replica():
    good, odd = replica_app(), _odd_replica()
    with serving_app(good) as a, serving_app(odd) as b:
        app = build_router_app(RouterConfig((a, b), poll_interval_s=0.05), tokenizer=None)
        with serving_app(app, "/ping"):
            state = app.state.router
            assert wait_until(lambda: all(r.up for r in state.replicas), 5.0)
            odd.state.odd = b"[]"
            assert wait_until(lambda: not state.replicas[1].up, 5.0)
            good.state.events.extend(_block(i) for i in range(5))
            odd.state.odd = None
            assert wait_until(lambda: state.replicas[0].index is not None and len(state.replicas[0].index.blocks) == 5
                              and state.replicas[1].up, 5.0)


def _big_replica(num_pages: int, page_s: float) -> FastAPI:
    """A replica whose snapshot comes in `num_pages` pages, each after `page_s`; `app.state.pages_read`."""
    app = FastAPI()
    app.state.pages_read = 0
    head = {"block_size": 16, "full_prompt_hits": False, "epoch": "big", "next": 0, "events": []}

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/cache/events")
    async def cache_events(since: int | None = None, cursor: str | None = None):
        if cursor is None:
            return {**head, "reset": since is None, **({"cursor": "1"} if since is None else {})}
        await asyncio.sleep(page_s)
        app.state.pages_read += 1
        return {**head, "reset": False, **({"cursor": str(int(cursor) + 1)} if int(cursor) + 1 < num_pages else {})}

    return app


def _blipping_replica() -> FastAPI:
    """An empty replica whose next `app.state.fail` events polls answer 500."""
    app = replica_app("small")
    app.state.fail = 0

    @app.middleware("http")
    async def blip(request, call_next):
        if request.url.path == "/v1/cache/events" and app.state.fail:
            app.state.fail -= 1
            return Response(b"{}", status_code=500, media_type="application/json")
        return await call_next(request)

    return app


def test_a_large_snapshot_holds_up_neither_the_start_nor_another_replicas_polls():
    """Found by a bug hunt: the background loop polled all replicas together and waited for the slowest, and the
    start waited for every first poll, so a big replica's snapshot (8 pages of 1 s) held the start up for 7 s and
    kept a small replica down for 8 s after one failed poll. Each replica now has a loop of its own, and the start
    waits for the first polls at most the poll timeout."""
    num_pages, page_s = 10, 0.3
    big, small = _big_replica(num_pages, page_s), _blipping_replica()
    with serving_app(big) as a, serving_app(small) as b:
        app = build_router_app(RouterConfig((a, b), poll_interval_s=0.05, poll_timeout_s=0.6), tokenizer=None)
        with serving_app(app, "/ping"):
            started_at_page = big.state.pages_read
            big_replica, small_replica = app.state.router.replicas
            assert small_replica.up and not big_replica.up
            small.state.fail = 1  # a blip: down until its next poll, 0.05 s later
            assert wait_until(lambda: not small_replica.up, 2.0)
            assert wait_until(lambda: small_replica.up, 2.0)
            back_at_page = big.state.pages_read
    assert started_at_page <= 3 and back_at_page < num_pages - 1  # was: both after the big snapshot's last page


def test_a_poll_loop_survives_an_error_of_any_kind(monkeypatch):
    poll, failures = Replica.poll, [RuntimeError("a bug"), AttributeError("another")]

    async def failing_poll(self, *args, **kwargs):
        if failures:
            raise failures.pop()
        await poll(self, *args, **kwargs)

    monkeypatch.setattr(Replica, "poll", failing_poll)
    with serving_app(replica_app()) as a:
        app = build_router_app(RouterConfig((a,), poll_interval_s=0.05), tokenizer=None)
        with serving_app(app, "/ping"):
            assert wait_until(lambda: app.state.router.replicas[0].up, 3.0) and not failures
