"""SIGTERM: the server stops accepting, lets in-flight requests finish within the shutdown timeout, aborts
the rest, and exits cleanly."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest

from tests.server.server_process import running_server


def _stream(base_url: str, max_tokens: int, first_chunk: threading.Event, result: dict) -> None:
    body = {"prompt": "shutdown test", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    text, reason = "", None
    try:
        with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if line == "data: [DONE]":
                    result["done"] = True
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:  # the stream was cut at the end of the grace period
                    result["final_error"] = event["error"]["message"]
                    continue
                choice = event["choices"][0]
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
                   for i, n in enumerate((16, 1000))]  # 16: done well inside 3 s on a loaded 2-core machine
        for thread in threads:
            thread.start()
        for event in started:
            assert event.wait(30)
        server.process.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        time.sleep(0.3)
        refused = False
        try:
            httpx.get(f"{server.base_url}/health", timeout=2)
        except httpx.HTTPError:
            refused = True
        assert refused, "the server still accepts connections after SIGTERM"
        assert server.process.wait(timeout=30) == 0, server.log()
        # within the 3 s grace period, give or take the poll (it used to overrun it by 2.6-4 s: torch's teardown)
        assert time.monotonic() - signalled < 3.5
        for thread in threads:
            thread.join(30)
        short, long = results
        assert short["reason"] == "length" and short["text"], short  # finished within the shutdown timeout
        assert long.get("reason") != "length"  # 1000 tokens do not fit in 3 s: cut off
        assert "shut down" in long["final_error"] and long.get("done")  # ... with a final error event and [DONE]
        assert "Traceback" not in server.log()


def _read_stream(base_url: str, headers_seen: threading.Barrier | None, out: dict) -> None:
    """Read one streaming completion to its end; record every data line and how the stream ended."""
    body = {"prompt": "many streams", "max_tokens": 400, "ignore_eos": True, "stream": True}
    lines: list[str] = []
    try:
        with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=120) as response:
            out["status"] = response.status_code
            if headers_seen is not None:
                headers_seen.wait(60)
            for line in response.iter_lines():
                if line.startswith("data: "):
                    lines.append(line[6:])
    except (httpx.HTTPError, threading.BrokenBarrierError) as error:
        out["error"] = repr(error)
    out["lines"] = lines


@pytest.mark.slow
def test_sigterm_under_100_streams_ends_every_stream_with_a_final_event(tmp_path):
    """100 open streams, most of which cannot finish in the 2 s grace period: each ends either finished (a
    finish_reason) or with an error event, and always with [DONE]; no stream is cut mid-way."""
    num_streams = 100
    args = ("--block-size", "16", "--max-model-len", "512", "--num-blocks", "4096", "--max-num-seqs", "16",
            "--shutdown-timeout", "2")
    with running_server(*args, tmp_dir=tmp_path) as server:
        seen = threading.Barrier(num_streams + 1)
        results: list[dict] = [{} for _ in range(num_streams)]
        threads = [threading.Thread(target=_read_stream, args=(server.base_url, seen, results[i]))
                   for i in range(num_streams)]
        for thread in threads:
            thread.start()
        seen.wait(90)  # every stream has its response headers: all are open
        time.sleep(0.5)
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(timeout=60) == 0, server.log()
        for thread in threads:
            thread.join(60)
        log = server.log()
    finished = errored = 0
    for i, result in enumerate(results):
        assert "error" not in result, (i, result.get("error"))
        assert result["status"] == 200
        lines = result["lines"]
        assert lines and lines[-1] == "[DONE]", (i, lines[-3:])
        last = json.loads(lines[-2])
        if "error" in last:
            assert "shut down" in last["error"]["message"]
            errored += 1
        else:
            assert last["choices"][0]["finish_reason"] == "length", (i, lines[-3:])
            finished += 1
    assert errored > 0  # 100 x 400 tokens do not fit in 2 s: the test did cut streams
    assert finished + errored == num_streams
    assert "ASGI callable returned without completing response" not in log
    assert "Traceback" not in log
