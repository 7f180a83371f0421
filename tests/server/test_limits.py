"""The server's limits in process (issue 26): the warning filter, the empty API key, the prompt size bound, the
sequences cap, tokenizing off the event loop, and a batch queued whole (one engine step, one queue check)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import random

import pytest

from hybridcache.config import EngineConfig
from hybridcache.engine.engine import LLMEngine
from hybridcache.sampling import SamplingParams
from hybridcache.server.app import ServedModel, _Routes, request_outputs
from hybridcache.server.cli import api_keys
from hybridcache.server.config import ServerConfig
from hybridcache.server.engine_loop import EngineLoop
from hybridcache.server.errors import APIError
from hybridcache.server.limits import (
    QueueFull,
    ServerLimits,
    check_prompt_bytes,
    check_sequences,
    max_token_bytes,
)
from hybridcache.server.log_limits import RateLimitFilter
from hybridcache.server.responses import Rendering
from tests.server.conftest import ThreadRecordingTokenizer


def _record(msg: str, *args: object, level: int = logging.WARNING, name: str = "x") -> logging.LogRecord:
    return logging.LogRecord(name, level, __file__, 1, msg, args, None)


def test_rate_limit_filter_passes_a_burst_per_kind_then_counts_the_dropped(caplog):
    now = [0.0]
    limiter = RateLimitFilter(interval_s=10, burst=3, clock=lambda: now[0], schedule=lambda delay, callback: None)
    passed = [limiter.filter(_record("closed connection %d", i)) for i in range(100)]
    assert passed == [True] * 3 + [False] * 97  # one kind: the format string, whatever the arguments
    assert limiter.filter(_record("another kind %s", "a"))
    assert limiter.filter(_record("closed connection %d", 1, level=logging.INFO))  # below WARNING: untouched
    now[0] = 10.0
    record = _record("closed connection %d", 100)
    with caplog.at_level(logging.WARNING, logger="x"):
        assert limiter.filter(record)  # the count comes first, in a record of its own (tests/server/test_logs_*)
    assert record.getMessage() == "closed connection 100"
    assert [r.getMessage().split(" since ")[0] for r in caplog.records] == [
        "97 more warnings like 'closed connection %d' not logged"]
    assert limiter.filter(_record("closed connection %d", 101))


@pytest.mark.parametrize("flag, env", [("", None), (None, ""), ("  ", "")])
def test_an_empty_api_key_warns(monkeypatch, caplog, flag, env):
    if env is None:
        monkeypatch.delenv("HYBRIDCACHE_API_KEY", raising=False)
    else:
        monkeypatch.setenv("HYBRIDCACHE_API_KEY", env)
    with caplog.at_level(logging.WARNING, logger="hybridcache.server"):
        assert api_keys(argparse.Namespace(api_key=flag)) == ()
    assert any("WITHOUT an API key" in r.getMessage() for r in caplog.records)


def test_a_key_given_or_absent_does_not_warn(monkeypatch, caplog):
    monkeypatch.setenv("HYBRIDCACHE_API_KEY", "from-env")
    with caplog.at_level(logging.WARNING, logger="hybridcache.server"):
        assert api_keys(argparse.Namespace(api_key="")) == ("from-env",)  # the environment's key still holds
        assert api_keys(argparse.Namespace(api_key="k")) == ("k",)
        monkeypatch.delenv("HYBRIDCACHE_API_KEY")
        assert api_keys(argparse.Namespace(api_key=None)) == ()  # no key asked for: nothing to warn about
    assert not caplog.records


def test_the_prompt_size_bound_never_refuses_a_prompt_that_fits(tokenizer):
    """The bound is max_model_len x the longest token's bytes: a text over it has at least max_model_len tokens,
    so refusing it unread is safe. Random texts (special tokens, multi-byte characters) confirm the bound."""
    per_token = max_token_bytes(tokenizer)
    assert per_token >= max(len(t.encode()) for t in ("<|im_start|>", "<|im_end|>"))
    rng = random.Random(0)
    alphabet = ["a", " ", "é", "中", "🙂", "<|im_end|>", "<|im_start|>", "\n"]
    for _ in range(200):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 300)))
        assert len(tokenizer.encode(text)) * per_token >= len(text.encode())
    max_model_len = 64
    limit = max_model_len * per_token
    fits = "<|im_end|>" * (max_model_len - 1)
    check_prompt_bytes([fits], limit, max_model_len, "prompt")  # 63 tokens: not refused
    with pytest.raises(APIError) as info:
        check_prompt_bytes(["ok", [1, 2], "x" * (limit + 1)], limit, max_model_len, "prompt")
    assert info.value.param == "prompt.2" and info.value.code == "context_length_exceeded"
    check_prompt_bytes(["x" * (limit + 1)], None, max_model_len, "prompt")  # no bound: no check


def test_a_request_holds_at_most_max_request_sequences():
    limits = ServerLimits(max_request_sequences=100, max_queued_requests=40)
    check_sequences(20, 2, limits)
    with pytest.raises(APIError, match="at most 40") as info:  # more than could ever be queued
        check_sequences(41, 1, limits)
    assert info.value.param == "prompt"
    with pytest.raises(APIError, match="at most 100"):
        check_sequences(51, 2, ServerLimits(max_request_sequences=100))
    with pytest.raises(ValueError, match="max_queued_requests"):
        ServerLimits(max_queued_requests=0)


def test_prompts_are_tokenized_off_the_event_loop(tokenizer):
    recording = ThreadRecordingTokenizer(tokenizer)
    threads = recording.threads
    routes = _Routes(None, ServedModel(tokenizer=recording, max_model_len=64), ServerConfig(), None)
    ids = asyncio.run(routes._encode(["hello", [5, 6]]))
    assert ids == [tokenizer.encode("hello"), [5, 6]]
    assert threads[0] == "MainThread"  # the warm-up call, once, when the routes are made
    assert threads[1:] == [threads[1]] and threads[1].startswith("hybridcache-tokenize")
    routes.tokenizer_pool.shutdown()


class _StepCounting:
    """An engine that records, for every add_request, how many steps had run before it."""

    def __init__(self, engine: LLMEngine) -> None:
        self._engine = engine
        self.steps = 0
        self.added_at: list[int] = []

    def add_request(self, *args, **kwargs):
        self._engine.add_request(*args, **kwargs)
        self.added_at.append(self.steps)

    def step(self):
        self.steps += 1
        return self._engine.step()

    def __getattr__(self, name):
        return getattr(self._engine, name)


async def _final(sink: asyncio.Queue):
    """A request's outputs added up (the engine loop streams DELTA outputs), once it has finished."""
    async for output in request_outputs(sink, Rendering()):
        if output.finished:
            return output
    raise AssertionError("the outputs ended before the request finished")


def test_a_batch_joins_one_step_and_the_queue_cap_refuses_it_whole():
    """A batch of prompts used to be added one prompt per engine step (3,000 prompts: 3,000 steps before the
    last one started). Now one command queues them all before the next step, or none of them."""
    engine = _StepCounting(LLMEngine(None, EngineConfig(block_size=16, max_model_len=128, max_num_seqs=4)))
    loop_engine = EngineLoop(engine, max_queued_requests=12)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)

    async def scenario():
        loop_engine.start()
        try:
            busy = await loop_engine.add_many(["a", "b"], ["busy one", "busy two"], params)  # engine is running
            sinks = await loop_engine.add_many([f"p{i}" for i in range(10)], [f"prompt {i}" for i in range(10)],
                                               params)
            with pytest.raises(QueueFull, match="--max-queued-requests"):
                await loop_engine.add_many(["x", "y"], ["over", "the cap"], SamplingParams(n=4, max_tokens=2))
            with pytest.raises(ValueError, match="prompt"):  # one bad prompt: none of the batch is queued
                await loop_engine.add_many(["ok", "bad"], ["fine", [10**7]], params)
            return [await _final(sink) for sink in busy + sinks]
        finally:
            await asyncio.to_thread(loop_engine.stop)

    finals = asyncio.run(scenario())
    assert [len(f.outputs[0].token_ids) for f in finals] == [20] * 12
    batch_steps = set(engine.added_at[2:12])
    assert len(batch_steps) == 1, engine.added_at  # all ten prompts were added before the same step
    assert engine.added_at[12:] == [engine.added_at[12]]  # "ok" was added, then taken back with the batch
    engine.check_integrity()
    assert not engine.has_unfinished_requests()


def test_an_answer_queued_before_the_handler_reads_it_is_not_lost_to_its_deadline():
    """A handler busy writing to a slow client reached its queue after its deadline, where the engine had put the
    finished answer in time: `wait_for(get(), 0)` (Python <= 3.11) dropped it and the client got a request_timeout
    error for a request the engine finished. The deadline bounds only waiting: a queued answer is taken."""
    from hybridcache.outputs import CompletionOutput, RequestOutput
    from hybridcache.server.limits import RequestTimeout

    async def read(queued: bool) -> list:
        sink: asyncio.Queue = asyncio.Queue()
        if queued:
            sink.put_nowait(RequestOutput("r", None, [1, 2], [CompletionOutput(0, "done", [3], "length")],
                                          finished=True))
        past = asyncio.get_running_loop().time() - 0.5
        return [output async for output in request_outputs(sink, Rendering(), past)]

    [output] = asyncio.run(read(queued=True))
    assert output.finished and output.outputs[0].finish_reason == "length"
    with pytest.raises(RequestTimeout):
        asyncio.run(read(queued=False))
