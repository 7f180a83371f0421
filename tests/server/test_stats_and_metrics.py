"""The periodic stats line (when it is written and what it says) and the metrics' model_name label and usage
percentages, without a server."""

from __future__ import annotations

import pytest

from hybridcache.server.engine_state import EngineState
from hybridcache.server.metrics import ServerMetrics
from hybridcache.server.stats_log import StatsCounters, StatsLogger
from tests.server.server_process import metric_value

STATE = EngineState(num_blocks=200, num_blocks_used=50, num_slots=16, num_slots_used=4, num_running=3,
                    num_waiting=1)


def test_stats_line_reports_the_interval_throughput_usage_and_hit_rate():
    stats = StatsLogger(interval_s=10.0, start_s=100.0)
    busy = StatsCounters(prompt_tokens=5000, generation_tokens=400, query_tokens=8000, hit_tokens=6000)
    assert stats.due_in(105.0, busy) == 5.0
    assert stats.line(105.0, busy, STATE) is None  # not due yet
    line = stats.line(110.0, busy, STATE)
    assert line == ("Avg prompt throughput: 500.0 tokens/s, Avg generation throughput: 40.0 tokens/s, "
                    "Running: 3 reqs, Waiting: 1 reqs, KV cache usage: 25.0%, State slot usage: 25.0%, "
                    "Prefix cache hit rate: 75.0%")
    # the next line covers only what happened since: 20 s later, 100 more generated tokens, no finished request
    later = StatsCounters(prompt_tokens=5000, generation_tokens=500, query_tokens=8000, hit_tokens=6000)
    line = stats.line(130.0, later, EngineState())
    assert line.startswith("Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 5.0 tokens/s")
    assert line.endswith("KV cache usage: 0.0%, State slot usage: 0.0%, Prefix cache hit rate: -")


def test_an_idle_server_writes_one_line_and_then_none():
    stats = StatsLogger(interval_s=1.0, start_s=0.0)
    assert stats.due_in(5.0, StatsCounters()) is None  # nothing ever happened
    assert stats.line(5.0, StatsCounters(), STATE) is None
    done = StatsCounters(prompt_tokens=10, generation_tokens=2, query_tokens=10, hit_tokens=0)
    assert stats.due_in(5.0, done) == 0.0
    assert stats.line(5.0, done, STATE) is not None
    assert stats.due_in(100.0, done) is None  # idle since: no more lines


def test_stats_interval_must_be_positive():
    with pytest.raises(ValueError, match="interval"):
        StatsLogger(interval_s=0, start_s=0.0)


def test_every_metric_carries_the_model_name_and_usage_is_in_percent():
    metrics = ServerMetrics(model_name="acme/tiny")
    metrics.watch_engine(lambda: EngineState(num_blocks=8, num_blocks_used=2, num_slots=5, num_slots_used=5,
                                             checkpoint_saves={"prefill_end": 3}, checkpoint_hits={"finish": 2},
                                             declined_saves={"policy": 5, "no_room": 1}))
    metrics.request_finished(10, 4, ["stop", "length"], 0.5)
    metrics.ttft.observe(0.1)
    text = metrics.render().decode()
    samples = [line for line in text.splitlines() if line and not line.startswith("#")]
    assert samples
    for line in samples:
        assert 'model_name="acme/tiny"' in line, line
    assert metric_value(text, "hybridcache_kv_cache_usage_percent") == 25.0
    assert metric_value(text, "hybridcache_state_slot_usage_percent") == 100.0
    assert metric_value(text, "hybridcache_prefix_cache_hit_tokens_total") == 4
    assert metric_value(text, "hybridcache_request_finished_total", 'finish_reason="length"') == 1
    assert metric_value(text, "hybridcache_checkpoint_saves_total", 'reason="prefill_end"') == 3
    assert metric_value(text, "hybridcache_checkpoint_hits_total", 'reason="finish"') == 2
    assert metric_value(text, "hybridcache_checkpoint_saves_declined_total", 'cause="policy"') == 5
    assert metric_value(text, "hybridcache_checkpoint_saves_declined_total") == 6
    empty = ServerMetrics()
    empty.watch_engine(EngineState)
    assert metric_value(empty.render().decode(), "hybridcache_kv_cache_usage_percent") == 0.0


def test_per_tier_metrics_split_hits_and_bytes_between_device_and_host():
    metrics = ServerMetrics(model_name="m")
    metrics.watch_engine(lambda: EngineState(num_blocks=8, num_blocks_used=2, block_bytes=1024, num_hits=5,
                                             num_host_hits=2, num_host_blocks=32, num_host_blocks_used=6,
                                             num_host_checkpoints=1, num_promotions=2, num_promoted_blocks=7,
                                             num_demotions=3, num_demoted_blocks=9, num_promotions_skipped=4,
                                             num_host_dropped=5))
    text = metrics.render().decode()
    assert metric_value(text, "hybridcache_cache_hits_total", 'tier="device"') == 3
    assert metric_value(text, "hybridcache_cache_hits_total", 'tier="host"') == 2
    assert metric_value(text, "hybridcache_cache_bytes_used", 'tier="device"') == 2 * 1024
    assert metric_value(text, "hybridcache_cache_bytes_total", 'tier="host"') == 32 * 1024
    assert metric_value(text, "hybridcache_cache_bytes_used", 'tier="host"') == 6 * 1024
    assert metric_value(text, "hybridcache_host_checkpoints") == 1
    assert metric_value(text, "hybridcache_host_promotions_total", 'what="blocks"') == 7
    assert metric_value(text, "hybridcache_host_demotions_total", 'what="checkpoints"') == 3
    assert metric_value(text, "hybridcache_host_promotions_skipped_total") == 4
    assert metric_value(text, "hybridcache_host_dropped_total") == 5
    assert "hybridcache_disk_bytes" not in text  # no disk tier


def test_disk_tier_metrics():
    metrics = ServerMetrics(model_name="m")
    disk = dict(num_bytes=4096, num_promoted_checkpoints=2, num_promoted_blocks=3, num_demoted_checkpoints=5,
                num_demoted_blocks=7, num_evicted_states=1, num_corrupt=4, num_write_errors=6, num_not_kept=8)
    metrics.watch_engine(lambda: EngineState(disk=disk))
    text = metrics.render().decode()
    assert metric_value(text, "hybridcache_disk_bytes") == 4096
    assert metric_value(text, "hybridcache_disk_promotions_total", 'what="checkpoints"') == 2
    assert metric_value(text, "hybridcache_disk_promotions_total", 'what="blocks"') == 3
    assert metric_value(text, "hybridcache_disk_demotions_total", 'what="checkpoints"') == 5
    assert metric_value(text, "hybridcache_disk_demotions_total", 'what="blocks"') == 7
    for why, count in (("evicted", 1), ("corrupt", 4), ("write_error", 6), ("not_kept", 8)):
        assert metric_value(text, "hybridcache_disk_lost_total", f'why="{why}"') == count


def test_a_request_aborted_while_it_waits_counts_as_no_query():
    """server.md: queries and hits are counted per request when it ends, and one aborted before its prompt was
    computed counts as neither, so the counters agree with `usage`. (The abort's output is always `finished`,
    which the check once read as "computed", so a waiting request's prompt was counted.)"""
    import asyncio

    from hybridcache.config import EngineConfig
    from hybridcache.engine.engine import LLMEngine
    from hybridcache.sampling import SamplingParams
    from hybridcache.server.engine_loop import EngineLoop

    engine = LLMEngine(None, EngineConfig(max_num_seqs=1, max_model_len=512))
    metrics = ServerMetrics(model_name="m")
    loop = EngineLoop(engine, metrics)
    long_params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)

    async def main() -> list:
        loop.start()
        try:
            running = await loop.add("running", list(range(1, 60)), long_params)
            await loop.add("waiting", list(range(100, 300)), long_params)  # max_num_seqs 1: it waits
            assert not await loop.call(lambda e: e.has_started("waiting"))
            loop.abort("waiting")
            outputs = []
            while not (outputs and outputs[-1].finished):
                outputs.append(await running.get())
            return outputs
        finally:
            loop.stop()

    outputs = asyncio.run(main())
    text = metrics.render().decode()
    assert metric_value(text, "hybridcache_prefix_cache_queries_tokens_total") == len(outputs[-1].prompt_token_ids)
    assert metric_value(text, "hybridcache_prompt_tokens_total") == 59
    assert metric_value(text, "hybridcache_request_finished_total", 'finish_reason="abort"') == 1


def _run_on_engine_loop(max_num_seqs: int, scenario) -> ServerMetrics:
    """`scenario(loop)` (a coroutine function) on an EngineLoop over the built-in model; returns its metrics."""
    import asyncio

    from hybridcache.config import EngineConfig
    from hybridcache.engine.engine import LLMEngine
    from hybridcache.server.engine_loop import EngineLoop

    metrics = ServerMetrics(model_name="m")
    loop = EngineLoop(LLMEngine(None, EngineConfig(max_num_seqs=max_num_seqs, max_model_len=512)), metrics)

    async def main() -> None:
        loop.start()
        try:
            await scenario(loop)
        finally:
            loop.stop()

    asyncio.run(main())
    return metrics


async def _until_finished(sink) -> list:
    outputs = [await sink.get()]
    while not outputs[-1].finished:
        outputs.append(await sink.get())
    return outputs


def test_requests_that_finish_in_their_first_step_have_queue_and_prefill_times():
    """vLLM observes vllm:request_queue_time_seconds and vllm:request_prefill_time_seconds for every finished
    request. A request done in its first engine step (max_tokens 1) is unknown to the engine once the step
    returns, so `has_started` said False and it was never observed (2 of 5 counted)."""
    from hybridcache.sampling import SamplingParams

    async def scenario(loop) -> None:
        for i, max_tokens in enumerate((1, 1, 1, 3, 3)):
            sink = await loop.add(f"r{i}", [5, 6, 7 + i], SamplingParams(temperature=0, max_tokens=max_tokens,
                                                                         ignore_eos=True))
            await _until_finished(sink)

    text = _run_on_engine_loop(4, scenario).render().decode()
    for name in ("vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
                 "vllm:request_prefill_time_seconds"):
        assert metric_value(text, f"{name}_count") == 5, name


def test_aborts_count_alike_in_both_finish_counters_queued_or_running():
    """docs/server.md and vllm_metrics.py: vllm:request_success_total counts completions that ended, aborts
    included, as hybridcache_request_finished_total does. A request aborted while queued counted in ours only
    (2 running + 3 queued aborts: 5 against 2); now in both, and still in no token counter or latency
    histogram (it computed nothing)."""
    from hybridcache.sampling import SamplingParams

    long_params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def scenario(loop) -> None:
        running = [await loop.add(f"run{i}", list(range(1 + i, 40)), long_params) for i in range(2)]
        for sink in running:
            await sink.get()  # both have a token: running
        for i in range(3):  # max_num_seqs 2: these wait
            await loop.add(f"queued{i}", list(range(100 + i, 200)), long_params)
            assert not await loop.call(lambda e, i=i: e.has_started(f"queued{i}"))
        for request_id in ("queued0", "queued1", "queued2", "run0", "run1"):
            loop.abort(request_id)
        for sink in running:
            await _until_finished(sink)
        await loop.call(lambda e: None)  # the aborts are handled

    text = _run_on_engine_loop(2, scenario).render().decode()
    assert metric_value(text, "hybridcache_request_finished_total", 'finish_reason="abort"') == 5
    assert metric_value(text, "vllm:request_success_total", 'finished_reason="abort"') == 5
    assert metric_value(text, "vllm:e2e_request_latency_seconds_count") == 2  # the running two only
    assert metric_value(text, "vllm:prompt_tokens_total") == 39 + 38
