"""Shutdown order of a tensor-parallel executor, and start/stop cycles that must never hang.

NCCL's communicator teardown (destroy, and abort too) waits until every CUDA graph that captured one of its
collectives has been destroyed; graphs under TP hung at shutdown because rank 0 left the group while its runner
still held its decode graphs. So `_shutdown` destroys rank 0's graphs first (each worker destroys its own before
it leaves), a monitor thread blocked in such an abort does not block the owner's own abort, and rank 0's leave is
bounded. On the CPU (gloo) there are no graphs: these tests check the order and that nothing waits on another;
the same on 2 GPUs with graphs: `test_tp_cuda_graphs.py`.
"""

from __future__ import annotations

import pickle
import threading
import time

import pytest
import torch.distributed as dist

from hybridcache import LLM, SamplingParams
from hybridcache.distributed import executor as executor_module
from hybridcache.distributed.monitor import LivenessMonitor
from hybridcache.engine.rank_runner import RunnerSpec

from .folders import write_folder
from .test_shutdown import wait_gone
from .test_worker_failure import sleepers  # noqa: F401 (a fixture)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_folder(tmp_path_factory.mktemp("qwen3_next"), "qwen3_next")


def test_rank_0s_graphs_go_before_the_monitor_and_the_group(model_dir, monkeypatch):
    calls = []
    leave = executor_module.leave_group
    monkeypatch.setattr(executor_module, "leave_group", lambda aborted=False: (calls.append("leave"), leave(aborted)))
    llm = LLM(model_dir, tensor_parallel_size=2, max_num_seqs=2, max_model_len=128)
    executor = llm.engine.runner
    release, stop = executor.runner.release_graphs, executor._monitors[0].stop
    monkeypatch.setattr(executor.runner, "release_graphs", lambda: (calls.append("release graphs"), release()))
    monkeypatch.setattr(executor._monitors[0], "stop", lambda: (calls.append("stop monitor"), stop()))
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    assert len(llm.generate("order", params, use_tqdm=False)[0].outputs[0].token_ids) == 3
    pids = executor.worker_pids
    llm.close()
    assert calls == ["release graphs", "stop monitor", "leave"]
    assert not dist.is_initialized() and wait_gone(pids, 10)


def test_the_owners_abort_does_not_wait_for_the_monitors_abort_in_progress(sleepers):  # noqa: F811
    """The monitor thread's abort may block until rank 0's graphs are destroyed, which the owner does only at
    shutdown, after its own `abort()`: that call must return at once, not wait on the monitor's lock."""
    entered, release = threading.Event(), threading.Event()
    calls = []

    def blocking_abort() -> None:
        calls.append(threading.current_thread().name)
        entered.set()
        release.wait(30)

    monitor = LivenessMonitor(sleepers, blocking_abort)
    sleepers[1].kill()
    assert entered.wait(10)  # the monitor thread is inside the abort
    began = time.monotonic()
    monitor.abort()
    assert time.monotonic() - began < 1 and monitor.aborted and monitor.dead_rank == 1
    release.set()
    monitor.stop()
    assert calls == ["hybridcache-tp-monitor"]  # one abort in all


@pytest.mark.slow
def test_ten_start_stop_cycles_at_two_ranks_never_hang(model_dir):
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    first = None
    for _ in range(10):
        with LLM(model_dir, tensor_parallel_size=2, max_num_seqs=2, max_model_len=128) as llm:
            tokens = llm.generate("cycle", params, use_tqdm=False)[0].outputs[0].token_ids
            pids = llm.engine.runner.worker_pids
            began = time.monotonic()  # leaving the block closes the engine
        assert time.monotonic() - began < executor_module.LEAVE_TIMEOUT_S
        assert not dist.is_initialized() and wait_gone(pids, 10)
        assert tokens == (first := first or tokens)


def test_the_graphs_switch_travels_to_the_workers_in_the_spec(monkeypatch, tmp_path):
    """Every rank must decide alike whether to capture (a graph replays the collectives it captured): the switch
    is read when the driver makes the spec, so a value set only in the driver's process (a test's monkeypatch,
    `tp_bench.py --graphs`) reaches the spawned workers."""
    from hybridcache.config import EngineConfig
    from hybridcache.engine import rank_runner

    assert not RunnerSpec(tmp_path, EngineConfig(), 64).tp_cuda_graphs
    monkeypatch.setattr(rank_runner, "TP_CUDA_GRAPHS", True)
    spec = RunnerSpec(tmp_path, EngineConfig(tensor_parallel_size=2), 64)
    assert pickle.loads(pickle.dumps(spec)).tp_cuda_graphs
