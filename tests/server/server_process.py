"""Start a real `hybridcache serve` process on a free loopback port and stop it, whatever happens."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
# Small engine settings keep the built-in model fast on 2 cores.
SMALL_ENGINE = ("--block-size", "16", "--max-model-len", "512", "--num-blocks", "2048")


@dataclass
class ServerProcess:
    process: subprocess.Popen
    port: int
    log_path: Path

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


# Under pytest-xdist (`-n N`) every worker takes its ports from its own share of blocks of PORT_BLOCK ports: a port
# that one worker's `free_port` returned is free until its server binds it, and must not be handed to another
# worker meanwhile; the block holds the replicas' ports of `--data-parallel-size` (--port + 1 ... + N, N < 8) too.
PORT_BLOCK = 16


def _worker_share() -> tuple[int, int]:
    """(this pytest-xdist worker's index, the number of workers); (0, 1) outside xdist."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER", ""), os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if not (worker.startswith("gw") and worker[2:].isdigit() and count.isdigit()):
        return 0, 1
    return int(worker[2:]), int(count)


def free_port() -> int:
    """A loopback port that no socket holds now. Under pytest-xdist: one of this worker's blocks, in the block's
    first half (the data-parallel replicas' ports above it stay in the block)."""
    index, count = _worker_share()
    for _ in range(1000):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        block, offset = divmod(port, PORT_BLOCK)
        if count == 1 or (block % count == index and offset < PORT_BLOCK // 2):
            return port
    raise RuntimeError(f"no free port of xdist worker {index} of {count} in 1000 tries")


@contextlib.contextmanager
def running_servers(*arg_lists: tuple[str, ...], tmp_dir: Path,
                    startup_timeout_s: float = 90.0) -> Iterator[list[ServerProcess]]:
    """Start `hybridcache serve --port P *args` for every arg list at once (this session's HYBRIDCACHE_HOME);
    yields once every /health answers 200; kills every process on exit."""
    servers: list[ServerProcess] = []
    try:
        for args in arg_lists:
            port = free_port()
            log_path = tmp_dir / f"server-{port}.log"
            command = [sys.executable, "-m", "hybridcache.cli", "serve", "--port", str(port),
                       "--log-level", "warning", *args]
            with open(log_path, "wb") as log:
                process = subprocess.Popen(command, cwd=REPO, env=dict(os.environ), stdout=log,
                                           stderr=subprocess.STDOUT)
            servers.append(ServerProcess(process, port, log_path))
        deadline = time.monotonic() + startup_timeout_s
        for server in servers:
            _wait_ready(server, deadline)
        yield servers
    finally:
        for server in servers:
            if server.process.poll() is None:
                server.process.send_signal(signal.SIGKILL)
            server.process.wait(timeout=30)


@contextlib.contextmanager
def running_server(*args: str, tmp_dir: Path) -> Iterator[ServerProcess]:
    """One server; see `running_servers`."""
    with running_servers(args, tmp_dir=tmp_dir) as servers:
        yield servers[0]


def _wait_ready(server: ServerProcess, deadline: float) -> None:
    while True:
        if server.process.poll() is not None:
            raise RuntimeError(f"the server exited with {server.process.returncode}:\n{server.log()}")
        try:
            if httpx.get(f"{server.base_url}/health", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"the server did not start in time:\n{server.log()}")
        time.sleep(0.1)


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def metric_value(text: str, name: str, labels: str = "") -> float:
    """The sum of `name`'s samples whose labels include `labels` (e.g. 'reason="prefill_end"') in a Prometheus
    text exposition (0 when absent). Every sample also carries `model_name`, which a caller need not name."""
    wanted = {pair for pair in labels.split(",") if pair}
    total = 0.0
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        sample, _, label_text = key.partition("{")
        if sample == name and wanted <= set(label_text.rstrip("}").split(",")):
            total += float(value)
    return total
