"""Fetching and decoding image URLs (`hybridcache.images`), against loopback servers that misbehave: one deadline
over connecting, the headers and the body (a server that trickles its headers times out too), a non-HTTP answer
refused without quoting it, the size cap checked on Content-Length before the body, the redirect limit, and only
formats whose size Pillow reads before decoding (an ICO is decoded whole when opened)."""

from __future__ import annotations

import asyncio
import base64
import io
import socket
import struct
import sys
import threading
import time
import zlib
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from hybridcache.images import IMAGE_FORMATS, MAX_REDIRECTS, ImageError, MediaLimits, fetch_urls, load_image

PIL = pytest.importorskip("PIL.Image")


def png(width: int, height: int) -> bytes:
    buffer = io.BytesIO()
    PIL.fromarray(np.random.default_rng(0).integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buffer, "PNG")
    return buffer.getvalue()


@pytest.fixture
def raw_server() -> Iterator[Callable[[Callable[[socket.socket], None]], str]]:
    """`serve(answer)`: a loopback server that reads each request and hands the connection to `answer`; returns
    the URL of /cat.png on it."""
    sockets: list[socket.socket] = []

    def serve(answer: Callable[[socket.socket], None]) -> str:
        listener = socket.create_server(("127.0.0.1", 0))
        sockets.append(listener)

        def one(conn: socket.socket) -> None:
            with conn:
                try:
                    conn.recv(65536)
                    answer(conn)
                except OSError:  # the client gave up
                    pass

        def accept() -> None:
            while True:
                try:
                    conn, _ = listener.accept()
                except OSError:
                    return
                threading.Thread(target=one, args=(conn,), daemon=True).start()

        threading.Thread(target=accept, daemon=True).start()
        return f"http://127.0.0.1:{listener.getsockname()[1]}/cat.png"

    yield serve
    for listener in sockets:
        listener.close()


def trickle_headers(conn: socket.socket) -> None:
    conn.sendall(b"HTTP/1.1 200 OK\r\nX-Slow: ")
    for _ in range(60):  # one byte of one header line every 0.25 s: each read is quick, the headers never end
        conn.sendall(b"a")
        time.sleep(0.25)


def test_a_server_trickling_its_headers_times_out_within_the_fetch_timeout(raw_server):
    url = raw_server(trickle_headers)
    limits = MediaLimits(fetch_timeout_s=0.5)
    outcome: list[BaseException] = []
    start = time.monotonic()

    def fetch() -> None:
        try:
            load_image(url, limits)
        except BaseException as error:  # noqa: BLE001 - recorded for the assertion below
            outcome.append(error)

    thread = threading.Thread(target=fetch, daemon=True)
    thread.start()
    thread.join(timeout=8)
    assert not thread.is_alive(), "the fetch still ran 8 s after its 0.5 s timeout"
    assert isinstance(outcome[0], ImageError) and "timed out after 0.5 s" in str(outcome[0])
    assert time.monotonic() - start < 3
    # the server's own fetch (on its event loop, all at once) has the same deadline
    start = time.monotonic()
    with pytest.raises(ImageError, match="timed out"):
        asyncio.run(fetch_urls(["data:image/png;base64,", url, url], limits))
    assert time.monotonic() - start < 3


@pytest.mark.parametrize("reply", [
    b"SSH-2.0-OpenSSH_8.9p1 Ubuntu-3\r\n",
    b"HTTP/1.1 200 OK\r\n" + b"".join(b"X-%d: secret\r\n" % i for i in range(101)) + b"\r\n",
    b"HTTP/1.1 200 OK\r\nX: " + b"secret" * 20000 + b"\r\n\r\n",
    b"HTTP/1.1 abc\r\n\r\n",
], ids=["ssh banner", "101 headers", "a too-long line", "a bad status"])
def test_a_server_that_does_not_speak_http_is_refused_without_quoting_it(raw_server, reply):
    url = raw_server(lambda conn: conn.sendall(reply))
    with pytest.raises(ImageError) as caught:
        load_image(url, MediaLimits(fetch_timeout_s=5))
    message = str(caught.value)
    assert message.startswith((f"could not fetch {url}: ", f"{url} is not an image")), message
    assert "OpenSSH" not in message and "secret" not in message and "abc" not in message, message


def test_content_length_over_the_cap_is_refused_before_the_body(raw_server):
    def stall(conn: socket.socket) -> None:  # says 1 MB, sends none of it
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1000000\r\n\r\n")
        time.sleep(5)

    start = time.monotonic()
    with pytest.raises(ImageError, match="larger than 1000 bytes"):
        load_image(raw_server(stall), MediaLimits(fetch_timeout_s=3, max_bytes=1000))
    assert time.monotonic() - start < 2


def test_redirects_are_followed_up_to_the_limit_and_errors_name_the_standard_reason(raw_server):
    body = png(8, 6)
    urls: list[str] = []

    def answer(conn: socket.socket) -> None:
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body)

    def hop(to: int) -> Callable[[socket.socket], None]:
        return lambda conn: conn.sendall(b"HTTP/1.1 302 Found\r\nLocation: %s\r\nContent-Length: 0\r\n"
                                         b"Connection: close\r\n\r\n" % urls[to].encode())

    urls.append(raw_server(answer))
    for i in range(MAX_REDIRECTS + 1):
        urls.append(raw_server(hop(i)))
    assert load_image(urls[MAX_REDIRECTS], MediaLimits()).size == (8, 6)  # 10 redirects
    with pytest.raises(ImageError, match=f"more than {MAX_REDIRECTS} redirects"):
        load_image(urls[MAX_REDIRECTS + 1], MediaLimits())
    missing = raw_server(lambda conn: conn.sendall(b"HTTP/1.1 404 Go Away secret\r\nContent-Length: 0\r\n\r\n"))
    with pytest.raises(ImageError, match="could not fetch .*: HTTP 404 Not Found$"):
        load_image(missing, MediaLimits())


def _ico(inner: bytes) -> bytes:
    """An ICO whose one directory entry says 16 x 16 and holds `inner` (a PNG of any size)."""
    return struct.pack("<HHH", 0, 1, 1) + struct.pack("<BBBBHHII", 16, 16, 0, 0, 1, 32, len(inner), 22) + inner


def _zero_png(width: int, height: int) -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    pixels = zlib.compress(b"\0" * ((1 + 3 * width) * height), 9)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", pixels) + chunk(b"IEND", b""))


def test_only_formats_sized_before_decoding_are_accepted():
    """Pillow's ICO plugin decodes the largest icon whole while opening it, so an ICO saying 16 x 16 around a huge
    PNG passed the pixel check after the memory was spent (a 0.5 MB upload, 650 MB): such formats are refused."""
    limits = MediaLimits()
    for name in IMAGE_FORMATS:
        buffer = io.BytesIO()
        PIL.new("RGB", (12, 10), (10, 200, 30)).save(buffer, format=name)
        uri = f"data:image/{name.lower()};base64,{base64.b64encode(buffer.getvalue()).decode()}"
        assert load_image(uri, limits).size == (12, 10), name
    bomb = "data:image/x-icon;base64," + base64.b64encode(_ico(_zero_png(1000, 1000))).decode()
    with pytest.raises(ImageError, match="not an image Pillow can read in the accepted formats"):
        load_image(bomb, limits)
    with pytest.raises(ImageError, match="accepted formats"):
        load_image(_ico(_zero_png(16, 16)), limits)


def test_without_httpx_a_url_is_an_image_error_naming_it(monkeypatch):
    """httpx comes with the `serve` extra, not with `vision`: offline, a URL without it is a clear ImageError."""
    monkeypatch.setitem(sys.modules, "httpx", None)
    with pytest.raises(ImageError, match="needs httpx"):
        load_image("http://127.0.0.1:9/a.png", MediaLimits(fetch_timeout_s=1))
