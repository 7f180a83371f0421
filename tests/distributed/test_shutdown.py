"""The workers of a tensor-parallel engine go away when the engine's process exits or gets SIGTERM, or when its
`LLM` is closed (a killed worker: `test_tensor_parallel.py`); on the CPU rank 0 gets back its share of the threads
when its executor shuts down."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hybridcache import LLM, SamplingParams
from hybridcache.config import EngineConfig
from hybridcache.engine.engine import EngineDeadError, LLMEngine

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


@pytest.mark.slow
def test_closing_an_llm_stops_its_workers_so_the_next_one_can_start(model_dir):
    """`LLM` had no close(): a second tensor-parallel engine in one process raised until the user reached
    `llm.engine.runner.shutdown()`. Closing (here: leaving the `with` block) stops the workers and leaves the
    process group."""
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with LLM(model_dir, tensor_parallel_size=2, max_num_seqs=2, max_model_len=128) as llm:
        first = llm.generate("close me", params, use_tqdm=False)[0].outputs[0].token_ids
        pids = llm.engine.runner.worker_pids
        assert all(alive(pid) for pid in pids)
    assert wait_gone(pids, 10)
    with pytest.raises(EngineDeadError, match="closed"):
        llm.generate("close me", params, use_tqdm=False)
    with LLM(model_dir, tensor_parallel_size=2, max_num_seqs=2, max_model_len=128) as again:
        assert again.generate("close me", params, use_tqdm=False)[0].outputs[0].token_ids == first


@pytest.mark.slow
def test_a_tensor_parallel_llm_starts_from_a_script_read_on_stdin(model_dir):
    """Spawned workers re-run the parent's __main__ from its file: '<stdin>' used to kill them with
    FileNotFoundError."""
    script = (
        "from hybridcache import LLM, SamplingParams\n"
        f"with LLM({str(model_dir)!r}, tensor_parallel_size=2, max_num_seqs=2, max_model_len=128) as llm:\n"
        "    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)\n"
        "    out = llm.generate('stdin', params, use_tqdm=False)\n"
        "print('tokens', len(out[0].outputs[0].token_ids), flush=True)\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-"], input=script, capture_output=True, text=True, env=env, cwd=REPO,
                          timeout=300)
    assert done.returncode == 0 and "tokens 3" in done.stdout, done.stderr[-3000:]


def test_rank_0_runs_its_share_of_the_cpu_threads_until_shutdown(model_dir):
    """On the CPU the ranks share the cores: rank 0 (the engine's thread) runs half the intra-op threads it had
    while the 2-rank group lives (every rank running all of them made a step about six times slower), and gets
    them back when the executor shuts down."""
    before = torch.get_num_threads()
    torch.set_num_threads(4)  # a known count, whatever the machine
    try:
        engine = LLMEngine(model_dir, EngineConfig(max_num_seqs=2, tensor_parallel_size=2))
        try:
            assert torch.get_num_threads() == 2
        finally:
            engine.runner.shutdown()
        assert torch.get_num_threads() == 4
    finally:
        torch.set_num_threads(before)
