"""Fetching and decoding image URLs (`hybridcache.images`), against loopback servers that misbehave: one deadline
over connecting, the headers and the body (a server that trickles its headers times out too), a non-HTTP answer
refused without quoting it, the size cap checked on Content-Length before the body, the redirect limit, and only
formats whose size Pillow reads before decoding (an ICO is decoded whole when opened). As urllib before httpx: the
system's CA store, the proxy of the URL's scheme (NO_PROXY honoured, ALL_PROXY ignored); the server's event loop
gets a default executor (host lookups) of 64 threads that its shutdown does not join."""

from __future__ import annotations

import asyncio
import base64
import contextlib
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


def png_answer(body: bytes) -> Callable[[socket.socket], None]:
    return lambda conn: conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n"
                                     % len(body) + body)


@pytest.fixture
def no_proxy_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """monkeypatch, with no proxy variable of the machine's left in the environment."""
    for name in ("http_proxy", "https_proxy", "all_proxy", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.upper(), raising=False)
    return monkeypatch


@pytest.fixture
def fake_proxy() -> Iterator[Callable[[Callable[[socket.socket, int], None]], tuple[str, list[bytes]]]]:
    """`start(answer)`: a loopback HTTP proxy that records each request it reads and hands the connection and the
    request's index to `answer`; returns (its URL, the requests so far)."""
    listeners: list[socket.socket] = []

    def start(answer: Callable[[socket.socket, int], None]) -> tuple[str, list[bytes]]:
        proxy = socket.create_server(("127.0.0.1", 0))
        listeners.append(proxy)
        requests: list[bytes] = []

        def serve() -> None:
            with proxy:
                while True:
                    try:
                        conn, _ = proxy.accept()
                    except OSError:
                        return
                    with conn:
                        requests.append(conn.recv(65536))
                        answer(conn, len(requests) - 1)

        threading.Thread(target=serve, daemon=True).start()
        return f"http://127.0.0.1:{proxy.getsockname()[1]}", requests

    yield start
    for proxy in listeners:
        proxy.close()


def test_all_proxy_is_ignored_as_by_urllib(raw_server, no_proxy_env):
    """ALL_PROXY=socks5://... (common on dev machines) made every image URL a 500 (ImportError: socksio): httpx's
    trust_env built a SOCKS transport for the client whatever the host, NO_PROXY ones included."""
    no_proxy_env.setenv("ALL_PROXY", "socks5://127.0.0.1:9")
    no_proxy_env.setenv("NO_PROXY", "127.0.0.1")
    assert load_image(raw_server(png_answer(png(8, 6))), MediaLimits(fetch_timeout_s=5)).size == (8, 6)
    no_proxy_env.delenv("NO_PROXY")
    assert load_image(raw_server(png_answer(png(8, 6))), MediaLimits(fetch_timeout_s=5)).size == (8, 6)


def test_a_socks_proxy_without_its_extra_is_an_image_error_naming_it(no_proxy_env):
    no_proxy_env.setenv("HTTPS_PROXY", "socks5://user:secret@127.0.0.1:9")
    with pytest.raises(ImageError, match=r"could not fetch https://127.0.0.1:9/a.png: .*httpx\[socks\]") as caught:
        load_image("https://127.0.0.1:9/a.png", MediaLimits(fetch_timeout_s=5))
    assert "secret" not in str(caught.value)


def test_the_proxy_of_the_url_scheme_is_used_unless_no_proxy_names_the_host(raw_server, no_proxy_env, fake_proxy):
    body = png(8, 6)
    proxy, requests = fake_proxy(lambda conn, _: png_answer(body)(conn))
    no_proxy_env.setenv("http_proxy", proxy.removeprefix("http://"))  # no scheme: http, as urllib's
    no_proxy_env.setenv("https_proxy", "http://127.0.0.1:9")  # (another scheme's: not used)
    assert load_image("http://images.invalid/cat.png", MediaLimits(fetch_timeout_s=5)).size == (8, 6)
    assert requests and requests[0].startswith(b"GET http://images.invalid/cat.png HTTP/1.1\r\n"), requests
    # a host no_proxy names is fetched directly, not through the (here dead) proxy
    no_proxy_env.setenv("http_proxy", "http://127.0.0.1:9")
    no_proxy_env.setenv("no_proxy", "localhost,127.0.0.1")
    assert load_image(raw_server(png_answer(body)), MediaLimits(fetch_timeout_s=5)).size == (8, 6)
    assert len(requests) == 1


def test_each_redirect_hop_takes_the_proxy_of_its_own_url(raw_server, no_proxy_env, fake_proxy):
    """A proxied URL redirecting to a host no_proxy names was fetched through the first hop's proxy (one client
    for every hop): an internal image server behind NO_PROXY was asked for through the outside proxy."""
    direct = raw_server(png_answer(png(8, 6)))  # 127.0.0.1: no_proxy names it

    def answer(conn: socket.socket, index: int) -> None:
        if index == 0:
            conn.sendall(b"HTTP/1.1 302 Found\r\nLocation: %s\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
                         % direct.encode())
        else:
            conn.sendall(b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")

    proxy, requests = fake_proxy(answer)
    no_proxy_env.setenv("http_proxy", proxy)
    no_proxy_env.setenv("no_proxy", "localhost,127.0.0.1")
    assert load_image("http://images.invalid/cat.png", MediaLimits(fetch_timeout_s=5)).size == (8, 6)
    assert len(requests) == 1 and requests[0].startswith(b"GET http://images.invalid/cat.png HTTP/1.1\r\n")


def test_cookies_set_by_a_hop_go_with_the_next_hop(no_proxy_env, fake_proxy):
    """A server that sets a cookie and redirects to check it (a common anti-bot step) was redirected forever: each
    hop had a fresh client, so the cookie was dropped (hunt 210; vLLM's aiohttp session keeps it)."""
    body = png(8, 6)
    seen: list[bytes] = []

    def answer(conn: socket.socket, index: int) -> None:
        if b"cookie: session=ok" in seen[index].lower():
            png_answer(body)(conn)
        else:
            conn.sendall(b"HTTP/1.1 302 Found\r\nSet-Cookie: session=ok; Path=/\r\nLocation: /cat.png\r\n"
                         b"Content-Length: 0\r\nConnection: close\r\n\r\n")

    origin, requests = fake_proxy(answer)
    seen = requests
    assert load_image(f"{origin}/start.png", MediaLimits(fetch_timeout_s=5)).size == (8, 6)
    assert len(requests) == 2


def test_a_redirect_to_a_port_out_of_range_is_an_image_error(raw_server):
    """A Location with a port out of range was a 500 (anyio's OverflowError in an exception group; hunt 210)."""
    bad = raw_server(lambda conn: conn.sendall(b"HTTP/1.1 302 Found\r\nLocation: http://127.0.0.1:99999/a.png\r\n"
                                               b"Content-Length: 0\r\nConnection: close\r\n\r\n"))
    with pytest.raises(ImageError, match=r"redirects to http://127.0.0.1:99999/a.png, which is not a valid URL"):
        load_image(bad, MediaLimits(fetch_timeout_s=5))


@pytest.fixture
def fresh_tls_context() -> Iterator[None]:
    """`images._tls_context` made anew in the test and after it (it is made once per process)."""
    from hybridcache.images import _tls_context

    _tls_context.cache_clear()
    yield
    _tls_context.cache_clear()


def _tls_files(folder) -> tuple[str, str, str]:
    """A self-signed CA and a certificate for 127.0.0.1 it signed: (CA pem, server cert pem, server key pem)."""
    import datetime
    import ipaddress

    x509 = pytest.importorskip("cryptography.x509")
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def certificate(subject: str, key, issuer: str, issuer_key, ca: bool, san=None):
        builder = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME,
                                                                                        subject)]))
                   .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(days=1)).not_valid_after(now + datetime.timedelta(days=2))
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if ca:
            builder = builder.add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False),
                                            critical=True)
            builder = builder.add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                                            critical=False)
        else:
            builder = builder.add_extension(san, critical=False).add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key.public_key()), critical=False)
        return builder.sign(issuer_key, hashes.SHA256())

    ca_key, server_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = certificate("hybridcache test CA", ca_key, "hybridcache test CA", ca_key, True)
    server = certificate("127.0.0.1", server_key, "hybridcache test CA", ca_key, False,
                         x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]))
    paths = (folder / "ca.pem", folder / "server.pem", folder / "server.key")
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(server.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(server_key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                  serialization.NoEncryption()))
    return tuple(str(path) for path in paths)


def test_https_urls_trust_the_system_ca_store(tmp_path, monkeypatch, fresh_tls_context):
    """The system's default TLS context, as urllib's (a CA installed with update-ca-certificates is trusted; OpenSSL
    reads SSL_CERT_FILE itself), not httpx's certifi-only one."""
    import ssl

    ca, cert, key = _tls_files(tmp_path)
    listener = socket.create_server(("127.0.0.1", 0))
    server_context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_context.load_cert_chain(cert, key)
    body = png(8, 6)

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            try:
                with server_context.wrap_socket(conn, server_side=True) as tls:
                    tls.recv(65536)
                    png_answer(body)(tls)
            except OSError:  # (a client that refused the certificate)
                pass

    threading.Thread(target=serve, daemon=True).start()
    calls: list[tuple] = []
    default_context = ssl.create_default_context

    def recording(*args, **kwargs):
        calls.append((args, kwargs))
        return default_context(*args, **kwargs)

    monkeypatch.setattr(ssl, "create_default_context", recording)
    monkeypatch.setenv("SSL_CERT_FILE", ca)
    monkeypatch.delenv("SSL_CERT_DIR", raising=False)
    for name in ("https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)
    try:
        url = f"https://127.0.0.1:{listener.getsockname()[1]}/cat.png"
        assert load_image(url, MediaLimits(fetch_timeout_s=5)).size == (8, 6)
        assert calls == [((), {})], calls  # the system default context: no CA file of its own (certifi's)
    finally:
        listener.close()


def test_the_server_loop_default_executor_is_large_and_not_joined_at_shutdown():
    """The app's startup gives its event loop a default executor (on which anyio resolves image URLs' hosts) of
    more threads than asyncio's min(32, cpus + 4), whose shutdown does not wait for them: a DNS server that never
    answers held them all, starving other fetches, and asyncio.run joined them past --shutdown-timeout."""
    from types import SimpleNamespace

    from hybridcache.server.app import ServedModel, build_app
    from hybridcache.server.config import ServerConfig

    engine_loop = SimpleNamespace(start=lambda: None, stop=lambda: None, running=True, healthy=True,
                                  last_error=None, state=None)
    app = build_app(engine_loop, ServedModel(tokenizer=None, max_model_len=64), ServerConfig(), metrics=None)
    release = threading.Event()
    answers: list[int] = []

    async def serve() -> None:
        async with app.router.lifespan_context(app):
            loop = asyncio.get_running_loop()
            for _ in range(60):  # as many lookups of a DNS server that never answers (asyncio's pool: <= 32)
                loop.run_in_executor(None, release.wait, 30)
            with contextlib.suppress(asyncio.TimeoutError):
                answers.append(await asyncio.wait_for(loop.run_in_executor(None, sum, (1, 2)), 2))

    releaser = threading.Timer(8, release.set)  # (before the fix, asyncio.run waited for the blocked jobs)
    releaser.start()
    start = time.monotonic()
    try:
        asyncio.run(serve())
        took = time.monotonic() - start
    finally:
        releaser.cancel()
        release.set()
    assert answers == [3], "another job waited behind the blocked ones"
    assert took < 5, f"the loop's shutdown waited {took:.1f} s for its default executor's jobs"


@pytest.mark.parametrize("url", ["http://127.0.0.1:99999/a.png", "http://[::1/a.png"], ids=["port", "ipv6"])
def test_a_url_that_cannot_be_parsed_is_an_image_error(url):
    """A port out of range failed deep in anyio (an ExceptionGroup: a 500), an unclosed IPv6 address in urllib (a
    bare ValueError from `fetch_urls`: a 500 too)."""
    with pytest.raises(ImageError, match="is not a valid URL"):
        asyncio.run(fetch_urls([url], MediaLimits(fetch_timeout_s=2)))
    with pytest.raises(ImageError, match="is not a valid URL"):
        load_image(url, MediaLimits(fetch_timeout_s=2))
