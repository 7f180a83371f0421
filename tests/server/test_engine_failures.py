"""The engine thread ending on something that is not an Exception (a SystemExit from a library inside the forward,
hunt 135): it used to end silently, leaving the running request's handler waiting forever and /health at 503 with
no `last_error`. Now every request and every command waiting for the thread gets an EngineFailure, and the loop
reports unhealthy with the error."""

from __future__ import annotations

import asyncio

import pytest

from hybridcache.config import EngineConfig
from hybridcache.engine.engine import LLMEngine
from hybridcache.sampling import SamplingParams
from hybridcache.server.engine_loop import EngineFailure, EngineLoop

PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
# the thread does end on the error, re-raised once reported: pytest notes it
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")


def _engine_loop() -> EngineLoop:
    return EngineLoop(LLMEngine(None, EngineConfig(block_size=16, max_model_len=1024, num_blocks=256)))


async def _take(sink: asyncio.Queue):
    """The last item of a request's queue (outputs replace one another; an error is the last item)."""
    while True:
        item = await asyncio.wait_for(sink.get(), timeout=60)
        if isinstance(item, Exception) or item.finished:
            return item


def test_a_system_exit_in_a_step_fails_the_running_request_and_reports_unhealthy(monkeypatch):
    loop_engine = _engine_loop()
    runner = loop_engine.engine.runner
    original = runner.execute
    broken = []

    def execute(*args, **kwargs):
        if broken:
            raise SystemExit("injected: sys.exit() inside the forward")
        return original(*args, **kwargs)

    monkeypatch.setattr(runner, "execute", execute)

    async def main() -> None:
        loop_engine.start()
        try:
            assert (await _take(await loop_engine.add("ok", "hello world", PARAMS))).finished
            broken.append(1)
            failed = await _take(await loop_engine.add("running", "hello world", PARAMS))
            assert isinstance(failed, EngineFailure) and "injected" in str(failed)
            assert not loop_engine.healthy and "SystemExit" in loop_engine.last_error
            assert not loop_engine.running
            for later in (lambda: loop_engine.add("later", "hello", PARAMS), loop_engine.check,
                          lambda: loop_engine.call(lambda engine: None)):
                with pytest.raises(EngineFailure):
                    await asyncio.wait_for(later(), timeout=10)
        finally:
            await asyncio.to_thread(loop_engine.stop)

    asyncio.run(main())


def test_a_command_that_ends_the_thread_gets_an_answer():
    """A SystemExit in a command between steps (here a `call`): its caller, and the commands queued behind it, get
    an EngineFailure instead of waiting forever."""
    loop_engine = _engine_loop()

    def exits(engine):
        raise SystemExit("injected")

    async def main() -> None:
        loop_engine.start()
        try:
            first = asyncio.ensure_future(loop_engine.call(exits))
            behind = asyncio.ensure_future(loop_engine.call(lambda engine: engine.stats()))
            with pytest.raises(EngineFailure, match="SystemExit"):
                await asyncio.wait_for(first, timeout=10)
            with pytest.raises(EngineFailure):  # (refused, or "not running" if the thread ended before its put)
                await asyncio.wait_for(behind, timeout=10)
            assert not loop_engine.healthy and not loop_engine.running
        finally:
            await asyncio.to_thread(loop_engine.stop)

    asyncio.run(main())


def test_a_failed_step_reports_the_dead_engine_once_and_the_debug_route_answers_503(monkeypatch, caplog):
    """An Exception in a committed step kills the engine (docs/server.md): the loop used to log a second
    traceback calling the dead engine "inconsistent", and /debug/engine answered a generic 500."""
    import httpx

    from hybridcache.models.builtin import BUILTIN_NAME

    from .inprocess_server import serving

    broken = []
    original = LLMEngine._step

    def step(self, *args, **kwargs):
        if broken:
            raise RuntimeError("injected: a kernel failed")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(LLMEngine, "_step", step)
    with serving(enable_debug_endpoints=True) as base_url, httpx.Client(base_url=base_url, timeout=60) as client:
        body = {"model": BUILTIN_NAME, "prompt": "hello", "max_tokens": 4}
        assert client.post("/v1/completions", json=body).status_code == 200
        broken.append(1)
        assert client.post("/v1/completions", json=body).status_code == 500
        response = client.get("/debug/engine")
        assert response.status_code == 503 and "injected" in response.json()["error"]["message"]
        assert client.get("/health").status_code == 503
    assert not [r for r in caplog.records if "inconsistent" in r.getMessage()]
