"""The first structured-output request's latency on a fresh `hybridcache serve` of the built-in model (CPU).

    PYTHONPATH=. python benchmarks/guided_first_request.py [--repo DIR] [--wait S]

Starts the server from `--repo` (default: this checkout; give an older checkout to compare), waits `--wait` seconds
after /health first answers 200 (0: none, the worst case for a build started at start-up), then times, one line
each, with max_tokens 1 and a new schema each time (nothing compiled before):

- llguidance_first: a JSON schema xgrammar would not enforce (`format: uri` with `minLength`: llguidance);
- llguidance_second: another such schema;
- xgrammar_first: a plain JSON schema (xgrammar);
- plain: an unconstrained request.

Nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ENGINE = ("--block-size", "16", "--max-model-len", "512", "--num-blocks", "256", "--max-num-seqs", "4")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def serve(repo: Path):
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(repo)}
    command = [sys.executable, "-m", "hybridcache.cli", "serve", "--port", str(port), "--log-level", "warning",
               *ENGINE]
    process = subprocess.Popen(command, cwd=repo, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start (exit code {process.poll()})")
            time.sleep(0.1)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def timed(url: str, **extra) -> float:
    body = {"model": "hybridcache-builtin", "prompt": "a", "max_tokens": 1, "temperature": 0, **extra}
    start = time.perf_counter()
    httpx.post(f"{url}/v1/completions", json=body, timeout=120).raise_for_status()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repo", type=Path, default=Path(__file__).resolve().parent.parent)
    parser.add_argument("--wait", type=float, default=0.0)
    args = parser.parse_args()
    with serve(args.repo) as url:
        model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        time.sleep(args.wait)

        def uri(length: int) -> dict:
            return {"type": "string", "format": "uri", "minLength": length}

        results = {
            "llguidance_first": timed(url, model=model, guided_json=uri(3)),
            "llguidance_second": timed(url, model=model, guided_json=uri(4)),
            "xgrammar_first": timed(url, model=model, guided_json={"type": "integer"}),
            "plain": timed(url, model=model),
        }
    for name, seconds in results.items():
        print(f"{name}: {seconds:.3f} s  (repo {args.repo}, wait {args.wait} s)")


if __name__ == "__main__":
    main()
