"""Start a real `hybridcache serve` process on a free loopback port and stop it, whatever happens."""

from __future__ import annotations

import collections
import contextlib
import os
import random
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


# `free_port` picks a port below the kernel's ephemeral range, where no `bind(port 0)` or `connect()` of any process
# takes a port while the server that was handed it starts (one did: a data-parallel replica found its --port + 2
# taken). The ports are seen as blocks of PORT_BLOCK: a port handed out lies in its block's first half and the
# REPLICA_ROOM ports from it are free, room for the replicas of `--data-parallel-size` (--port + 1 ... + N, N < 8).
# Under pytest-xdist (`-n N`) each worker takes its own share of the blocks, so that two workers never get one
# port; within a process the ports of the last RECENT hand-outs are not handed out again. (Where the ephemeral range
# is unknown: a port the kernel picks.)
PORT_BLOCK = 16
REPLICA_ROOM = PORT_BLOCK // 2
LOWEST_PORT = 10000
RECENT = 64
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_handed_out: collections.deque[int] = collections.deque(maxlen=RECENT)


def _worker_share() -> tuple[int, int]:
    """(this pytest-xdist worker's index, the number of workers); (0, 1) outside xdist."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER", ""), os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if not (worker.startswith("gw") and worker[2:].isdigit() and count.isdigit()):
        return 0, 1
    return int(worker[2:]), int(count)


def port_blocks() -> range:
    """The blocks (port // PORT_BLOCK) from LOWEST_PORT up to the ephemeral range; empty where it is unknown."""
    try:
        ephemeral_low = int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return range(0)
    return range(-(-LOWEST_PORT // PORT_BLOCK), ephemeral_low // PORT_BLOCK)


def _all_free(ports: range) -> bool:
    """Whether every port of `ports` can be bound on loopback now (no socket holds it, TIME_WAIT included)."""
    with contextlib.ExitStack() as stack:
        for port in ports:
            sock = stack.enter_context(socket.socket())
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                return False
    return True


def free_port() -> int:
    """A port below the ephemeral range in this pytest-xdist worker's share of the blocks (any block outside xdist),
    in its block's first half, whose REPLICA_ROOM ports from it are free now and far from the last RECENT hand-outs;
    where that range is unknown, a port the kernel picks."""
    index, count = _worker_share()
    blocks = [block for block in port_blocks() if block % count == index]
    for _ in range(1000 if blocks else 0):
        port = random.choice(blocks) * PORT_BLOCK + random.randrange(PORT_BLOCK - REPLICA_ROOM)
        if all(abs(port - other) >= REPLICA_ROOM for other in _handed_out) and _all_free(
                range(port, port + REPLICA_ROOM)):
            _handed_out.append(port)
            return port
    if blocks:
        raise RuntimeError(f"no {REPLICA_ROOM} free ports together below the ephemeral range in 1000 tries (xdist "
                           f"worker {index} of {count})")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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
