"""A tensor-parallel engine fails loudly, not by hanging: a killed worker makes the engine raise an error
naming its rank within seconds; and its workers go away when the engine's process exits or gets SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from hybridcache.config import EngineConfig
from hybridcache.distributed.executor import WorkerError
from hybridcache.engine.engine import LLMEngine
from hybridcache.sampling import SamplingParams

from .folders import write_folder

REPO = Path(__file__).resolve().parents[2]


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in status


def wait_gone(pids: tuple[int, ...], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while any(alive(pid) for pid in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_folder(tmp_path_factory.mktemp("qwen3_next"), "qwen3_next")


def test_a_killed_worker_makes_the_engine_raise_naming_its_rank(model_dir):
    engine = LLMEngine(model_dir, EngineConfig(block_size=16, kernel_block_size=8, max_num_seqs=4,
                                               tensor_parallel_size=2))
    (pid,) = engine.runner.worker_pids
    try:
        for i in range(4):
            engine.add_request(f"r{i}", list(range(1, 30 + i)), SamplingParams(max_tokens=2000, ignore_eos=True))
        for _ in range(3):
            engine.step()
        killed_at = []

        def kill() -> None:
            killed_at.append(time.monotonic())
            os.kill(pid, signal.SIGKILL)

        threading.Timer(0.2, kill).start()  # while the engine is stepping
        deadline = time.monotonic() + 60
        with pytest.raises(WorkerError, match=r"worker rank 1 \(pid \d+\) died \(killed by signal 9\)"):
            while time.monotonic() < deadline:
                engine.step()
        assert time.monotonic() - killed_at[0] < 10
        with pytest.raises(WorkerError, match="failed earlier"):  # broken for good, not hanging
            engine.step()
    finally:
        engine.runner.shutdown()
    assert not alive(pid)


def run_driver(model_dir: Path, then: str) -> tuple[subprocess.Popen, tuple[int, ...]]:
    """A process that starts a 2-rank engine, prints its workers' pids, then runs `then`."""
    script = (
        "from hybridcache.config import EngineConfig\n"
        "from hybridcache.engine.engine import LLMEngine\n"
        f"engine = LLMEngine({str(model_dir)!r}, EngineConfig(max_num_seqs=2, tensor_parallel_size=2))\n"
        "print(*engine.runner.worker_pids, flush=True)\n"
        f"{then}\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    process = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env, cwd=REPO)
    pids = tuple(int(p) for p in process.stdout.readline().split())
    assert pids and all(alive(pid) for pid in pids)
    return process, pids


@pytest.mark.slow
def test_workers_exit_with_the_engine_process(model_dir):
    process, pids = run_driver(model_dir, "import sys; sys.exit(0)")
    assert process.wait(30) == 0
    assert wait_gone(pids, 10)


@pytest.mark.slow
def test_workers_exit_when_the_engine_process_gets_sigterm(model_dir):
    process, pids = run_driver(model_dir, "import time; time.sleep(600)")
    process.send_signal(signal.SIGTERM)
    process.wait(30)
    assert wait_gone(pids, 10)
