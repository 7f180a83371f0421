"""The app called as uvicorn calls it, without a socket: a request cut short by the shutdown (uvicorn cancels the
tasks still running when its grace period ends) gets a 503 error object on every route, and a large chat body
is decoded, validated and rendered off the event loop."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json

import pytest

from hybridcache.config import EngineConfig
from hybridcache.engine.engine import LLMEngine, freeze_gc_heap
from hybridcache.server.app import ServedModel, build_app
from hybridcache.server.config import ServerConfig
from hybridcache.server.engine_loop import EngineLoop
from hybridcache.server.metrics import ServerMetrics


def _app(tokenizer, engine_loop: EngineLoop | None, max_model_len: int = 1024):
    return build_app(engine_loop, ServedModel(tokenizer=tokenizer, max_model_len=max_model_len), ServerConfig(),
                     ServerMetrics())


class _Call:
    """One HTTP request to an ASGI `app` on a task of the running loop: the body arrives as `body_parts` (then
    the client waits, connected); `sent` collects what the app sends."""

    def __init__(self, app, path: str, body_parts: list[bytes], content_length: int) -> None:
        self.sent: list[dict] = []
        self._parts = list(body_parts)
        self._received, self._length = 0, content_length
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                 "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
                 "headers": [(b"content-type", b"application/json"),
                             (b"content-length", str(content_length).encode())],
                 "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 8000), "state": {}}
        self.task = asyncio.ensure_future(app(scope, self._receive, self._send))

    async def _receive(self) -> dict:
        if self._parts:
            part = self._parts.pop(0)
            self._received += len(part)
            return {"type": "http.request", "body": part, "more_body": self._received < self._length}
        await asyncio.Event().wait()  # the rest of the body (or the disconnect) never comes
        raise AssertionError("unreachable")

    async def _send(self, message: dict) -> None:
        self.sent.append(message)

    async def cancelled(self) -> tuple[int, dict]:
        """Cancel the request as uvicorn does at the end of its grace period; the status and JSON body sent."""
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task
        starts = [m for m in self.sent if m["type"] == "http.response.start"]
        assert starts, "no response was sent: uvicorn answers a bare 500 and logs the CancelledError"
        body = b"".join(m.get("body", b"") for m in self.sent if m["type"] == "http.response.body")
        headers = dict(starts[0]["headers"])
        assert headers[b"content-type"] == b"application/json"
        return starts[0]["status"], json.loads(body)


def _engine_loop() -> EngineLoop:
    return EngineLoop(LLMEngine(None, EngineConfig(block_size=16, max_model_len=1024, num_blocks=256)))


def test_a_request_whose_body_is_still_arriving_at_shutdown_gets_a_503_error_object(tokenizer):
    body = json.dumps({"prompt": "slow upload", "max_tokens": 5}).encode()

    async def main() -> tuple[int, dict]:
        call = _Call(_app(tokenizer, None), "/v1/completions", [body[:10]], len(body))
        await asyncio.sleep(0.05)  # reading the body
        assert not call.task.done()
        return await call.cancelled()

    status, error = asyncio.run(main())
    assert status == 503
    assert error["error"]["type"] == "service_unavailable" and "shut down" in error["error"]["message"]


@pytest.mark.parametrize("path, body", [
    ("/v1/responses", {"input": "hi", "max_output_tokens": 500}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 500}),
], ids=["responses", "chat"])
def test_a_non_streaming_request_still_generating_at_shutdown_gets_a_503_error_object(tokenizer, path, body):
    """/v1/responses used to let the CancelledError out (a bare 500, a traceback in the log) where chat
    answered 503; both now get the one answer, from `ShutdownGuard`."""
    raw = json.dumps({**body, "temperature": 0, "ignore_eos": True}).encode()
    loop_engine = _engine_loop()

    async def main() -> tuple[int, dict]:
        loop_engine.start()
        try:
            call = _Call(_app(tokenizer, loop_engine), path, [raw], len(raw))
            for _ in range(500):  # until the engine runs it
                await asyncio.sleep(0.01)
                if loop_engine.state.num_running:
                    break
            assert loop_engine.state.num_running == 1 and not call.task.done()
            answer = await call.cancelled()
            for _ in range(500):  # and the engine aborted it
                if not loop_engine.state.num_running:
                    break
                await asyncio.sleep(0.01)
            assert loop_engine.state.num_running == 0
            return answer
        finally:
            await asyncio.to_thread(loop_engine.stop)

    status, error = asyncio.run(main())
    assert status == 503 and "shut down" in error["error"]["message"]


def test_a_large_chat_body_is_validated_and_rendered_off_the_event_loop(tokenizer):
    """One chat request of many short messages (8.6 MB, 230,000 messages) held the event loop for 7 s while its
    body was validated and its messages rendered: every other stream stalled and /health did not answer. Now
    that work runs on the tokenizer threads, pydantic a slice of messages at a time (it holds the GIL per call),
    so the loop keeps running; measured here on 20,000 messages, refused in the end as too long."""
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": "hi"} for i in range(20_000)]
    raw = json.dumps({"messages": [*messages, {"role": "user", "content": "x"}], "max_tokens": 1}).encode()

    async def main() -> tuple[float, float, tuple[int, dict]]:
        loop = asyncio.get_running_loop()
        call = _Call(_app(tokenizer, None, max_model_len=256), "/v1/chat/completions", [raw], len(raw))
        started, longest = loop.time(), 0.0
        while not call.task.done():
            tick = loop.time()
            await asyncio.sleep(0.002)
            longest = max(longest, loop.time() - tick)
        await call.task
        status = call.sent[0]["status"]
        return loop.time() - started, longest, (status, json.loads(call.sent[1]["body"]))

    freeze_gc_heap()  # as the server's start-up does: a full collection no longer walks the test process's heap
    try:
        took, longest_gap, (status, error) = asyncio.run(main())
    finally:
        gc.unfreeze()
    assert status == 400 and error["error"]["code"] == "context_length_exceeded"
    # before: one stretch of validation and rendering held the loop for nearly the whole request
    assert longest_gap < 0.25 * took, (longest_gap, took)


def test_a_handler_that_stops_reading_holds_one_output_and_its_request_still_times_out():
    """A stream whose client stops reading blocks its handler in the write, so nothing takes the request's outputs
    off its queue: the engine queued every step's output (each holding all text and token ids so far: +669 MB for
    one n = 8 stream in a bug hunt), and the server's --request-timeout, checked only by the blocked handler,
    never aborted it (it ran 55 s past a 20 s timeout). Now an output replaces those not yet taken, as vLLM's
    RequestOutputCollector does, and the engine thread aborts a request past its deadline itself."""
    from hybridcache.sampling import SamplingParams
    from hybridcache.server.limits import RequestTimeout

    loop_engine = EngineLoop(LLMEngine(None, EngineConfig(block_size=16, max_model_len=1024, num_blocks=256)),
                             request_timeout_s=1.0)

    async def main() -> None:
        loop_engine.start()
        try:
            params = SamplingParams(temperature=0, max_tokens=900, ignore_eos=True, n=2)
            sink = await loop_engine.add("r", "a stalled stream", params)
            most = 0
            for _ in range(150):  # the handler never reads; the engine steps on
                await asyncio.sleep(0.02)
                most = max(most, sink.qsize())
                if not loop_engine.state.num_running and not sink.empty():
                    break
            assert loop_engine.state.num_running == 0  # aborted, not run to its 900 tokens
            assert most == 1 and sink.qsize() == 1
            assert isinstance(sink.get_nowait(), RequestTimeout)
            await loop_engine.check()  # the engine and its cache are intact
        finally:
            await asyncio.to_thread(loop_engine.stop)

    asyncio.run(main())


def test_a_slow_handler_gets_the_outputs_it_missed_added_up():
    """Streamed requests get DELTA outputs (what is new); a handler that reads late gets the ones it missed added
    up into one (`_put_latest`), and what it reads adds up to what the same request not streamed ends with:
    text, token ids, logprobs."""
    from hybridcache.sampling import SamplingParams
    from hybridcache.server.app import request_outputs
    from hybridcache.server.responses import Rendering

    loop_engine = EngineLoop(LLMEngine(None, EngineConfig(block_size=16, max_model_len=1024, num_blocks=256)))
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=60, ignore_eos=True, n=2, logprobs=1)

    async def main() -> tuple:
        loop_engine.start()
        try:
            whole = await (await loop_engine.add("whole", "a slow reader", params, final_only=True)).get()
            await loop_engine.check(clear_cache=True)  # the same cache state (logprobs equal to the bit)
            sink = await loop_engine.add("streamed", "a slow reader", params)
            seen = []
            async for output in request_outputs(sink, Rendering()):
                seen.append(output)
                if len(seen) == 2:
                    await asyncio.sleep(0.3)  # the engine steps on: the queue adds up what comes meanwhile
            await loop_engine.check()
            return whole, seen[-1], len(seen)
        finally:
            await asyncio.to_thread(loop_engine.stop)

    whole, streamed, items = asyncio.run(main())
    assert whole.finished and streamed.finished and items < 60
    for got, want in zip(streamed.outputs, whole.outputs, strict=True):
        assert (got.text, got.token_ids, got.finish_reason) == (want.text, want.token_ids, "length")
        assert got.logprobs == want.logprobs and len(got.token_ids) == 60
