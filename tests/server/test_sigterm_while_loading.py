"""SIGTERM while `serve` loads its model ends it (as vLLM's setup_server interrupts on SIGTERM while initializing):
as PID 1 of a container (no init) a signal left at its default action is ignored, so a pod deleted during the load
went on loading, started serving and waited for the SIGKILL at the end of its grace period (hunt 196). A process
that is not PID 1 was killed outright (status -15, no clean-up); now it exits 0 with a log line either way."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from hybridcache.models.builtin import ensure_builtin_model
from tests.server.server_process import REPO, free_port

# `hybridcache serve ...` whose model load takes a minute (it says when it has begun)
SLOW_LOAD = """
import sys, time
import hybridcache.server.cli as server_cli
real = server_cli.build_server
def slow(args):
    print("loading", flush=True)
    time.sleep(60)
    return real(args)
server_cli.build_server = slow
from hybridcache.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_sigterm_while_the_model_loads_ends_serve_cleanly():
    ensure_builtin_model()
    command = [sys.executable, "-c", SLOW_LOAD, "serve", "--device", "cpu", "--port", str(free_port())]
    process = subprocess.Popen(command, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline().strip() == "loading"
        started = time.monotonic()
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
        assert time.monotonic() - started < 10
        assert "interrupted while starting" in process.stderr.read()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
