"""The `serve` process's life before and around its engine (found by a bug hunt of the server's lifecycle): the
socket is bound before the model loads (a busy port or a host that cannot be bound is refused at once, naming it),
HTTPS files are loaded before the model loads (refused naming both), `GET /load` counts under `--root-path`, and
vLLM's `--disable-uvicorn-access-log` and `--uds PATH` are taken."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from hybridcache.cli import build_parser, main
from hybridcache.server.app import LoadCounting, ServerLoad
from hybridcache.server.uvicorn_server import listen_socket
from hybridcache.server.vllm_flags import check_vllm_args, uvicorn_options
from tests.server.server_process import REPO, SMALL_ENGINE


def self_signed_pair(folder: Path, name: str = "server") -> tuple[str, str]:
    """A fresh key and self-signed certificate for 127.0.0.1 (PEM files in `folder`): (key path, cert path)."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make a self-signed certificate")
    key, cert = folder / f"{name}.key", folder / f"{name}.crt"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1"],
                   check=True, capture_output=True)
    return str(key), str(cert)


@pytest.fixture
def no_model_load(monkeypatch):
    """`serve` fails the test if it gets as far as resolving (loading) its model."""
    def loaded(*args, **kwargs):
        raise AssertionError("the model was loaded first")

    monkeypatch.setattr("hybridcache.model_path.resolve_model", loaded)
    monkeypatch.setattr("hybridcache.server.log_limits.install", lambda: None)


# ------------------------------------------------------------------------------------ bind first
def test_a_busy_port_or_an_unbindable_host_is_refused_before_the_model_loads(no_model_load, capsys):
    """It was found once the whole model had loaded, by uvicorn (exit status 3, and the interpreter's teardown
    printed 31 lines of nanobind leak warnings); vLLM binds the socket before it builds the engine."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["serve", "--port", str(port)]) == 2
        err = capsys.readouterr().err
        assert f"hybridcache: error: cannot listen on 127.0.0.1:{port}: Address already in use" in err
    assert main(["serve", "--host", "no-such-host.invalid", "--port", "0"]) == 2
    assert "hybridcache: error: cannot listen on no-such-host.invalid:0: " in capsys.readouterr().err


def test_listen_socket_binds_without_listening_and_takes_ipv6_and_unix_sockets(tmp_path):
    sock = listen_socket("127.0.0.1", 0)
    with sock, pytest.raises(OSError):  # bound, not listening: a client is refused until uvicorn listens
        socket.create_connection(sock.getsockname(), timeout=2)
    with contextlib.suppress(OSError), listen_socket("::1", 0) as six:  # (unless the machine has no IPv6 loopback)
        assert six.family == socket.AF_INET6
    path = str(tmp_path / "s.sock")
    with listen_socket("ignored", 0, path) as unix:
        assert unix.family == socket.AF_UNIX and Path(path).is_socket()
        with pytest.raises(OSError, match=f"cannot listen on unix socket {path}"):
            listen_socket("ignored", 0, path)


# ------------------------------------------------------------------------------------ HTTPS files
def test_https_files_that_do_not_load_are_refused_naming_both_before_the_model_loads(no_model_load, tmp_path,
                                                                                     capsys):
    """A mistyped --ssl-certfile failed once the model had loaded, in uvicorn, with a message naming no file."""
    missing = ["--ssl-keyfile", "/etc/nope/server.key", "--ssl-certfile", "/etc/nope/server.crt"]
    assert main(["serve", "--port", "0", *missing]) == 2
    err = capsys.readouterr().err
    assert "hybridcache: error: --ssl-certfile '/etc/nope/server.crt' with --ssl-keyfile '/etc/nope/server.key'" \
           in err and "No such file or directory" in err
    key, cert = self_signed_pair(tmp_path)
    other_key, _ = self_signed_pair(tmp_path, "other")
    parse = build_parser().parse_args
    check_vllm_args(parse(["serve", "--ssl-keyfile", key, "--ssl-certfile", cert]))
    for wrong in (["--ssl-keyfile", other_key, "--ssl-certfile", cert], ["--ssl-keyfile", cert, "--ssl-certfile", key]):
        with pytest.raises(ValueError, match="not a PEM certificate and its private key"):
            check_vllm_args(parse(["serve", *wrong]))


# ------------------------------------------------------------------------------------ /load under --root-path
def test_load_counts_generation_requests_under_a_root_path():
    """uvicorn puts --root-path before the request's path; the count compared the whole path, so GET /load stayed
    0 while generation ran (found by a bug hunt)."""
    load = ServerLoad()
    during: list[int] = []

    async def app(scope, receive, send):
        during.append(load.num_requests)

    counting = LoadCounting(app, load)

    async def run() -> None:
        for path in ("/api/v1/completions", "/api/v1/chat/completions", "/api/v1/responses", "/api/health"):
            await counting({"type": "http", "method": "POST", "path": path, "root_path": "/api"}, None, None)
        await counting({"type": "http", "method": "POST", "path": "/v1/completions", "root_path": ""}, None, None)

    asyncio.run(run())
    assert during == [1, 1, 1, 0, 1] and load.num_requests == 0


# ------------------------------------------------------------------------------------ vLLM's flags
def test_disable_uvicorn_access_log_and_uds_are_taken():
    parse = build_parser().parse_args
    assert uvicorn_options(parse(["serve", "--disable-uvicorn-access-log"]))["access_log"] is False
    assert uvicorn_options(parse(["serve", "--enable-access-log"]))["access_log"] is True
    assert uvicorn_options(parse(["serve", "--enable-access-log", "--disable-uvicorn-access-log"]))["access_log"] \
        is False
    assert uvicorn_options(parse(["serve", "--uds", "/run/s.sock"]))["uds"] == "/run/s.sock"


def test_serve_on_a_unix_socket_under_a_root_path_counts_load_and_logs_no_access(tmp_path):
    """The real server: `--uds PATH` serves there (the socket is removed at exit), `--disable-uvicorn-access-log`
    wins over `--enable-access-log`, and GET /load counts a request in flight under `--root-path`."""
    path = tmp_path / "serve.sock"
    log_path = tmp_path / "server.log"
    command = [sys.executable, "-m", "hybridcache.cli", "serve", "--uds", str(path), "--root-path", "/api",
               "--enable-access-log", "--disable-uvicorn-access-log", *SMALL_ENGINE]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    client = httpx.Client(transport=httpx.HTTPTransport(uds=str(path)), base_url="http://serve", timeout=60)
    try:
        deadline = time.monotonic() + 90
        while True:
            assert process.poll() is None, log_path.read_text()
            try:
                if client.get("/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.1)
        worker = threading.Thread(target=lambda: client.post("/v1/completions", json={
            "prompt": "hi", "max_tokens": 200, "ignore_eos": True}))
        worker.start()
        seen = set()
        while worker.is_alive():
            seen.add(client.get("/load").json()["server_load"])
            time.sleep(0.02)
        assert 1 in seen
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
        assert not path.exists()
        log_text = log_path.read_text()
        assert "unix socket" in log_text and '"GET /load' not in log_text, log_text
    finally:
        client.close()
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)


def test_a_unix_socket_a_live_server_listens_on_is_refused_and_a_stale_one_replaced(tmp_path):
    """`--uds` removed any socket file at its path: a second server took over a live one's socket (its clients cut
    off, nothing said). A live one is refused now, as vLLM's; a stale one (nobody listens) is still replaced."""
    from hybridcache.server.uvicorn_server import remove_stale_socket

    path = str(tmp_path / "hc.sock")
    live = listen_socket("", 0, path)
    live.listen()
    with pytest.raises(OSError, match=f"cannot listen on unix socket {path}: a server is listening on it"):
        remove_stale_socket(path)
    assert Path(path).exists()
    live.close()  # the server ended without removing its socket: stale
    remove_stale_socket(path)
    assert not Path(path).exists()
    listen_socket("", 0, path).close()


def test_a_port_another_server_listened_on_first_is_refused_after_a_clean_shutdown():
    """Two servers binding one port at once both bind (SO_REUSEADDR); the one that listens second failed with raw
    tracebacks and no application shutdown. It now shuts its application down and says `cannot listen on`."""
    import uvicorn

    from hybridcache.server.uvicorn_server import Server

    events = []

    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                events.append(message["type"])
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                else:
                    await send({"type": "lifespan.shutdown.complete"})
                    return

    first = listen_socket("127.0.0.1", 0)
    port = first.getsockname()[1]
    second = listen_socket("127.0.0.1", port)  # (both bound: neither listens yet)
    first.listen()
    try:
        server = Server(uvicorn.Config(app, lifespan="on", log_level="critical"))
        with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{port}"):
            asyncio.run(server.serve(sockets=[second]))
        assert events == ["lifespan.startup", "lifespan.shutdown"]
    finally:
        first.close()
        second.close()
