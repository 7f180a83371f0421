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
