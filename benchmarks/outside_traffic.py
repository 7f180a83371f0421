"""Issue 26's reproductions of outside traffic, at a small scale, against a `hybridcache serve` process on loopback.

    PYTHONPATH=. python benchmarks/outside_traffic.py [--repo DIR] [--out DIR]

Starts the built-in model's server from `--repo` (default: this checkout; give an older checkout to compare) and
measures, printing one line each and writing DIR/outside_traffic.json (DIR: --out, else $OUT, else .):

- batch: a 500-prompt `{"prompt": [...], "max_tokens": 1}` request, seconds to answer;
- batch_left: a 200-prompt batch (64 tokens each) whose client hangs up after 1 s: seconds until the engine is idle;
- big_prompts: twenty concurrent 1 MB prompts (each too long): the slowest /health answer meanwhile, seconds;
- half_open: 300 connections that send half a request header: /health's answer time among them, how many are
  still open right after, and 3 s after the server's read timeout (30 s by default; 2 s here when the server has
  the flag);
- shutdown: 8 streams running, SIGTERM with --shutdown-timeout 3: seconds until the process is gone.

Every loop is bounded; nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

ENGINE = ("--block-size", "16", "--max-model-len", "512", "--num-blocks", "2048", "--max-num-seqs", "16")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def serve(repo: Path, *args: str):
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(repo)}
    command = [sys.executable, "-m", "hybridcache.cli", "serve", "--port", str(port), "--log-level", "warning",
               *ENGINE, *args]
    process = subprocess.Popen(command, cwd=repo, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start ({' '.join(command)})")
            time.sleep(0.2)
        yield process, port, url
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(30)


def has_flag(repo: Path, flag: str) -> bool:
    text = subprocess.run([sys.executable, "-m", "hybridcache.cli", "serve", "--help"], cwd=repo, capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(repo)}).stdout
    return flag in text


def timed_health(url: str) -> float:
    start = time.perf_counter()
    try:
        httpx.get(f"{url}/health", timeout=30)
    except httpx.HTTPError:
        return float("inf")
    return time.perf_counter() - start


def engine_busy(url: str) -> int:
    engine = httpx.get(f"{url}/health", timeout=30).json().get("engine", {})
    return engine.get("num_running", 0) + engine.get("num_waiting", 0)


def batch(url: str) -> dict:
    start = time.perf_counter()
    response = httpx.post(f"{url}/v1/completions", timeout=600,
                          json={"prompt": [f"b{i}" for i in range(500)], "max_tokens": 1})
    return {"prompts": 500, "status": response.status_code, "seconds": time.perf_counter() - start}


def batch_left(url: str) -> dict:
    body = {"prompt": [f"b{i}" for i in range(200)], "max_tokens": 64, "ignore_eos": True}
    with contextlib.suppress(httpx.HTTPError):
        httpx.post(f"{url}/v1/completions", json=body, timeout=1.0)
    gone = time.perf_counter()
    while engine_busy(url) and time.perf_counter() - gone < 300:
        time.sleep(0.1)
    return {"prompts": 200, "idle_after_s": time.perf_counter() - gone}


def big_prompts(url: str) -> dict:
    body = {"prompt": "word " * 199_000, "max_tokens": 1}
    worst = 0.0
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(20) as pool:
        futures = [pool.submit(httpx.post, f"{url}/v1/completions", json=body, timeout=600) for _ in range(20)]
        while not all(f.done() for f in futures):
            worst = max(worst, timed_health(url))
        statuses = sorted({f.result().status_code for f in futures})
    return {"prompts": 20, "statuses": statuses, "seconds": time.perf_counter() - start, "worst_health_s": worst}


def half_open(port: int, url: str, read_timeout_s: float) -> dict:
    sockets = []
    try:
        for _ in range(300):
            sock = socket.create_connection(("127.0.0.1", port), timeout=5)
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Ty")
            sockets.append(sock)
        health_s = timed_health(url)

        def still_open() -> int:
            readable, _, _ = select.select(sockets, [], [], 0.2)
            closed = 0
            for sock in readable:
                try:
                    closed += sock.recv(4096) == b""
                except OSError:
                    closed += 1
            return len(sockets) - closed

        open_now = still_open()
        time.sleep(read_timeout_s + 3)
        open_later = still_open()
    finally:
        for sock in sockets:
            sock.close()
    return {"connections": 300, "health_s": health_s, "open_right_after": open_now,
            f"open_{read_timeout_s + 3:g}s_later": open_later}


def shutdown(repo: Path) -> dict:
    with serve(repo, "--shutdown-timeout", "3") as (process, _, url):
        def stream() -> None:
            with contextlib.suppress(httpx.HTTPError), httpx.stream(
                    "POST", f"{url}/v1/completions", timeout=60,
                    json={"prompt": "x", "max_tokens": 400, "ignore_eos": True, "stream": True}) as response:
                for _ in response.iter_lines():
                    pass

        threads = [threading.Thread(target=stream) for _ in range(8)]
        for thread in threads:
            thread.start()
        time.sleep(2)
        start = time.perf_counter()
        process.send_signal(signal.SIGTERM)
        code = process.wait(60)
        seconds = time.perf_counter() - start
        for thread in threads:
            thread.join(60)
    return {"grace_s": 3, "exit_code": code, "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repo", type=Path, default=Path(__file__).resolve().parents[1])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    args = parser.parse_args()
    repo = args.repo.resolve()
    guarded = has_flag(repo, "--request-read-timeout")
    read_timeout_s = 2.0 if guarded else 30.0
    # the batch of 500 is over the default --max-request-sequences (256)
    extra = ("--request-read-timeout", str(read_timeout_s), "--max-request-sequences", "500") if guarded else ()
    results: dict = {"repo": str(repo), "guarded": guarded}
    with serve(repo, *extra) as (_, port, url):
        for name, run in (("batch", lambda: batch(url)), ("batch_left", lambda: batch_left(url)),
                          ("big_prompts", lambda: big_prompts(url)),
                          ("half_open", lambda: half_open(port, url, read_timeout_s))):
            results[name] = run()
            print(name, json.dumps(results[name]), flush=True)
    results["shutdown"] = shutdown(repo)
    print("shutdown", json.dumps(results["shutdown"]), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "outside_traffic.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
