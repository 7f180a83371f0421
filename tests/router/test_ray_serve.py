"""Ray Serve (router/ray_serve.py) on a local Ray cluster, 2 CPU replicas of the built-in model: the SWE-agent
slice replayed through its OpenAI ingress gets exactly the hits it gets behind the standalone router (`serve
--data-parallel-size 2`), its /metrics counts them (predicted = reported) with each engine's own metrics, a
Responses conversation continues on the replica that stored each turn, and a replica killed mid-run leaves every
stream complete or ended with a clear error, leaves the cache index, and is replaced by Ray (the replacement joins
the index). Skipped without the `ray` extra."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import httpx
import pytest

from hybridcache.bench.engine_bench import BenchConfig
from hybridcache.bench.server_bench import run_server_bench
from hybridcache.bench.workloads import ChatOptions, load_workload
from hybridcache.models.builtin import BUILTIN_NAME, builtin_model_dir, ensure_builtin_model
from tests.router.test_data_parallel import _stream
from tests.server.server_process import SMALL_ENGINE, free_port, metric_value, running_servers

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

REPO = Path(__file__).resolve().parents[2]
CHAT = ChatOptions(num_sessions=3, max_turns=3, max_message_chars=60, max_prompt_len=1000)
BENCH = BenchConfig(("server",), max_reply_tokens=4)
ENGINE = (*SMALL_ENGINE, "--max-model-len", "1024", "--disable-log-stats")
APP = "hybridcache"


def _start_ray(num_cpus: int) -> int:
    """A local Ray cluster of `num_cpus` whose workers import this checkout, and Serve's HTTP proxy on a free port
    (returned); the caller shuts both down."""
    env = {k: os.environ[k] for k in ("HYBRIDCACHE_HOME", "HYBRIDCACHE_DEBUG") if k in os.environ}
    ray.init(num_cpus=num_cpus, include_dashboard=False, object_store_memory=100 << 20, log_to_driver=False,
             runtime_env={"env_vars": {**env, "PYTHONPATH": os.pathsep.join(
                 filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}})
    port = free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
    except BaseException:
        ray.shutdown()
        raise
    return port


def _engine_replicas(url: str) -> dict[str, dict]:
    return httpx.get(f"{url}/health", timeout=30).json()["replicas"]


@pytest.mark.slow
def test_ray_serve_hits_as_the_standalone_router_and_survives_a_killed_replica(tmp_path):
    from hybridcache.router.ray_serve import build_app

    ensure_builtin_model()
    workload = load_workload("swe-agent", model_dir=builtin_model_dir(), chat=CHAT)
    with running_servers((*ENGINE, "--data-parallel-size", "2", "--router-poll-interval", "0.2"),
                         tmp_dir=tmp_path, startup_timeout_s=300) as (dp,):
        standalone = run_server_bench(dp.base_url, workload, BENCH, concurrency=1).modes["server"]

    port = _start_ray(num_cpus=4)
    try:
        serve.run(build_app(ENGINE, num_replicas=2, num_cpus=1, poll_interval_s=0.2), name=APP, route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        through_ray = run_server_bench(url, workload, BENCH, concurrency=1).modes["server"]
        print({"standalone_hit_rate": standalone.token_hit_rate, "ray_hit_rate": through_ray.token_hit_rate,
               "prefill_tokens": (standalone.prefill_tokens_computed, through_ray.prefill_tokens_computed)})
        assert through_ray.num_calls == standalone.num_calls == len(workload)
        assert through_ray.prefill_tokens_computed == standalone.prefill_tokens_computed
        assert through_ray.hit_rate_by_turn == standalone.hit_rate_by_turn
        assert through_ray.token_hit_rate > 0.3, through_ray.token_hit_rate  # not a run of misses everywhere
        metrics = httpx.get(f"{url}/metrics", timeout=60).text  # the router's counters, each engine's own
        assert metric_value(metrics, "hybridcache_router_requests_routed_total") == len(workload)
        predicted = metric_value(metrics, "hybridcache_router_predicted_hit_tokens_total")
        assert predicted == metric_value(metrics, "hybridcache_router_reported_hit_tokens_total") > 0
        engines = [line for line in metrics.splitlines() if line.startswith("hybridcache_prompt_tokens_total{")]
        assert len(engines) == 2 and all('replica="' in line for line in engines), engines
        assert metric_value(metrics, "hybridcache_prompt_tokens_total") == metric_value(
            metrics, "hybridcache_router_prompt_tokens_total") > 0
        tokens = httpx.post(f"{url}/tokenize", json={"prompt": "hello there"}, timeout=60).json()["tokens"]
        assert httpx.post(f"{url}/detokenize", json={"tokens": tokens}, timeout=60).json() == {"prompt": "hello there"}
        assert "version" in httpx.get(f"{url}/version", timeout=60).json()
        # a Responses conversation: each turn goes to the replica that stored the one it continues (unpinned,
        # a continuation has no prompt to predict and Ray would pick either replica)
        previous = None
        for k in range(4):
            body = {"model": BUILTIN_NAME, "input": f"Turn {k}: say something.", "max_output_tokens": 2,
                    **({"previous_response_id": previous} if previous else {})}
            answer = httpx.post(f"{url}/v1/responses", json=body, timeout=120)
            assert answer.status_code == 200, answer.text
            previous = answer.json()["id"]
            assert k == 0 or answer.json()["usage"]["input_tokens_details"]["cached_tokens"] > 0
        assert httpx.get(f"{url}/v1/responses/{previous}", timeout=60).json()["id"] == previous

        # kill one engine replica while streams are in flight
        before = _engine_replicas(url)
        assert len(before) == 2 and all(r["up"] for r in before.values()), before
        assert any(r["indexed_checkpoints"] for r in before.values()), before
        victim = sorted(before)[0]
        prompts = [[(7 * i + 13 * k) % 250 for i in range(200 + k)] for k in range(4)]
        outcomes: list[str] = []
        threads = [threading.Thread(target=lambda p=p: outcomes.append(_stream(url, p, 200))) for p in prompts]
        for thread in threads:
            thread.start()
        time.sleep(1.0)
        ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)  # the actor is named by the id
        for thread in threads:
            thread.join(timeout=300)
        assert len(outcomes) == len(prompts)
        print({"outcomes": outcomes})
        assert all(o == "ok" or "failed mid-stream" in o for o in outcomes), outcomes
        deadline = time.monotonic() + 120
        while victim in _engine_replicas(url):  # the router saw it leave, and dropped it from the index
            assert time.monotonic() < deadline, "the killed replica never left the cache index"
            time.sleep(0.5)
        assert _stream(url, prompts[0], 8) == "ok"  # served by the survivor or Ray's replacement
        while len(_engine_replicas(url)) < 2:  # Ray starts a replacement, which pushes a snapshot to the index
            assert time.monotonic() < deadline + 180, "Ray never replaced the killed replica"
            time.sleep(1.0)
        assert victim not in _engine_replicas(url)
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.mark.slow
def test_ray_serve_routes_anthropic_messages():
    """Anthropic's /v1/messages through the Ray Serve ingress as through the standalone router
    (tests/router/test_messages_through_router.py's `check_messages_turns`): each turn's hit as predicted, streamed or
    not, `x-api-key` forwarded to the replica, count_tokens passed through, the ingress's own errors and the
    replica's in Anthropic's shape."""
    from hybridcache.router.ray_serve import build_app
    from tests.router.test_messages_through_router import KEY, check_messages_turns

    ensure_builtin_model()
    port = _start_ray(num_cpus=2)
    try:
        serve.run(build_app((*ENGINE, "--api-key", KEY), num_replicas=2, num_cpus=1, poll_interval_s=0.2),
                  name=APP, route_prefix="/")
        check_messages_turns(f"http://127.0.0.1:{port}", model=BUILTIN_NAME)
    finally:
        serve.shutdown()
        ray.shutdown()
