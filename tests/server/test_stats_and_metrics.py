"""The periodic stats line (when it is written and what it says) and the metrics' model_name label and usage
percentages, without a server."""

from __future__ import annotations

import asyncio
import copy
import logging
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from hybridcache.outputs import add_delta
from hybridcache.server.engine_state import EngineState
from hybridcache.server.limits import RequestTimeout
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
    metrics.prompt_computed(10, 4)
    metrics.request_finished(10, ["stop", "length"], 0.5)
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


def test_labelled_counters_have_every_series_at_zero_on_a_fresh_server():
    """vLLM creates a request_success child per FinishReason at start: a counter series that first appears with
    its first event is invisible to rate() / increase(), so an alert on the first burst of errors missed it. Every
    finish reason, save / hit reason, decline cause and eviction kind now has its series, at 0, from the start."""
    from hybridcache.cache.request import SaveReason
    from hybridcache.cache.stats import DeclineCause, EvictionKind

    metrics = ServerMetrics(model_name="m")
    metrics.watch_engine(lambda: EngineState(declined_saves={"policy": 2}))
    families = {family.name: family for family in text_string_to_metric_families(metrics.render().decode())}

    def values(name: str, label: str) -> dict[str, float]:
        return {s.labels[label]: s.value for s in families[name].samples if s.name.endswith("_total")}

    reasons = {"stop": 0, "length": 0, "abort": 0, "error": 0}
    assert values("hybridcache_request_finished", "finish_reason") == reasons
    assert values("vllm:request_success", "finished_reason") == reasons
    for name, label, enum in (("hybridcache_checkpoint_saves", "reason", SaveReason),
                              ("hybridcache_checkpoint_hits", "reason", SaveReason),
                              ("hybridcache_checkpoint_evictions", "kind", EvictionKind)):
        assert values(name, label) == {value.value: 0 for value in enum}, name
    assert values("hybridcache_checkpoint_saves_declined", "cause") == {
        cause.value: 2 if cause is DeclineCause.POLICY else 0 for cause in DeclineCause}


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
    """server.md: queries and hits are counted per request (at its first token, or when it ends before), and one
    aborted before its prompt was computed counts as neither, so the counters agree with `usage`. (The abort's
    output is always `finished`, which the check once read as "computed", so a waiting request's prompt was
    counted.)"""
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


def _run_on_engine_loop(max_num_seqs: int, scenario, step_sleep_s: float = 0.0, metrics: ServerMetrics | None = None,
                        **loop_options) -> ServerMetrics:
    """`scenario(loop)` (a coroutine function) on an EngineLoop (`loop_options`: its keyword arguments) over the
    built-in model, each of whose steps first sleeps `step_sleep_s` (a long step of a big model); returns its
    metrics (`metrics`, or new ones)."""
    import asyncio

    from hybridcache.config import EngineConfig
    from hybridcache.engine.engine import LLMEngine
    from hybridcache.server.engine_loop import EngineLoop

    metrics = metrics or ServerMetrics(model_name="m")
    engine = LLMEngine(None, EngineConfig(max_num_seqs=max_num_seqs, max_model_len=512))
    if step_sleep_s:
        step = engine.step

        def slow_step():
            time.sleep(step_sleep_s)
            return step()

        engine.step = slow_step
    loop = EngineLoop(engine, metrics, **loop_options)

    async def main() -> None:
        loop.start()
        try:
            await scenario(loop)
        finally:
            loop.stop()

    asyncio.run(main())
    return metrics


async def _until_finished(sink) -> list:
    """A request's queue items until it finished, the last replaced by all of them added up (streamed requests
    get DELTA outputs)."""
    outputs = [await sink.get()]
    total = copy.deepcopy(outputs[0])
    while not outputs[-1].finished:
        outputs.append(await sink.get())
        add_delta(total, copy.deepcopy(outputs[-1]))
    outputs[-1] = total
    return outputs


def test_prompt_and_cached_tokens_count_at_the_first_token_not_at_the_end():
    """vLLM adds a request's prompt tokens (and its prefix-cache queries and hits) at its first token. They were
    counted when it ended, so a long stream showed its generated tokens and a prompt of 0. Now they count once
    every completion has its first token, once: the totals still equal the sum of `usage`, aborts included."""
    from hybridcache.sampling import SamplingParams

    prompt = list(range(1, 41))
    seen = {}
    names = ("vllm:prompt_tokens_total", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
             "hybridcache_prompt_tokens_total", "hybridcache_prefix_cache_queries_tokens_total",
             "hybridcache_prefix_cache_hit_tokens_total", "vllm:generation_tokens_total")

    async def scenario(loop) -> None:
        first = await _until_finished(await loop.add("first", prompt, SamplingParams(temperature=0, max_tokens=2)))
        sink = await loop.add("long", prompt + [50, 51], SamplingParams(temperature=0, max_tokens=300, n=2,
                                                                         ignore_eos=True))
        output = await sink.get()
        while not all(c.token_ids for c in output.outputs):
            output = await sink.get()
        text = metrics.render().decode()
        seen["running"] = {name: metric_value(text, name) for name in names}
        seen["usage"] = (first[-1].num_cached_tokens, output.num_cached_tokens)
        loop.abort("long")
        await _until_finished(sink)
        await loop.call(lambda e: None)

    metrics = ServerMetrics(model_name="m")
    _run_on_engine_loop(4, scenario, metrics=metrics)
    first_cached, long_cached = seen["usage"]
    assert long_cached > 0  # the second request hit the first's prompt
    running = seen["running"]
    assert running["vllm:generation_tokens_total"] > 2
    for name in ("vllm:prompt_tokens_total", "vllm:prefix_cache_queries_total", "hybridcache_prompt_tokens_total",
                 "hybridcache_prefix_cache_queries_tokens_total"):
        assert running[name] == 40 + 42, name
    for name in ("vllm:prefix_cache_hits_total", "hybridcache_prefix_cache_hit_tokens_total"):
        assert running[name] == first_cached + long_cached, name
    text = metrics.render().decode()
    for name in names[:-1]:  # the abort counted nothing twice
        assert metric_value(text, name) == running[name], name


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


def test_ttft_and_e2e_count_from_the_arrival_not_from_the_engine_threads_pickup():
    """vLLM measures TTFT and e2e from the request's arrival at the frontend. A request that arrived while the
    engine thread ran a long step was stamped when that thread picked it up, so the wait was lost from
    vllm:time_to_first_token_seconds and vllm:e2e_request_latency_seconds (here ~0.5 s of B's ~1.1 s). The queue
    time still counts from the pickup, as vLLM's QUEUED -> SCHEDULED."""
    from hybridcache.sampling import SamplingParams

    seen: dict[str, float] = {}
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)

    async def request(loop, request_id: str, delay_s: float) -> None:
        await asyncio.sleep(delay_s)
        start = time.perf_counter()
        sink = await loop.add(request_id, [5, 6, 7, len(seen)], params)  # returns once the engine thread has it
        await _until_finished(sink)
        seen[request_id] = time.perf_counter() - start

    async def scenario(loop) -> None:
        await asyncio.gather(request(loop, "A", 0.0), request(loop, "B", 0.1))  # B arrives during A's step

    text = _run_on_engine_loop(4, scenario, step_sleep_s=0.6).render().decode()
    assert seen["B"] > 1.0  # it waited for A's step, then ran its own
    for name in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds"):
        assert metric_value(text, f"{name}_count") == 2
        assert metric_value(text, f"{name}_sum") >= sum(seen.values()) - 0.2, name  # was ~0.5 s short
    assert metric_value(text, "vllm:request_queue_time_seconds_sum") < 0.3


def test_the_request_timeout_counts_from_the_arrival():
    """`--request-timeout`'s deadline started when the engine thread picked the request up: one that waited for
    a long step ran that much longer before it was aborted (B here: aborted after the step that ended 1.9 s
    after its arrival, past its 1.5 s; it ran one more 1 s step)."""
    from hybridcache.sampling import SamplingParams

    long_params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    ended: dict[str, float] = {}

    async def request(loop, request_id: str, delay_s: float) -> None:
        await asyncio.sleep(delay_s)
        start = time.perf_counter()
        sink = await loop.add(request_id, [5, 6, 7, len(ended) + 8], long_params)
        while True:
            item = await sink.get()
            if isinstance(item, Exception) or item.finished:
                break
        ended[request_id] = time.perf_counter() - start
        assert isinstance(item, RequestTimeout), item

    async def scenario(loop) -> None:
        await asyncio.gather(request(loop, "A", 0.0), request(loop, "B", 0.1))

    _run_on_engine_loop(4, scenario, step_sleep_s=1.0, request_timeout_s=1.5)
    assert 1.5 <= ended["B"] < 2.5, ended  # was ~2.9 s: 1.5 s after its pickup, and a step more


@pytest.mark.parametrize("final_only", [False, True], ids=["streamed", "not-streamed"])
def test_n_completions_are_observed_each_in_the_latency_histograms(final_only):
    """vLLM runs n > 1 as n child requests, each observed on its own: the latency histograms counted one
    observation per request while vllm:request_success_total and the token histograms counted n. A request that
    is not streamed (`final_only`: its queue gets only the final output) is timed the same, from the engine's
    `step_progress`."""
    from hybridcache.sampling import SamplingParams

    async def scenario(loop) -> None:
        sink = await loop.add("n3", list(range(3, 30)), SamplingParams(n=3, temperature=1, seed=7, max_tokens=4,
                                                                       ignore_eos=True), final_only=final_only)
        outputs = await _until_finished(sink)
        assert [len(c.token_ids) for c in outputs[-1].outputs] == [4, 4, 4]
        if final_only:
            assert len(outputs) == 1
        await loop.call(lambda engine: engine.check_integrity())

    text = _run_on_engine_loop(4, scenario).render().decode()
    assert metric_value(text, "vllm:request_success_total") == 3
    for name in ("vllm:e2e_request_latency_seconds", "vllm:time_to_first_token_seconds",
                 "vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
                 "vllm:request_decode_time_seconds", "vllm:request_generation_tokens",
                 "hybridcache_e2e_request_latency_seconds", "hybridcache_time_to_first_token_seconds"):
        assert metric_value(text, f"{name}_count") == 3, name
    assert metric_value(text, "vllm:inter_token_latency_seconds_count") == 3 * 3  # 4 tokens: 3 gaps each
    assert metric_value(text, "vllm:generation_tokens_total") == 12
    assert metric_value(text, "vllm:prompt_tokens_total") == 27


def test_echo_only_requests_count_no_generated_tokens():
    """`max_tokens: 0` with echo asks the engine for one token that no choice shows and `usage` reports as 0; the
    generation counters counted it."""
    from hybridcache.sampling import SamplingParams

    async def scenario(loop) -> None:
        sink = await loop.add("echo", list(range(3, 20)), SamplingParams(temperature=0, max_tokens=1),
                              echo_only=True)
        await _until_finished(sink)

    text = _run_on_engine_loop(4, scenario).render().decode()
    assert metric_value(text, "vllm:request_success_total") == 1
    assert metric_value(text, "vllm:prompt_tokens_total") == 17
    for name in ("vllm:generation_tokens_total", "hybridcache_generation_tokens_total",
                 "vllm:request_generation_tokens_sum"):
        assert metric_value(text, name) == 0, name


def test_the_inter_token_latency_has_vllms_buckets():
    """vllm:inter_token_latency_seconds had the TTFT buckets; vLLM's ITL buckets (vllm/v1/metrics/loggers.py)."""
    metrics = ServerMetrics(model_name="m")
    metrics.itl.observe(0.04)
    bounds = [sample.labels["le"] for family in text_string_to_metric_families(metrics.render().decode())
              for sample in family.samples if sample.name == "vllm:inter_token_latency_seconds_bucket"]
    assert [float(b) for b in bounds] == [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                                          5.0, 7.5, 10.0, 20.0, 40.0, 80.0, float("inf")]


def test_spec_decode_counters_under_vllms_names():
    """With speculative decoding, vLLM's SpecDecodingProm counters (labels model_name and engine; per position,
    numbered from 0 as vLLM's) next to ours; only ours were exported. None without speculative decoding."""
    spec = {"num_drafts": 10, "num_draft_tokens": 20, "num_accepted_tokens": 7, "accepted_per_position": [5, 2]}
    metrics = ServerMetrics(model_name="m")
    metrics.watch_engine(lambda: EngineState(spec_decode=spec))
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(metrics.render().decode()) for s in family.samples}
    labels = (("engine", "0"), ("model_name", "m"))
    assert samples[("vllm:spec_decode_num_drafts_total", labels)] == 10
    assert samples[("vllm:spec_decode_num_draft_tokens_total", labels)] == 20
    assert samples[("vllm:spec_decode_num_accepted_tokens_total", labels)] == 7
    per_position = {dict(key)["position"]: value for (name, key), value in samples.items()
                    if name == "vllm:spec_decode_num_accepted_tokens_per_pos_total"}
    assert per_position == {"0": 5, "1": 2}
    assert samples[("hybridcache_spec_decode_num_accepted_tokens_per_pos_total",
                    (("model_name", "m"), ("position", "1")))] == 5  # ours count from 1
    plain = ServerMetrics(model_name="m")
    plain.watch_engine(EngineState)
    assert "vllm:spec_decode" not in plain.render().decode()


def test_a_line_after_an_idle_spell_covers_only_the_activity():
    """The first line after an idle spell divided its tokens by the whole idle time (its reference was the last
    line, before the idle spell): `rebase` at the spell's end starts its interval there."""
    stats = StatsLogger(interval_s=10.0, start_s=0.0)
    busy = StatsCounters(prompt_tokens=100, generation_tokens=100, query_tokens=100, hit_tokens=0)
    assert stats.line(10.0, busy, STATE) is not None
    stats.rebase(500.0, busy)  # idle from 10 s to 500 s
    again = StatsCounters(prompt_tokens=300, generation_tokens=200, query_tokens=300, hit_tokens=100)
    assert stats.due_in(501.0, again) == 9.0  # not at once, in the first step after the spell
    line = stats.line(510.0, again, STATE)
    assert line.startswith("Avg prompt throughput: 20.0 tokens/s, Avg generation throughput: 10.0 tokens/s")
    stats.rebase(520.0, StatsCounters(prompt_tokens=400))  # something changed since the line: nothing moves
    assert stats.due_in(520.0, StatsCounters(prompt_tokens=400)) == 0.0


def test_the_engine_loop_starts_a_stats_interval_when_an_idle_spell_ends(caplog):
    """The engine loop rebases its stats logger when its idle wait ends: the first line after an idle spell came
    in the new burst's first step, its throughput averaged over the idle time; now it comes an interval later."""
    from hybridcache.sampling import SamplingParams

    interval_s = 0.5
    burst_start: list[float] = []
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)

    async def scenario(loop) -> None:
        await _until_finished(await loop.add("first", list(range(3, 40)), params))
        await asyncio.sleep(4 * interval_s)  # its line is written, then idle
        burst_start.append(time.monotonic())
        await _until_finished(await loop.add("second", list(range(50, 90)), params))
        await asyncio.sleep(2 * interval_s)

    times: list[float] = []

    class Grab(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "Avg prompt throughput" in record.getMessage():
                times.append(time.monotonic())

    handler = Grab()
    logger = logging.getLogger("hybridcache.server")
    logger.addHandler(handler)
    try:
        with caplog.at_level(logging.INFO, logger="hybridcache.server"):
            _run_on_engine_loop(4, scenario, stats_interval_s=interval_s)
    finally:
        logger.removeHandler(handler)
    after = [t for t in times if t >= burst_start[0]]
    assert len(after) == 1, (burst_start, times)  # was 2: one in its first step, one an interval later
    assert after[0] >= burst_start[0] + interval_s - 0.05  # was in the burst's first step


def test_latency_histograms_tell_minutes_apart():
    """The hybridcache_* latency histograms topped out at 60 s: a 2-minute and a 20-minute request fell in the same
    +Inf bucket, so a p99 of a slow deployment read as "over 60 s". Their buckets now reach vLLM's top, 7,680 s."""
    metrics = ServerMetrics(model_name="m")
    for seconds in (90.0, 1200.0):
        metrics.e2e.observe(seconds)
    text = metrics.render().decode()
    assert metric_value(text, "hybridcache_e2e_request_latency_seconds_bucket", 'le="60.0"') == 0
    assert metric_value(text, "hybridcache_e2e_request_latency_seconds_bucket", 'le="120.0"') == 1
    assert metric_value(text, "hybridcache_e2e_request_latency_seconds_bucket", 'le="1800.0"') == 2
