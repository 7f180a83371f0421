"""CUDA graphs under tensor parallelism (2 CUDA devices and the cuda extra; skipped without them): every rank
captures the same decode buckets, and a decode step replays the same graph on every rank, the NCCL collectives
inside it pairing up. Greedy tokens of graph replay must equal those of the very same captured batches run
eagerly on every rank (`without_replay`), as `tests/engine/test_decode_graphs.py` checks for one rank; shutdown
must not hang (NCCL's teardown waits for the graphs that captured its collectives: `_shutdown` destroys them
first), and a worker killed mid-generate must fail the engine within seconds.

These tests are the GPU check of `hybridcache.engine.rank_runner.TP_CUDA_GRAPHS`: they switch it on for their
engines (the value travels to the workers in the `RunnerSpec`); once they pass on 2 GPUs, the constant may be True.
"""

from __future__ import annotations

import gc
import importlib.util
import os
import signal
import threading
import time

import pytest
import torch

from hybridcache.engine import rank_runner
from hybridcache.sampling import SamplingParams

from ..engine.graph_checks import GRAPH_PROMPTS, greedy_tokens, replay_and_eager_tokens
from .folders import write_folder
from .test_shutdown import wait_gone

pytestmark = pytest.mark.skipif(
    torch.cuda.device_count() < 2 or importlib.util.find_spec("fla") is None,
    reason="needs 2 CUDA devices and the cuda extra",
)


@pytest.fixture(autouse=True)
def tp_graphs_on(monkeypatch):
    monkeypatch.setattr(rank_runner, "TP_CUDA_GRAPHS", True)
    gc.collect()  # an earlier test's engine: its pools must not count against this one's memory budget
    torch.cuda.empty_cache()


def start(folder, **options):
    from hybridcache import LLM

    return LLM(folder, device="cuda", dtype="bfloat16", max_num_seqs=32, gpu_memory_utilization=0.2,
               tensor_parallel_size=2, **options)


@pytest.mark.parametrize("vocab_size", [320, 321], ids=["even-vocab", "odd-vocab"])
def test_two_rank_graph_decode_equals_the_same_batches_run_eagerly(tmp_path, vocab_size):
    """`graph_checks.replay_and_eager_tokens` on two ranks, then replay once more (every rank back to replay
    after the `without_replay` block)."""
    folder = write_folder(tmp_path, "qwen3_next", vocab_size=vocab_size)
    with start(folder) as llm:
        assert llm.engine.runner.graph_batch_sizes == (1, 2, 4, 8, 16, 32)
        graph, eager = replay_and_eager_tokens(llm)
        assert graph == eager
        assert greedy_tokens(llm) == graph  # every rank back to replay after the block


def test_async_scheduling_with_graphs_gives_the_synchronous_tokens(tmp_path):
    folder = write_folder(tmp_path, "qwen3_next")
    with start(folder, async_scheduling=True) as llm:
        assert llm.engine.async_scheduling
        overlapped = greedy_tokens(llm)
        llm.engine.async_scheduling = False
        assert greedy_tokens(llm) == overlapped


def test_ten_start_stop_cycles_with_graphs_never_hang(tmp_path):
    folder = write_folder(tmp_path, "qwen3_next")
    for _ in range(10):
        with start(folder) as llm:
            assert llm.engine.runner.graph_batch_sizes
            pids = llm.engine.runner.worker_pids
            params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
            assert all(len(o.outputs[0].token_ids) == 16 for o in llm.generate(GRAPH_PROMPTS[:8], params,
                                                                                 use_tqdm=False))
            began = time.monotonic()  # leaving the block closes the engine
        assert time.monotonic() - began < 30
        assert wait_gone(pids, 10)


def test_a_worker_killed_mid_generate_with_graphs_fails_the_engine_within_seconds(tmp_path):
    from hybridcache.distributed.executor import WorkerError

    folder = write_folder(tmp_path, "qwen3_next")
    llm = start(folder)
    engine = llm.engine
    (pid,) = engine.runner.worker_pids
    try:
        for i in range(4):
            engine.add_request(f"kill{i}", list(range(1, 30 + i)), SamplingParams(max_tokens=4000, ignore_eos=True))
        for _ in range(3):
            engine.step()
        killed_at = []
        threading.Timer(0.2, lambda: (killed_at.append(time.monotonic()), os.kill(pid, signal.SIGKILL))).start()
        deadline = time.monotonic() + 60
        with pytest.raises(WorkerError, match=r"worker rank 1 \(pid \d+\) died"):
            while time.monotonic() < deadline:
                engine.step()
        assert time.monotonic() - killed_at[0] < 10
    finally:
        began = time.monotonic()
        llm.close()
        assert time.monotonic() - began < 45  # the leave is bounded (LEAVE_TIMEOUT_S) whatever NCCL does
