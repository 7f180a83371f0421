"""Streams through the router pass on whole events (`EventRelay`): a stream cut mid-event ends with the error event
after the last whole one (it was glued onto the half event, which no client parses), and a stream's usage is read
from its last event that carries one, however long (a Responses `response.completed` over 64 KiB was missed)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
from collections.abc import Iterator

import httpx
import pytest
from fastapi.responses import StreamingResponse

from hybridcache.router.app import EventRelay, RouterConfig, build_router_app, stream_usage
from tests.router.serving import replica_app, serving_app
from tests.router.test_faults import PROMPT, _metric

WHOLE = b'data: {"choices": [{"index": 0, "text": "a"}]}\n\n'
USAGE = {"prompt_tokens": 20, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 0}}


def _streaming_replica(pieces: list[bytes], cut: bool):
    """A replica whose completions stream `pieces`, then drop the connection (`cut`) or end."""
    app = replica_app()

    @app.post("/v1/completions")
    async def completions():
        async def events():
            for piece in pieces:
                yield piece
                await asyncio.sleep(0.02)
            if cut:
                raise RuntimeError("replica died")
        return StreamingResponse(events(), media_type="text/event-stream")

    return app


@contextlib.contextmanager
def _through_router(app) -> Iterator[tuple[str, str]]:
    """(the replica's URL, the router's) of a router in front of replica `app`."""
    config = functools.partial(RouterConfig, poll_interval_s=30.0)
    with serving_app(app) as url, serving_app(build_router_app(config((url,)), tokenizer=None)) as router:
        yield url, router


def test_a_stream_cut_mid_event_ends_with_a_parseable_error_event():
    half = b'data: {"choices": [{"index": 0, "te'
    with _through_router(_streaming_replica([WHOLE, half], cut=True)) as (_, router):
        body = {"prompt": PROMPT, "stream": True}
        with httpx.stream("POST", f"{router}/v1/completions", json=body, timeout=30) as response:
            text = response.read().decode()
    events = [e for e in text.split("\n\n") if e]
    assert events[0] == WHOLE.decode().strip() and events[-1] == "data: [DONE]"
    assert len(events) == 3, events
    error = json.loads(events[1].removeprefix("data: "))["error"]
    assert "failed mid-stream" in error["message"]


def test_the_usage_of_a_long_last_event_is_counted():
    """The usage event is 200 KB (a Responses `response.completed` holds the whole answer): its usage still
    reaches the router's counters."""
    last = f"data: {json.dumps({'choices': [], 'usage': USAGE, 'pad': 'x' * 200_000})}\n\n".encode()
    pieces = [WHOLE, last[:70_000], last[70_000:], b"data: [DONE]\n\n"]
    with _through_router(_streaming_replica(pieces, cut=False)) as (url, router):
        body = {"prompt": PROMPT, "stream": True}
        with httpx.stream("POST", f"{router}/v1/completions", json=body, timeout=30) as response:
            text = response.read()
        assert text == WHOLE + last + b"data: [DONE]\n\n"
        metrics = httpx.get(f"{router}/metrics").text
        assert _metric(metrics, "hybridcache_router_prompt_tokens_total", url) == 20


@pytest.mark.parametrize("sep", [b"\n\n", b"\r\n\r\n"], ids=["lf", "crlf"])
def test_event_relay_passes_whole_events_only(sep):
    relay = EventRelay()
    first = b'data: {"a": 1}' + sep
    second = b"event: x" + sep[:len(sep) // 2] + b'data: {"usage": {"n": 2}}' + sep
    stream = first + second + b"data: [DONE]"
    out = [relay.feed(stream[i:i + 1]) for i in range(len(stream))]  # a byte at a time: boundaries split
    assert b"".join(out) == first + second and [o for o in out if o] == [first, second]
    assert relay.rest() == b"data: [DONE]"
    assert stream_usage(relay.usage_event) == {"n": 2}


def test_event_relay_keeps_the_last_usage_object_not_a_null():
    relay = EventRelay()
    relay.feed(b'data: {"usage": {"n": 1}}\n\ndata: {"usage": null}\n\n')
    assert stream_usage(relay.usage_event) == {"n": 1}


@pytest.mark.parametrize("value", ["false", "0", None])
def test_stream_false_as_a_string_is_answered_as_json(value):
    """`"stream": "false"` (a string) is false to the replica's parser, which answers JSON: the router passes it on
    as JSON and counts its usage (it relayed it as text/event-stream, by `bool("false")`)."""
    app = replica_app()

    @app.post("/v1/completions")
    async def completions():
        return {"choices": [{"index": 0, "text": "ok"}], "usage": USAGE}

    with _through_router(app) as (url, router):
        response = httpx.post(f"{router}/v1/completions", json={"prompt": PROMPT, "stream": value}, timeout=30)
        assert response.headers["content-type"] == "application/json" and response.json()["usage"] == USAGE
        assert _metric(httpx.get(f"{router}/metrics").text, "hybridcache_router_prompt_tokens_total", url) == 20
