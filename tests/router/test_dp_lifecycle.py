"""`serve --data-parallel-size N`'s process lifecycle (found by a bug hunt): SIGTERM ends the router and the
replicas within --shutdown-timeout (the router waited for every request in flight, then for each replica in turn),
the replicas' cut streams reach the client with their final error event, and no replica outlives the parent
process (SIGTERM while they start, or SIGKILL, left them running with ppid 1)."""

from __future__ import annotations

import http.server
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import uvicorn

from hybridcache.cli import build_parser
from hybridcache.models.builtin import ensure_builtin_model
from hybridcache.router import cli as router_cli
from hybridcache.server.uvicorn_server import Server, inherited_socket, listen_socket
from tests.router.serving import wait_until
from tests.server.server_process import REPO, free_port

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc; PR_SET_PDEATHSIG")

# `hybridcache serve ...` whose replicas are sleepers that never answer /health (so it stays starting)
STARTING = """
import subprocess, sys
real = subprocess.Popen
subprocess.Popen = lambda command, **kwargs: real([sys.executable, "-c", "import time; time.sleep(120)"], **kwargs)
from hybridcache.cli import main
sys.exit(main(sys.argv[1:]))
"""


def children(pid: int) -> list[int]:
    """The pids whose parent is `pid`."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def running(pid: int) -> bool:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_no_replica_outlives_the_parent_signalled_while_they_start(sig):
    """SIGTERM: the parent ends its replicas and exits 0 (SIGTERM had its default handler until uvicorn's, so the
    `finally` that ends them never ran); SIGKILL: the replicas get SIGTERM from the kernel (PR_SET_PDEATHSIG)."""
    command = [sys.executable, "-c", STARTING, "serve", "--data-parallel-size", "2", "--device", "cpu", "--port",
               str(free_port()), "--log-level", "warning"]
    parent = subprocess.Popen(command, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    replicas: list[int] = []

    def started() -> bool:
        replicas[:] = children(parent.pid)
        return len(replicas) == 2

    try:
        assert wait_until(started, 60)
        parent.send_signal(sig)
        assert parent.wait(timeout=30) == (0 if sig == signal.SIGTERM else -signal.SIGKILL)
        assert wait_until(lambda: not any(running(pid) for pid in replicas), 10), "a replica outlived its parent"
    finally:
        for pid in [parent.pid, *replicas]:
            if running(pid):
                os.kill(pid, signal.SIGKILL)
        parent.wait(timeout=30)


def test_replicas_end_together_against_one_deadline(tmp_path):
    """SIGTERM to every replica at once, then SIGKILL to those left at the one deadline (they were waited for in
    turn, up to 30 s each, after the router had waited for every request in flight)."""
    stubborn = ("import pathlib, signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                "pathlib.Path(sys.argv[1]).touch(); time.sleep(60)")
    obedient = "import pathlib, sys, time; pathlib.Path(sys.argv[1]).touch(); time.sleep(60)"
    replicas = router_cli.Replicas(wait_s=1.0)
    for i, script in enumerate((stubborn, stubborn, obedient)):
        replicas.start([sys.executable, "-c", script, str(tmp_path / str(i))], os.environ)
    try:
        assert wait_until(lambda: len(list(tmp_path.iterdir())) == 3, 30)
        started = time.monotonic()
        replicas.terminate()
        assert replicas.processes[2].wait(timeout=5) == -signal.SIGTERM  # at once, not after the others
        replicas.end()
        assert 0.9 < time.monotonic() - started < 2.5
        assert [p.returncode for p in replicas.processes] == [-signal.SIGKILL, -signal.SIGKILL, -signal.SIGTERM]
    finally:
        for process in replicas.processes:
            if process.poll() is None:
                process.kill()
                process.wait()


def test_replicas_get_one_sigterm_and_with_a_disk_tier_no_deadline(tmp_path):
    """A replica in its disk hand-off (after its server stopped, SIGTERM back to its default) was killed by the
    second SIGTERM `end` sent after `terminate`, or by SIGKILL at the deadline, which the hand-off is not bounded by
    (hunt 180: a restarted serve --data-parallel-size missed what a single serve kept). Now each replica gets SIGTERM
    once, and with `hand_off` `end` waits for them to finish."""
    counting = ("import pathlib, signal, sys, time; out = pathlib.Path(sys.argv[1]); "
                "signal.signal(signal.SIGTERM, lambda *a: out.write_text(out.read_text() + 'T')); "
                "out.write_text(''); deadline = time.monotonic() + 1.5\n"
                "while time.monotonic() < deadline: time.sleep(0.02)")
    replicas = router_cli.Replicas(wait_s=0.2, hand_off=True)
    for i in range(2):
        replicas.start([sys.executable, "-c", counting, str(tmp_path / str(i))], os.environ)
    try:
        assert wait_until(lambda: len(list(tmp_path.iterdir())) == 2, 30)
        replicas.terminate()
        time.sleep(0.1)
        replicas.end()  # past wait_s: with a hand-off, no SIGKILL; each exits by itself, signalled once
        assert [p.returncode for p in replicas.processes] == [0, 0]
        assert [(tmp_path / str(i)).read_text() for i in range(2)] == ["T", "T"]
    finally:
        for process in replicas.processes:
            if process.poll() is None:
                process.kill()
                process.wait()


def test_the_router_drains_for_the_shutdown_timeout_and_signals_the_replicas_as_its_shutdown_begins(monkeypatch):
    """`router --shutdown-timeout T` (new) and `serve --data-parallel-size N --shutdown-timeout T`: the router's
    graceful shutdown lasts T less serve's reserve (it had none: uvicorn waited for every request in flight); the
    replicas get SIGTERM as it begins, and a shorter timeout, so that their cut streams pass through the router."""
    ensure_builtin_model()
    monkeypatch.setattr("hybridcache.server.log_limits.install", lambda: None)
    seen = {}

    def served(server, sockets=None):
        for sock in sockets or ():
            sock.close()
        seen["server"] = server

    with monkeypatch.context() as patch:
        patch.setattr("hybridcache.server.uvicorn_server.Server.run", served)
        for argv, wanted in ((["--shutdown-timeout", "3"], 2.5), ([], 9.5)):
            args = build_parser().parse_args(["router", "--replica", "http://r:1", *argv])
            router_cli.run_router(args, ["http://127.0.0.1:1"], None, "127.0.0.1", 0)
            assert seen["server"].config.timeout_graceful_shutdown == wanted

    class Started:  # a replica process that is up at once
        pid, returncode = 1, None

        def poll(self):
            return self.returncode

        def terminate(self):
            self.returncode = -signal.SIGTERM

    commands, started = [], []
    monkeypatch.setattr(router_cli.subprocess, "Popen", lambda command, env, preexec_fn, pass_fds:
                        commands.append(command) or started.append(Started()) or started[-1])
    monkeypatch.setattr(httpx, "get", lambda url, timeout: httpx.Response(200))
    monkeypatch.setattr("hybridcache.server.uvicorn_server.listen_socket", lambda host, port, uds=None: socket.socket())

    def router(args, urls, model, host, port, timeout_s, sock, on_shutdown):
        assert [p.returncode for p in started] == [None, None]
        on_shutdown()  # (the router's Server calls it as its shutdown begins)
        seen["at_shutdown"] = [p.returncode for p in started]

    monkeypatch.setattr(router_cli, "run_router", router)
    argv = ["serve", "--data-parallel-size", "2", "--device", "cpu", "--shutdown-timeout", "3"]
    assert router_cli.serve_data_parallel(build_parser().parse_args(argv), argv) == 0
    assert seen["at_shutdown"] == [-signal.SIGTERM, -signal.SIGTERM]
    assert all(command[-2:] == ["--shutdown-timeout", "2.5"] for command in commands)


def test_the_server_calls_on_shutdown_as_its_shutdown_begins():
    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            await receive()  # lifespan.startup
            await send({"type": "lifespan.startup.complete"})
            await receive()  # lifespan.shutdown
            calls.append("lifespan shutdown")
            await send({"type": "lifespan.shutdown.complete"})

    calls: list[str] = []
    sock = listen_socket("127.0.0.1", 0)
    server = Server(uvicorn.Config(app, log_level="warning", lifespan="on"), on_shutdown=lambda: calls.append("on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    assert wait_until(lambda: server.started, 30)
    server.should_exit = True
    thread.join(timeout=30)
    assert calls == ["on", "lifespan shutdown"]


def _stream(url: str, out: dict) -> None:
    body = {"prompt": "hi", "max_tokens": 3000, "ignore_eos": True, "stream": True}
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    out.setdefault("events", []).append(line[6:])
    except httpx.HTTPError as error:
        out["error"] = error


@pytest.mark.slow
def test_sigterm_ends_the_router_and_its_replicas_within_the_shutdown_timeout(tmp_path):
    """The real thing: `serve --data-parallel-size 2 --shutdown-timeout 3` with a long stream through the router.
    SIGTERM: the stream ends with the replica's final error event and [DONE], the process is gone within 3 s, and
    so are the replicas (it took 21-62 s: the router waited for the stream to finish)."""
    port = free_port()
    log_path = tmp_path / "dp.log"
    command = [sys.executable, "-m", "hybridcache.cli", "serve", "--data-parallel-size", "2", "--port", str(port),
               "--block-size", "16", "--max-model-len", "4096", "--num-blocks", "512", "--shutdown-timeout", "3"]
    with open(log_path, "wb") as log:
        parent = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    replicas: list[int] = []
    try:
        def healthy() -> bool:
            assert parent.poll() is None, log_path.read_text()
            try:
                return httpx.get(f"{url}/health", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        assert wait_until(healthy, 240), log_path.read_text()
        replicas = children(parent.pid)
        out: dict = {}
        streaming = threading.Thread(target=_stream, args=(url, out))
        streaming.start()
        assert wait_until(lambda: len(out.get("events", [])) > 5, 60)
        signalled = time.monotonic()
        parent.send_signal(signal.SIGTERM)
        assert parent.wait(timeout=30) == 0
        assert time.monotonic() - signalled < 3.5, log_path.read_text()
        streaming.join(timeout=30)
        assert out["events"][-1] == "[DONE]" and "shut down" in json.loads(out["events"][-2])["error"]["message"]
        assert len(replicas) == 2 and not any(running(pid) for pid in replicas)
    finally:
        for pid in [parent.pid, *replicas]:
            if running(pid):
                os.kill(pid, signal.SIGKILL)
        parent.wait(timeout=30)


def test_a_replica_port_in_use_is_an_error_not_another_server_adopted():
    """Another server on a replica's port (--port + 1): replica 0 could not bind it and exited, while the parent's
    wait for /health took the other server's 200 for replica 0's and routed requests to it (hunt 180). Now the
    parent binds every replica's port before any replica starts, and a taken one ends it at once, named."""
    port = free_port()

    class Other(http.server.BaseHTTPRequestHandler):  # answers 200 to everything, as another serve's /health
        def do_GET(self):
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    other = http.server.HTTPServer(("127.0.0.1", port + 1), Other)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    command = [sys.executable, "-c", STARTING, "serve", "--data-parallel-size", "2", "--device", "cpu", "--port",
               str(port), "--log-level", "warning"]
    try:
        done = subprocess.run(command, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True,
                              text=True, timeout=90)
    finally:
        other.shutdown()
        other.server_close()
    assert done.returncode == 2
    assert f"cannot listen on 127.0.0.1:{port + 1}" in done.stderr and "replica 0's port" in done.stderr


def test_a_replica_serves_on_the_socket_its_parent_bound(tmp_path):
    """`Replicas.start` hands the replica its bound socket (`inherited_socket` in the replica) and closes its own
    copy: the replica accepts on it, and once the replica has ended the port is closed, not held by the parent."""
    sock = listen_socket("127.0.0.1", 0)
    sock.listen()
    port = sock.getsockname()[1]
    child = ("from hybridcache.server.uvicorn_server import inherited_socket\n"
             "sock = inherited_socket()\nconnection, _ = sock.accept()\nconnection.sendall(b'replica')\n"
             "connection.close()")
    replicas = router_cli.Replicas(wait_s=1.0)
    replicas.start([sys.executable, "-c", child], {**os.environ, "PYTHONPATH": str(REPO)}, sock)
    try:
        assert sock.fileno() == -1  # the parent's copy is closed
        with socket.create_connection(("127.0.0.1", port), timeout=30) as client:
            client.settimeout(30)
            assert client.recv(16) == b"replica"
        assert replicas.processes[0].wait(timeout=30) == 0
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=5)
    finally:
        replicas.end()
    assert inherited_socket() is None  # no descriptor handed to this process
