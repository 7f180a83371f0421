"""SIGTERM: the server stops accepting, lets in-flight requests finish within the shutdown timeout, aborts
the rest, and exits cleanly."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx

from tests.server.server_process import running_server


def _stream(base_url: str, max_tokens: int, first_chunk: threading.Event, result: dict) -> None:
    body = {"prompt": "shutdown test", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    text, reason = "", None
    try:
        with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                choice = json.loads(line[6:])["choices"][0]
                text += choice["text"]
                reason = choice["finish_reason"] or reason
                first_chunk.set()
    except httpx.HTTPError as error:
        result["error"] = error
    first_chunk.set()
    result.update(text=text, reason=reason)


def test_sigterm_finishes_short_requests_aborts_long_ones_and_exits_cleanly(tmp_path):
    args = ("--block-size", "16", "--max-model-len", "1024", "--num-blocks", "256", "--shutdown-timeout", "3")
    with running_server(*args, tmp_dir=tmp_path) as server:
        results: list[dict] = [{}, {}]
        started = [threading.Event(), threading.Event()]
        threads = [threading.Thread(target=_stream, args=(server.base_url, n, started[i], results[i]))
                   for i, n in enumerate((40, 1000))]
        for thread in threads:
            thread.start()
        for event in started:
            assert event.wait(30)
        server.process.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        refused = False
        try:
            httpx.get(f"{server.base_url}/health", timeout=2)
        except httpx.HTTPError:
            refused = True
        assert refused, "the server still accepts connections after SIGTERM"
        assert server.process.wait(timeout=30) == 0, server.log()
        for thread in threads:
            thread.join(30)
        short, long = results
        assert short["reason"] == "length" and short["text"]  # finished within the shutdown timeout
        assert long.get("reason") != "length"  # 1000 tokens do not fit in 3 s: cut off
        assert "Traceback" not in server.log()
