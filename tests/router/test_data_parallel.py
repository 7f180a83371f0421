"""`hybridcache serve --data-parallel-size 2` on the CPU with the built-in model: SWE-agent sessions replayed
through HTTP hit more behind the checkpoint router than behind round-robin, the router predicts exactly the
hits the replicas report, and a replica killed mid-run leaves every request completed or ended with a clear
error, and leaves the router's index."""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from hybridcache.bench.engine_bench import BenchConfig
from hybridcache.bench.server_bench import run_server_bench
from hybridcache.bench.workloads import ChatOptions, load_workload
from hybridcache.models.builtin import BUILTIN_NAME, builtin_model_dir, ensure_builtin_model
from hybridcache.router.app import RouterConfig, build_router_app
from hybridcache.router.policy import RoutingConfig
from tests.router.serving import serving_app
from tests.server.server_process import SMALL_ENGINE, metric_value, running_servers

CHAT = ChatOptions(num_sessions=3, max_turns=3, max_message_chars=60, max_prompt_len=1000)
BENCH = BenchConfig(("server",), max_reply_tokens=4)


def _replica_pid(parent_pid: int, port: int) -> int:
    """The child of the data-parallel launcher that serves `port`."""
    children = Path(f"/proc/{parent_pid}/task/{parent_pid}/children").read_text().split()
    for pid in children:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if b"--port" in argv and argv[argv.index(b"--port") + 1] == str(port).encode():
            return int(pid)
    raise AssertionError(f"no replica on port {port} among {children}")


def _stream(url: str, prompt: list[int], max_tokens: int = 400) -> str:
    """'ok' for a complete stream, else the error it ended with (status or error event)."""
    body = {"model": BUILTIN_NAME, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
        if response.status_code != 200:
            return f"status {response.status_code}: {response.read().decode()}"
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    errors = [line for line in lines if '"error"' in line]
    assert lines and lines[-1] == "data: [DONE]", lines[-3:]
    return errors[0] if errors else "ok"


@pytest.mark.slow
def test_router_beats_round_robin_and_survives_a_killed_replica(tmp_path):
    ensure_builtin_model()
    workload = load_workload("swe-agent", model_dir=builtin_model_dir(), chat=CHAT)
    args = (*SMALL_ENGINE, "--max-model-len", "1024", "--data-parallel-size", "2", "--enable-debug-endpoints",
            "--router-poll-interval", "0.2")
    with running_servers(args, tmp_dir=tmp_path, startup_timeout_s=300) as (dp,):
        replicas = (f"http://127.0.0.1:{dp.port + 1}", f"http://127.0.0.1:{dp.port + 2}")
        round_robin = build_router_app(RouterConfig(replicas, RoutingConfig("round-robin")), tokenizer=None)
        with serving_app(round_robin) as rr_url:
            rr = run_server_bench(rr_url, workload, BENCH, concurrency=1).modes["server"]
        for url in replicas:  # the same cold start for the checkpoint router
            httpx.get(f"{url}/debug/engine", params={"clear_cache": "true"}, timeout=60).raise_for_status()
        deadline = time.monotonic() + 30
        while any(r["indexed_checkpoints"] for r in httpx.get(f"{dp.base_url}/health").json()["replicas"]):
            assert time.monotonic() < deadline, "the router's index never saw the caches cleared"
            time.sleep(0.1)  # its next events poll (every 0.2 s) brings the removals
        ck = run_server_bench(dp.base_url, workload, BENCH, concurrency=1).modes["server"]
        assert ck.token_hit_rate > rr.token_hit_rate + 0.1, (ck.token_hit_rate, rr.token_hit_rate)
        metrics = httpx.get(f"{dp.base_url}/metrics").text
        predicted = metric_value(metrics, "hybridcache_router_predicted_hit_tokens_total")
        reported = metric_value(metrics, "hybridcache_router_reported_hit_tokens_total")
        assert predicted == reported > 0
        assert metric_value(metrics, "hybridcache_router_requests_routed_total") == len(workload)

        # kill replica 2 while streams are in flight: each completes or ends with a clear error
        victim = _replica_pid(dp.process.pid, dp.port + 2)
        prompts = [[(7 * i + 13 * k) % 250 for i in range(200 + k)] for k in range(8)]
        outcomes: list[str] = []

        def client(prompt: list[int]) -> None:
            outcomes.append(_stream(dp.base_url, prompt))

        threads = [threading.Thread(target=client, args=(p,)) for p in prompts]
        for thread in threads:
            thread.start()
        time.sleep(1.0)
        Path(f"/proc/{victim}").exists() and __import__("os").kill(victim, signal.SIGKILL)
        for thread in threads:
            thread.join(timeout=300)
        assert len(outcomes) == len(prompts)
        assert all(o == "ok" or "failed mid-stream" in o or "no replica could take" in o for o in outcomes), outcomes
        assert _stream(dp.base_url, prompts[0], 8) == "ok"  # the survivor serves
        assert any("failed mid-stream" in o for o in outcomes), outcomes  # the victim was streaming
        health = httpx.get(f"{dp.base_url}/health").json()
        down = [r for r in health["replicas"] if not r["up"]]
        assert [r["url"] for r in down] == [replicas[1]] and down[0]["indexed_checkpoints"] == 0
        print(json.dumps({"round_robin_hit_rate": rr.token_hit_rate, "checkpoint_hit_rate": ck.token_hit_rate,
                          "outcomes": outcomes}))
