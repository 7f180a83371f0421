"""`serve --data-parallel-size N`: the router's /metrics carries every replica's engine metrics, each series labelled
`engine` with the replica's index, as vLLM's data-parallel server exports every engine's on its one /metrics. The
replicas listen on loopback only, so a Prometheus on another host scraped the router's ten hybridcache_router_*
series and no vllm:* or engine metric at all (hunt 170)."""

from __future__ import annotations

import httpx
from fastapi import Response
from prometheus_client.parser import text_string_to_metric_families

from hybridcache.cli import build_parser
from hybridcache.router import cli as router_cli
from hybridcache.router.app import RouterConfig, build_router_app
from hybridcache.server.engine_state import EngineState
from hybridcache.server.metrics import ServerMetrics
from tests.router.serving import replica_app, serving_app
from tests.server.server_process import free_port


def _replica_with_metrics(num_prompt_tokens: int | None):
    """A fake replica whose /metrics is a real server's, after one request of `num_prompt_tokens` (None: its
    /metrics answers 500)."""
    app = replica_app()
    metrics = ServerMetrics(model_name="m")
    metrics.watch_engine(lambda: EngineState(num_running=1, num_blocks=8, num_blocks_used=2))
    if num_prompt_tokens is not None:
        metrics.prompt_computed(num_prompt_tokens, 0)
        metrics.request_finished(num_prompt_tokens, ["stop"], 0.5, generation_lens=[3])

    @app.get("/metrics")
    async def render():
        if num_prompt_tokens is None:
            return Response("broken", status_code=500)
        return Response(metrics.render(), media_type="text/plain")

    return app


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_the_router_of_serve_data_parallel_exports_every_engines_metrics_labelled_engine():
    dead = f"http://127.0.0.1:{free_port()}"
    with (serving_app(_replica_with_metrics(11)) as a, serving_app(_replica_with_metrics(22)) as b,
          serving_app(_replica_with_metrics(None)) as broken):
        urls = (a, b, broken, dead)
        with serving_app(build_router_app(RouterConfig(urls, poll_interval_s=30.0, engine_metrics=True),
                                          tokenizer=None)) as router:
            text = httpx.get(f"{router}/metrics", timeout=30).text
        with serving_app(build_router_app(RouterConfig(urls, poll_interval_s=30.0), tokenizer=None)) as router:
            standalone = httpx.get(f"{router}/metrics", timeout=30).text
    samples = _samples(text)  # one valid exposition: the router's families and the engines'
    prompt = {labels: value for (name, labels), value in samples.items() if name == "vllm:prompt_tokens_total"}
    assert prompt == {(("engine", "0"), ("model_name", "m")): 11, (("engine", "1"), ("model_name", "m")): 22}
    assert samples[("hybridcache_prompt_tokens_total", (("engine", "1"), ("model_name", "m")))] == 22
    assert samples[("vllm:num_requests_running", (("engine", "0"), ("model_name", "m")))] == 1
    assert samples[("hybridcache_router_replica_up", (("replica", dead),))] == 0  # the router's own, as before
    assert "vllm:" not in standalone and "hybridcache_router_replica_up" in standalone  # `router`: its own only


def test_serve_data_parallel_asks_for_the_engine_metrics_and_router_does_not():
    serve = build_parser().parse_args(["serve", "--data-parallel-size", "2"])
    assert router_cli.router_config(serve, ["http://127.0.0.1:1", "http://127.0.0.1:2"]).engine_metrics
    router = build_parser().parse_args(["router", "--replica", "http://127.0.0.1:1"])
    assert not router_cli.router_config(router, router.replica).engine_metrics
