"""CUDA graphs under tensor parallelism (2 CUDA devices and the cuda extra; skipped without them): every rank
captures the same decode buckets, and a decode step replays the same graph on every rank, the NCCL collectives
inside it pairing up. Greedy tokens of graph replay must equal those of the very same captured batches run
eagerly on every rank (`without_replay`), as `tests/engine/test_decode_graphs.py` checks for one rank."""

from __future__ import annotations

import gc
import importlib.util

import pytest
import torch

from hybridcache.engine.rank_runner import TP_CUDA_GRAPHS

from ..engine.graph_checks import greedy_tokens, replay_and_eager_tokens
from .folders import write_folder

pytestmark = pytest.mark.skipif(
    torch.cuda.device_count() < 2 or importlib.util.find_spec("fla") is None,
    reason="needs 2 CUDA devices and the cuda extra",
)
# To verify graphs under TP: set hybridcache.engine.rank_runner.TP_CUDA_GRAPHS = True and run this file on 2 GPUs.
needs_tp_graphs = pytest.mark.skipif(not TP_CUDA_GRAPHS, reason="CUDA graphs under TP are off (TP_CUDA_GRAPHS)")


@needs_tp_graphs
@pytest.mark.parametrize("vocab_size", [320, 321], ids=["even-vocab", "odd-vocab"])
def test_two_rank_graph_decode_equals_the_same_batches_run_eagerly(tmp_path, vocab_size):
    """`graph_checks.replay_and_eager_tokens` on two ranks, then replay once more (every rank back to replay
    after the `without_replay` block)."""
    from hybridcache import LLM

    gc.collect()  # an earlier test's engine: its pools must not count against this one's memory budget
    torch.cuda.empty_cache()
    folder = write_folder(tmp_path, "qwen3_next", vocab_size=vocab_size)
    llm = LLM(folder, device="cuda", dtype="bfloat16", max_num_seqs=32, gpu_memory_utilization=0.2,
              tensor_parallel_size=2)
    try:
        assert llm.engine.runner.graph_batch_sizes == (1, 2, 4, 8, 16, 32)
        graph, eager = replay_and_eager_tokens(llm)
        assert graph == eager
        assert greedy_tokens(llm) == graph  # every rank back to replay after the block
    finally:
        llm.engine.runner.shutdown()
