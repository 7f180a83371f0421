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
import time
from pathlib import Path

import httpx
from outside_traffic import serve  # a sibling script: `hybridcache serve` of the built-in model, until /health


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
    with serve(args.repo) as (_, _, url):
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
