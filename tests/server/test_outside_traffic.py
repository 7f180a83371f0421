"""Outside traffic against a live server on loopback (issue 26): half-open connections, oversized prompts, a
batch whose client leaves, a full waiting queue, a request timeout, slash redirects, a client gone mid-upload.
Every loop is bounded (a few hundred connections at most) and stops by itself."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import logging
import select
import socket
import threading
import time

import httpx
import pytest

from hybridcache.config import EngineConfig
from hybridcache.server.limits import ServerLimits
from tests.server.inprocess_server import serving
from tests.server.server_process import metric_value, running_server

CAP = 48
READ_TIMEOUT_S = 1.5
ENGINE = ("--block-size", "16", "--max-model-len", "512", "--num-blocks", "2048", "--max-num-seqs", "16")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    args = (*ENGINE, "--enable-debug-endpoints", "--limit-concurrency", str(CAP), "--request-read-timeout",
            str(READ_TIMEOUT_S), "--max-request-sequences", "300")
    with running_server(*args, tmp_dir=tmp_path_factory.mktemp("outside")) as server:
        yield server


def _closed_by_server(sock: socket.socket, wait_s: float = 0.0) -> bool:
    """Whether the server closed `sock` (EOF or a reset), waiting at most `wait_s` for it. Bytes still unread
    (the rest of an earlier response: its headers and body may arrive apart) are read past, not taken for an
    open connection."""
    deadline = time.monotonic() + wait_s
    while True:
        readable, _, _ = select.select([sock], [], [], max(0.0, deadline - time.monotonic()))
        if not readable:
            return False
        try:
            if sock.recv(4096) == b"":
                return True
        except OSError:
            return True


def _wait_idle(server, timeout_s: float = 30) -> dict:
    """The engine's state once it is idle (the debug check answers 409 while requests run), integrity checked."""
    deadline = time.monotonic() + timeout_s
    while True:
        response = httpx.get(f"{server.base_url}/debug/engine", timeout=30)
        if response.status_code != 409:
            assert response.status_code == 200, response.text
            return response.json()["engine"]
        assert time.monotonic() < deadline, "the engine did not become idle"
        time.sleep(0.1)


def test_half_open_connections_are_closed_and_cannot_lock_others_out(server):
    """200 connections that send half a request header (and 20 a short body) used to stay open forever and,
    by the thousands, took every file descriptor. Now at most CAP stay open, /health still answers while they
    are there, every one is closed within the read timeout, and the limit's warning is logged a few times only."""
    header = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Ty"
    short_body = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000\r\n\r\n{\"prompt\": ")
    sockets = []
    try:
        for i in range(220):
            sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
            sock.sendall(short_body if i % 11 == 0 else header)
            sockets.append(sock)
        start = time.monotonic()
        assert httpx.get(f"{server.base_url}/health", timeout=5).json()["status"] == "ok"
        open_now = [s for s in sockets if not _closed_by_server(s, 0.05)]
        assert len(open_now) <= CAP, len(open_now)  # the oldest were closed to make room
        deadline = start + READ_TIMEOUT_S + 5
        while open_now and time.monotonic() < deadline:
            open_now = [s for s in open_now if not _closed_by_server(s, 0.05)]
        assert not open_now, f"{len(open_now)} half-open connections outlived the read timeout"
    finally:
        for sock in sockets:
            sock.close()
    response = httpx.post(f"{server.base_url}/v1/completions", json={"prompt": "still here", "max_tokens": 2},
                          timeout=30)
    assert response.status_code == 200
    log = server.log()
    assert 1 <= log.count("the limit (--limit-concurrency)") <= 10, log[-2000:]  # ~170 events, a few lines
    assert "Traceback" not in log


def test_idle_keep_alive_connections_make_room_at_the_cap(server):
    """CAP connections that each got an answer and now sit idle (keep-alive) hold every place: a new client still
    gets in (the oldest idle one is closed for it), and no connection running a request is closed."""
    sockets = []
    try:
        for _ in range(CAP):
            sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert sock.recv(4096).startswith(b"HTTP/1.1 200")
            sockets.append(sock)
        body = {"prompt": "running while the cap is full", "max_tokens": 200, "ignore_eos": True}
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            running = pool.submit(httpx.post, f"{server.base_url}/v1/completions", json=body, timeout=60)
            time.sleep(0.3)
            for _ in range(5):  # each one closes an idle connection, never the running request's
                assert httpx.get(f"{server.base_url}/health", timeout=5).status_code == 200
            assert running.result().status_code == 200
        assert sum(_closed_by_server(s, 0.05) for s in sockets) >= 1
    finally:
        for sock in sockets:
            sock.close()


def test_oversized_prompts_are_refused_unread_while_health_answers(server):
    """Twenty concurrent 900 kB prompts (each too long) used to be tokenized on the event loop, holding /health
    for seconds. Now each is refused by its size, and /health answers throughout."""
    big = {"prompt": "word " * 180_000, "max_tokens": 1}
    with concurrent.futures.ThreadPoolExecutor(20) as pool:
        futures = [pool.submit(httpx.post, f"{server.base_url}/v1/completions", json=big, timeout=60)
                   for _ in range(20)]
        while not all(f.done() for f in futures):
            assert httpx.get(f"{server.base_url}/health", timeout=5).status_code == 200  # it used to take 12-14 s
        responses = [f.result() for f in futures]
    for response in responses:
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["code"] == "context_length_exceeded" and "too long" in error["message"], error
    # under the size bound but over max_model_len once tokenized: the tokenizer's count refuses it
    response = httpx.post(f"{server.base_url}/v1/completions", json={"prompt": "x" * 600}, timeout=30)
    assert response.status_code == 400
    assert response.json()["error"]["message"].startswith("This model's maximum context length is")
    state = _wait_idle(server)
    assert state["num_running"] == 0 and state["num_waiting"] == 0


def test_a_batch_whose_client_leaves_is_aborted_whole(server):
    """`{"prompt": [200 prompts]}` whose client hangs up after a second: every prompt is aborted at once (it used
    to go on for tens of seconds), and the batch cap refuses more than --max-request-sequences."""
    before = httpx.get(f"{server.base_url}/metrics").text
    batch = {"prompt": [f"b{i}" for i in range(200)], "max_tokens": 64, "ignore_eos": True}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        post = pool.submit(httpx.post, f"{server.base_url}/v1/completions", json=batch, timeout=1.0)
        seen = 0
        while not seen and not post.done():  # the first engine state that holds any of the batch
            engine = httpx.get(f"{server.base_url}/health", timeout=5).json()["engine"]
            seen = engine["num_running"] + engine["num_waiting"]
        assert seen == 200  # queued together (one prompt per step used to take 200 steps to queue them)
        with pytest.raises(httpx.ReadTimeout):
            post.result()
    gone = time.monotonic()
    _wait_idle(server, timeout_s=30)
    idle_after_s = time.monotonic() - gone
    after = httpx.get(f"{server.base_url}/metrics").text
    name = "hybridcache_request_finished_total"
    aborted = metric_value(after, name, 'finish_reason="abort"') - metric_value(before, name, 'finish_reason="abort"')
    done = metric_value(after, name, 'finish_reason="length"') - metric_value(before, name, 'finish_reason="length"')
    assert aborted + done == 200 and aborted > 100, (aborted, done, idle_after_s)
    too_many = httpx.post(f"{server.base_url}/v1/completions", timeout=30,
                          json={"prompt": [f"c{i}" for i in range(151)], "n": 2, "max_tokens": 1})
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "prompt"
    assert "302 sequences" in too_many.json()["error"]["message"]


def test_no_slash_redirect_and_no_traceback_for_a_client_gone_mid_upload(server):
    response = httpx.get(f"{server.base_url}/v1/models/", headers={"host": "evil.example"}, timeout=10)
    assert response.status_code == 404 and "location" not in response.headers
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100000\r\n\r\n{\"prompt\": \"" + b"a" * 5000)
        time.sleep(0.3)  # the handler is reading the body
    time.sleep(0.3)
    assert httpx.get(f"{server.base_url}/health", timeout=5).status_code == 200
    log = server.log()
    assert "unhandled error" not in log and "Traceback" not in log, log[-2000:]


def test_a_full_waiting_queue_answers_503_with_retry_after():
    engine = EngineConfig(block_size=16, max_model_len=1024, num_blocks=512, max_num_seqs=2)
    with serving(engine, enable_debug_endpoints=True, limits=ServerLimits(max_queued_requests=8)) as base_url:
        first_chunk = threading.Event()

        def stream_batch() -> None:
            body = {"prompt": [f"queued {i}" for i in range(8)], "max_tokens": 400, "ignore_eos": True,
                    "stream": True}
            with contextlib.suppress(httpx.HTTPError), \
                    httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=60) as response:
                for _ in response.iter_lines():
                    first_chunk.set()
                    if stop.is_set():
                        return  # hang up: the server aborts the batch

        stop = threading.Event()
        thread = threading.Thread(target=stream_batch)
        thread.start()
        try:
            assert first_chunk.wait(30)  # 2 sequences run, 6 wait
            refused = httpx.post(f"{base_url}/v1/completions", json={"prompt": "victim", "n": 3, "max_tokens": 2},
                                 timeout=30)
            assert refused.status_code == 503, refused.text
            assert refused.headers["retry-after"] == "1" and refused.json()["error"]["code"] == "queue_full"
        finally:
            stop.set()
            thread.join(60)
        for _ in range(100):  # the hung-up batch is aborted by the time the engine is idle
            check = httpx.get(f"{base_url}/debug/engine", timeout=30)
            if check.status_code != 409:
                break
            time.sleep(0.1)
        assert check.status_code == 200 and check.json()["engine"]["num_waiting"] == 0
        ok = httpx.post(f"{base_url}/v1/completions", json={"prompt": "victim", "n": 3, "max_tokens": 2}, timeout=30)
        assert ok.status_code == 200 and len(ok.json()["choices"]) == 3


def test_a_request_past_the_request_timeout_is_aborted():
    engine = EngineConfig(block_size=16, max_model_len=4096, num_blocks=1024)
    with serving(engine, enable_debug_endpoints=True, limits=ServerLimits(request_timeout_s=1.0)) as base_url:
        long = {"prompt": "never ending", "max_tokens": 4000, "ignore_eos": True}
        response = httpx.post(f"{base_url}/v1/completions", json=long, timeout=60)
        assert response.status_code == 503 and response.json()["error"]["code"] == "request_timeout", response.text
        # the OpenAI SDKs retry a 503 twice unless told not to: each try ran the request to the timeout again
        assert response.headers["x-should-retry"] == "false"
        with httpx.stream("POST", f"{base_url}/v1/completions", json={**long, "stream": True}, timeout=60) as r:
            lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "[DONE]" and json.loads(lines[-2])["error"]["code"] == "request_timeout"
        check = httpx.get(f"{base_url}/debug/engine", timeout=30)
        for _ in range(100):
            if check.status_code != 409:
                break
            time.sleep(0.1)
            check = httpx.get(f"{base_url}/debug/engine", timeout=30)
        assert check.status_code == 200 and check.json()["engine"]["num_running"] == 0
        short = httpx.post(f"{base_url}/v1/completions", json={"prompt": "quick", "max_tokens": 2}, timeout=30)
        assert short.status_code == 200


def test_a_client_gone_mid_upload_is_logged_as_a_disconnect(caplog):
    """It used to be logged as "unhandled error" with a traceback."""
    with caplog.at_level(logging.INFO, logger="hybridcache.server"), serving() as base_url:
        port = int(base_url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100000\r\n\r\n{\"prompt\": \"" + b"a" * 5000)
            time.sleep(0.3)  # the handler is reading the body
        deadline = time.monotonic() + 10
        while "disconnected while sending" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.05)
    assert "POST /v1/completions: the client disconnected while sending its request" in caplog.text
    assert "unhandled error" not in caplog.text and not any(r.exc_info for r in caplog.records)
