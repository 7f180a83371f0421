"""Image URLs against `hybridcache serve` on a tiny random Qwen3.5 image-text folder, from servers that misbehave:
many whose headers never end hold no thread (image chats, structured-output chats and SIGTERM go on as before), and
one that does not speak HTTP is a 400 "could not fetch" that does not quote it."""

from __future__ import annotations

import base64
import io
import os
import signal
import socket
import threading
import time

import httpx
import pytest

from hybridcache.models.vl_folders import write_tiny_vl_model

from .server_process import SMALL_ENGINE, running_server

PIL = pytest.importorskip("PIL.Image")
pytest.importorskip("xgrammar")


def _loopback_server(answer) -> str:
    """A loopback server handing each connection (its request read) to `answer` on a thread; the URL of /x.png."""
    listener = socket.create_server(("127.0.0.1", 0), backlog=64)

    def one(conn: socket.socket) -> None:
        with conn:
            try:
                conn.recv(65536)
                answer(conn)
            except OSError:
                pass

    def accept() -> None:
        while True:
            conn, _ = listener.accept()
            threading.Thread(target=one, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    return f"http://127.0.0.1:{listener.getsockname()[1]}/x.png"


def _trickle(conn: socket.socket) -> None:
    conn.sendall(b"HTTP/1.1 200 OK\r\nX: ")
    for _ in range(120):  # a byte of one header line a second: every read is quick, the headers never end
        conn.sendall(b"a")
        time.sleep(1)


def _chat(base_url: str, content, timeout: float, **extra) -> httpx.Response | None:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 2, **extra}
    try:
        return httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=timeout)
    except httpx.TimeoutException:
        return None


def _image(url: str) -> list[dict]:
    return [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": url}}]


def test_slow_image_urls_hold_no_thread_and_a_non_http_answer_is_a_400(tmp_path):
    """As many image chats as asyncio's default executor has threads (min(32, cpus + 4): where the fetches ran,
    with the grammar compiles and the engine's stop) name a URL whose headers never end; their clients give up.
    The server still answers image and structured-output chats at once, and exits on SIGTERM within its shutdown
    timeout (before: both hung for good)."""
    buffer = io.BytesIO()
    PIL.new("RGB", (32, 32), (200, 10, 10)).save(buffer, format="PNG")
    data_uri = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    slow = _loopback_server(_trickle)
    ssh = _loopback_server(lambda conn: conn.sendall(b"SSH-2.0-OpenSSH_8.9p1 Ubuntu-3\r\n"))
    model = write_tiny_vl_model(tmp_path / "vl")
    with running_server(str(model), *SMALL_ENGINE, "--shutdown-timeout", "3", tmp_dir=tmp_path) as server:
        url = server.base_url
        refused = _chat(url, _image(ssh), 30)
        assert refused is not None and refused.status_code == 400, refused and refused.text
        assert refused.json()["error"]["message"].startswith(f"could not fetch {ssh}: ")
        assert "OpenSSH" not in refused.text

        num_slow = min(32, (os.cpu_count() or 1) + 4)
        threads = [threading.Thread(target=_chat, args=(url, _image(f"{slow}?{i}"), 2)) for i in range(num_slow)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        start = time.monotonic()
        image = _chat(url, _image(data_uri), 20)
        assert image is not None and image.status_code == 200, "an image chat waited behind the slow fetches"
        structured = _chat(url, "hi", 20, response_format={"type": "json_object"})
        assert structured is not None and structured.status_code == 200, "a json_object chat waited behind them"
        assert time.monotonic() - start < 10

        server.process.send_signal(signal.SIGTERM)  # (the slow fetches still run: their 10 s are not up)
        signalled = time.monotonic()
        try:
            code = server.process.wait(timeout=30)
        except Exception:  # noqa: BLE001 - reported below
            code = None
        assert code == 0, f"SIGTERM: exit code {code} after {time.monotonic() - signalled:.1f} s\n{server.log()}"
        assert time.monotonic() - signalled < 3 + 2
        assert "Traceback" not in server.log()
