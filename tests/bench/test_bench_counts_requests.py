"""Both engine benchmarks count a request's prompt once, whatever its `n`: its completions share one prefill,
and the request's cached tokens are the engine's `RequestOutput.num_cached_tokens` (a server's usage). The
server benchmark copied the usage's cached tokens onto each of the n completions and summed the prompt n times:
hit rate 0 and n x the prefill tokens on group-sampling-n, where the offline one counted every completion's own
hit (hunt 129)."""

import pytest

from hybridcache.bench.engine_bench import BenchConfig, CallRecord, summarize
from hybridcache.bench.workloads import SimRequest, Workload

PROMPT = tuple(range(1, 200))


def test_summarize_counts_each_request_once():
    records = [CallRecord("r0", 0, 100, 40, ((1, 2), (3, 4), (5, 6)), 0.1, 0.2),
               CallRecord("r1", 0, 50, 0, ((7,),), 0.3, 0.4)]
    result = summarize("server", records, 1.0, 110)
    assert result.token_hit_rate == pytest.approx(40 / 150)
    assert result.num_calls == 2
    assert result.output_tokens_per_s == pytest.approx(7.0)
    assert records[0].completion_outputs() == {"r0#0": (1, 2), "r0#1": (3, 4), "r0#2": (5, 6)}


def test_offline_and_server_bench_agree_on_requests_with_n_completions(tmp_path):
    pytest.importorskip("torch")
    from hybridcache.bench.engine_bench import run_bench
    from hybridcache.bench.server_bench import run_server_bench
    from tests.server.server_process import running_servers

    requests = (SimRequest("a", PROMPT, (1,) * 4, n=3, sibling_output_ids=((2,) * 4, (3,) * 4)),
                SimRequest("b", PROMPT + (7, 8, 9), (4,) * 4, n=2, sibling_output_ids=((5,) * 4,)))
    workload = Workload("toy-n", len(requests), lambda: iter(requests))
    config = BenchConfig(("hybridcache",), max_reply_tokens=4, engine_options=dict(
        block_size=16, max_model_len=2048, num_blocks=512, max_num_seqs=8))
    offline = run_bench(None, workload, config).modes["hybridcache"]
    args = ("--block-size", "16", "--max-model-len", "2048", "--num-blocks", "512", "--max-num-seqs", "8")
    with running_servers(args, tmp_dir=tmp_path) as (server,):
        online = run_server_bench(server.base_url, workload, config, concurrency=1).modes["server"]
    prompt_tokens = sum(r.prompt_len for r in requests)
    for result in (offline, online):
        assert result.num_calls == len(requests)
        assert 0 < result.token_hit_rate < 1  # b hits a's prompt
        # the hit rate and the prefill tokens describe the same computation: each prompt once
        assert result.prefill_tokens_computed == round(prompt_tokens * (1 - result.token_hit_rate))
    assert online.token_hit_rate == pytest.approx(offline.token_hit_rate)
    assert online.prefill_tokens_computed == offline.prefill_tokens_computed
