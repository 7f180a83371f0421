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
