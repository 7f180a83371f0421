"""A worker that dies fails the engine within seconds, naming its rank, also while the driver waits in a
collective for it: the liveness monitor on its own (a plain process), on the CPU (gloo, 2 ranks), and on 2 CUDA
devices (NCCL; skipped without them), where only the monitor's abort of the group ends the wait before NCCL's
300 s watchdog. (A worker killed between or during ordinary steps: `test_tensor_parallel.py`.)"""

from __future__ import annotations

import gc
import importlib.util
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from hybridcache.cache import PENDING_TOKEN
from hybridcache.config import EngineConfig
from hybridcache.distributed.executor import WorkerError, _Worker, expect_message
from hybridcache.distributed.messages import Op
from hybridcache.distributed.monitor import LivenessMonitor
from hybridcache.distributed.worker import DRIVER_POLL_S, exit_with_parent
from hybridcache.engine.engine import EngineDeadError, LLMEngine
from hybridcache.sampling import SamplingParams

from .folders import write_folder
from .test_shutdown import alive

KILL_AFTER_S = 1.0
FAIL_WITHIN_S = 10.0


@pytest.fixture
def sleepers() -> Iterator[dict[int, multiprocessing.Process]]:
    context = multiprocessing.get_context("spawn")
    processes = {rank: context.Process(target=time.sleep, args=(60,), daemon=True) for rank in (1, 2)}
    for process in processes.values():
        process.start()
    yield processes
    for process in processes.values():
        process.kill()
        process.join()


def test_the_monitor_aborts_once_when_a_process_dies(sleepers):
    calls = []
    monitor = LivenessMonitor(sleepers, lambda: calls.append(time.monotonic()))
    time.sleep(0.2)
    assert calls == [] and monitor.dead_rank is None
    killed_at = time.monotonic()
    sleepers[2].kill()
    deadline = time.monotonic() + 5
    while not calls and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(calls) == 1 and calls[0] - killed_at < 2
    assert monitor.dead_rank == 2 and monitor.aborted
    monitor.abort()  # the owner aborting again after a failure: nothing more happens
    sleepers[1].kill()
    monitor.stop()
    assert len(calls) == 1


def test_a_stopped_monitor_ignores_exits_and_a_failed_abort_is_kept(sleepers):
    calls = []
    monitor = LivenessMonitor(sleepers, lambda: calls.append(1))
    monitor.stop()
    sleepers[1].kill()
    sleepers[1].join()
    time.sleep(0.2)
    assert calls == [] and monitor.dead_rank is None and not monitor.aborted

    def broken() -> None:
        raise RuntimeError("no group")

    monitor = LivenessMonitor({2: sleepers[2]}, broken)
    monitor.abort()
    assert monitor.aborted and isinstance(monitor.abort_error, RuntimeError)
    monitor.stop()


def _child_that_exits_with_its_parent(pids) -> None:  # a multiprocessing queue: the pid goes back to the test
    exit_with_parent()
    pids.put(os.getpid())
    time.sleep(60)


def _parent_of_a_watching_child(pids) -> None:
    multiprocessing.get_context("spawn").Process(target=_child_that_exits_with_its_parent, args=(pids,)).start()
    time.sleep(60)


def test_a_worker_exits_within_a_second_of_its_drivers_death():
    """The worker's driver watch (`exit_with_parent`): it ends the process whatever its main thread is doing,
    e.g. waiting in an NCCL collective for the dead driver (here: sleeping)."""
    context = multiprocessing.get_context("spawn")
    pids = context.Queue()
    parent = context.Process(target=_parent_of_a_watching_child, args=(pids,))  # not daemonic: it has a child
    parent.start()
    try:
        child = pids.get(timeout=60)
        assert alive(child)
    finally:
        parent.kill()
        parent.join()
    deadline = time.monotonic() + 1 + DRIVER_POLL_S
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(child)


def start_decoding(engine: LLMEngine, steps: int = 3) -> None:
    """Four long requests, a few steps in (every rank has run prefill and decode collectives)."""
    for i in range(4):
        engine.add_request(f"long{i}", list(range(1, 30 + i)), SamplingParams(max_tokens=4000, ignore_eos=True))
    for _ in range(steps):
        engine.step()


def fail_while_blocked(engine: LLMEngine) -> None:
    """Stop rank 1 (SIGSTOP), so the next step waits in its first collective; kill it KILL_AFTER_S later. The
    step must raise `WorkerError` naming rank 1 within FAIL_WITHIN_S of the kill, and every later step
    `EngineDeadError` naming it."""
    (pid,) = engine.runner.worker_pids
    os.kill(pid, signal.SIGSTOP)
    timer = threading.Timer(KILL_AFTER_S, os.kill, (pid, signal.SIGKILL))
    start = time.monotonic()
    timer.start()
    took = rank_1_death(engine, pid, timer, engine.step) - start
    assert KILL_AFTER_S * 0.9 <= took < KILL_AFTER_S + FAIL_WITHIN_S, took  # it did wait for rank 1


def rank_1_death(engine: LLMEngine, pid: int, timer: threading.Timer, run) -> float:
    """`run()` must raise `WorkerError` naming rank 1 (killed), and the next step `EngineDeadError` naming it;
    then the timer is cancelled, the engine shut down, and the worker must be gone. Returns when the
    `WorkerError` came (time.monotonic())."""
    try:
        with pytest.raises(WorkerError, match=r"worker rank 1 \(pid \d+\) died \(killed by signal 9\)"):
            run()
        failed_at = time.monotonic()
        with pytest.raises(EngineDeadError, match="failed earlier.*worker rank 1"):
            engine.step()
    finally:
        timer.cancel()
        engine.runner.shutdown()
    assert not alive(pid)
    return failed_at
    assert not dist.is_initialized()  # the aborted group is gone: a new engine may start in this process


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_folder(tmp_path_factory.mktemp("qwen3_next"), "qwen3_next")


def test_a_worker_that_dies_while_the_driver_waits_in_a_collective_fails_the_step_on_gloo(model_dir):
    engine = LLMEngine(model_dir, EngineConfig(max_num_seqs=4, tensor_parallel_size=2))
    start_decoding(engine)
    fail_while_blocked(engine)


class _Unreaped:
    """A worker process that still looks alive for `lag_s` after it died, as a killed CUDA process does while the
    driver tears its device context down (its pipes, which wake the monitor, close before that)."""

    def __init__(self, process: multiprocessing.Process, lag_s: float) -> None:
        self._process, self._lag_s, self.died_at = process, lag_s, None

    def __getattr__(self, name: str):
        return getattr(self._process, name)

    def is_alive(self) -> bool:
        if self._process.is_alive():
            return True
        self.died_at = self.died_at or time.monotonic()
        return time.monotonic() < self.died_at + self._lag_s


def test_a_step_the_monitor_aborted_raises_while_the_dead_worker_is_not_reaped_yet(model_dir, monkeypatch):
    """On NCCL the monitor's abort lets rank 0's step return normally with garbage; the executor must raise
    then even though `is_alive()` still says True (found on 2 H200s: the step returned). Simulated on gloo:
    rank 0's forward completes with rank 1's, then rank 1 is killed and the monitor aborts before the
    executor's check after the step."""
    engine = LLMEngine(model_dir, EngineConfig(max_num_seqs=4, tensor_parallel_size=2))
    start_decoding(engine)
    executor = engine.runner
    (worker,) = executor._workers
    (monitor,) = executor._monitors
    pid = worker.process.pid
    monkeypatch.setattr(worker, "process", _Unreaped(worker.process, lag_s=1.0))
    forward = executor.runner.execute

    def forward_then_lose_rank_1(batch, feed=None):
        result = forward(batch, feed)
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while not monitor.aborted and time.monotonic() < deadline:
            time.sleep(0.01)
        assert monitor.aborted and monitor.dead_rank == 1
        return result

    monkeypatch.setattr(executor.runner, "execute", forward_then_lose_rank_1)
    rank_1_death(engine, pid, threading.Timer(60, lambda: None), engine.step)


def test_results_of_a_step_aborted_after_it_was_queued_never_reach_a_request(model_dir, monkeypatch):
    """The executor does not wait for the device (async scheduling queues step t+1 while t runs), so on NCCL an
    abort may cut a step short after `execute` returned: the engine's `check_results`, after its wait for the
    sampled tokens, must raise before any token is used. Simulated on gloo: rank 1 is killed and the monitor
    aborts between the step's launch and its completion, rank 1 still looking alive for a second."""
    engine = LLMEngine(model_dir, EngineConfig(max_num_seqs=4, tensor_parallel_size=2))
    start_decoding(engine)
    executor = engine.runner
    (worker,) = executor._workers
    (monitor,) = executor._monitors
    pid = worker.process.pid
    monkeypatch.setattr(worker, "process", _Unreaped(worker.process, lag_s=1.0))
    sample = engine._sample
    decoded = engine.num_decode_tokens

    def sample_then_lose_rank_1(logits, sampled):
        pending = sample(logits, sampled)
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while not monitor.aborted and time.monotonic() < deadline:
            time.sleep(0.01)
        assert monitor.aborted
        return pending

    monkeypatch.setattr(engine, "_sample", sample_then_lose_rank_1)
    running = list(engine.scheduler.running)
    rank_1_death(engine, pid, threading.Timer(60, lambda: None), engine.step)
    assert engine.num_decode_tokens == decoded  # the step's tokens were not taken
    assert running and all(seq.token_ids[-1] == PENDING_TOKEN for seq in running)  # nor filled in


TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2 or importlib.util.find_spec("fla") is None,
                              reason="needs 2 CUDA devices and the cuda extra")


def cuda_engine(model_dir) -> LLMEngine:
    gc.collect()  # an earlier test's engine: its pools must not count against this one's memory budget
    torch.cuda.empty_cache()
    return LLMEngine(model_dir, EngineConfig(max_num_seqs=4, tensor_parallel_size=2, device="cuda",
                                             dtype="bfloat16", gpu_memory_utilization=0.3, enforce_eager=True))


@TWO_GPUS
def test_a_worker_that_dies_while_the_driver_waits_in_a_collective_fails_the_step_on_nccl(model_dir):
    engine = cuda_engine(model_dir)
    start_decoding(engine)
    fail_while_blocked(engine)


@TWO_GPUS
def test_a_worker_killed_during_a_long_generate_fails_the_engine_within_seconds_on_nccl(model_dir):
    engine = cuda_engine(model_dir)
    (pid,) = engine.runner.worker_pids
    start_decoding(engine)
    killed_at = []

    def kill() -> None:
        killed_at.append(time.monotonic())
        os.kill(pid, signal.SIGKILL)

    timer = threading.Timer(KILL_AFTER_S, kill)
    timer.start()
    deadline = time.monotonic() + 120

    def steps() -> None:
        while time.monotonic() < deadline:
            engine.step()

    assert rank_1_death(engine, pid, timer, steps) - killed_at[0] < FAIL_WITHIN_S


def test_a_worker_that_dies_before_it_answers_at_start_up_is_a_worker_error_naming_it():
    """A worker that dies at start-up (e.g. re-running a script without a `__main__` guard) closes its pipe, which
    then polls as readable: reading it raised a bare EOFError, naming nothing (found by a bug hunt)."""
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    process = context.Process(target=sys.exit, args=(3,), daemon=True)
    process.start()
    theirs.close()  # as a dead worker's end is
    process.join(10)
    worker = _Worker(rank=1, process=process, conn=ours)
    with pytest.raises(WorkerError, match=r"rank 1 \(pid \d+\) died \(exit code 3\).*__main__"):
        expect_message(worker, Op.STARTED, timeout=10)
