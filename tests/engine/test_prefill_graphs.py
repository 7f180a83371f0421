"""Piecewise prefill graphs (`engine/prefill_graphs.py`): the split forward (pieces on the bucket's padded rows, the
cores on the step's real rows) against the unsplit forward on the CPU, fp32, where nothing is captured; and on
CUDA (skipped without it) the captured pieces replayed against the same split run eagerly (bit-identical) and
against the unsplit forward (fp32, the reference kernels: the same greedy tokens)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hybridcache.engine.input_builder import SeqChunk, build_forward_batch
from hybridcache.engine.prefill_graphs import (
    PrefillGraphs,
    is_piecewise,
    prefill_bucket,
    prefill_graph_sizes,
)
from hybridcache.engine.runner import ModelRunner
from hybridcache.kernels.backend import ReferenceBackend
from hybridcache.models import load_model

from .model_folders import write_tiny_model
from .test_decode_graphs import runner_state_pages, snapshot

BLOCK, PAGE = 16, 8


def test_buckets():
    assert prefill_graph_sizes(16_384) == (16, 32, 64, 128, 256, 512, 768, 1024, 1536, 2048, 2560, 3072, 4096)
    assert prefill_graph_sizes(600) == (16, 32, 64, 128, 256, 512)
    assert prefill_graph_sizes(8) == ()
    sizes = prefill_graph_sizes(1024)
    assert [prefill_bucket(n, sizes) for n in (1, 16, 17, 200, 513, 1024)] == [16, 16, 32, 256, 768, 1024]
    assert prefill_bucket(1025, sizes) is None
    assert prefill_bucket(0, sizes) is None


def make_runner(folder, device: torch.device) -> ModelRunner:
    model = load_model(folder, device=device)
    return ModelRunner(model, num_blocks=40, block_size=BLOCK, kernel_block_size=PAGE, num_slots=4,
                       state_pages=runner_state_pages(model), dtype=torch.float32, state_dtype=torch.float32,
                       device=device, backend=ReferenceBackend(), max_model_len=400)


def steps(device: torch.device) -> list:
    """Three steps over 640 tokens of pool: two fresh prompts (160 + 30 tokens), then a mixed step (sequence 0
    decodes, sequence 1 extends its cached 30 tokens by 40), then a third prompt of 150 beside two decodes.
    Explicit positions (the chunks' starts), block tables and slots, as the engine builds them."""
    gen = torch.Generator().manual_seed(0)

    def ids(n: int) -> list[int]:
        return torch.randint(0, 300, (n,), generator=gen).tolist()

    blocks = (list(range(0, 12)), list(range(12, 20)), list(range(20, 32)))
    chunks = [
        [SeqChunk(ids(160), 0, blocks[0], 0), SeqChunk(ids(30), 0, blocks[1], 1)],
        [SeqChunk(ids(1), 160, blocks[0], 0), SeqChunk(ids(40), 30, blocks[1], 1)],
        [SeqChunk(ids(1), 161, blocks[0], 0), SeqChunk(ids(150), 0, blocks[2], 2), SeqChunk(ids(1), 70, blocks[1], 1)],
    ]
    return [build_forward_batch(c, block_size=BLOCK, kernel_block_size=PAGE, device=device) for c in chunks]


def split_and_unsplit(runner: ModelRunner, sizes: tuple[int, ...], *, replay: bool):
    """Each step of `steps` run unsplit, then (its pools restored first) split in `sizes`' buckets (`replay`: the
    captured graphs, else the pieces and cores eagerly): per step (unsplit logits, split logits, pools after
    each)."""
    prefill = runner._prefill
    results = []
    for batch in steps(runner.device):
        assert is_piecewise(batch)
        before = snapshot(runner)
        runner._prefill = None
        want = runner.execute(batch)
        after_unsplit = snapshot(runner)
        for pool, saved in zip((*runner.pools.kv_groups, *runner.pools.state_groups), before):
            pool.copy_(saved)
        runner._prefill = prefill
        if replay:
            got = runner.execute(batch)
        else:
            with runner.without_replay():
                got = runner.execute(batch)
        results.append((want, got, after_unsplit, snapshot(runner)))
    return results


@pytest.mark.parametrize("model_type", ["qwen3_next", "qwen3_5_text"])
def test_split_forward_equals_unsplit_on_cpu(tmp_path, model_type):
    """Buckets 41 and 190 fit the first two steps exactly (no padding row): the split forward is bit-identical to
    the unsplit one, logits and every pool. The third step (153 tokens) runs in bucket 190 with 37 padding rows
    (holding the first step's ids): the same up to fp32 rounding (a 190-row matmul may round differently from a
    153-row one; a padding row leaking into a real row would differ by O(1)) and the same greedy tokens."""
    device = torch.device("cpu")
    runner = make_runner(write_tiny_model(tmp_path, model_type), device)
    sizes = (41, 190, 256)
    runner._prefill = PrefillGraphs(runner.model, runner.backend, runner.pools, sizes, device)
    results = split_and_unsplit(runner, sizes, replay=False)
    for index, (want, got, unsplit_pools, split_pools) in enumerate(results):
        assert got.shape == want.shape == (len(steps(device)[index].query_lens_cpu), 320)
        if index < 2:
            assert torch.equal(got, want), index
            assert all(torch.equal(a, b) for a, b in zip(unsplit_pools, split_pools)), index
        else:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            assert got.argmax(-1).tolist() == want.argmax(-1).tolist()
            for a, b in zip(unsplit_pools, split_pools):
                torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


def test_which_steps_run_piecewise(tmp_path):
    """Text steps of 1 to max(sizes) tokens; not a step with given input embeddings or M-RoPE positions, nor a
    longer one."""
    device = torch.device("cpu")
    runner = make_runner(write_tiny_model(tmp_path, "qwen3_5_text"), device)
    prefill = PrefillGraphs(runner.model, runner.backend, runner.pools, (16, 64, 256), device)
    mixed = steps(device)[1]  # 41 tokens
    assert prefill.bucket(mixed) == 64
    assert prefill.bucket(steps(device)[0]) == 256  # 190 tokens
    long = build_forward_batch([SeqChunk([1] * 300, 0, list(range(19)), 0)], block_size=BLOCK,
                               kernel_block_size=PAGE, device=device)
    assert prefill.bucket(long) is None
    embedded = dataclasses.replace(mixed, embed_rows=torch.tensor([0]), embeds=torch.zeros(1, 64))
    assert not is_piecewise(embedded) and prefill.bucket(embedded) is None
    mrope = dataclasses.replace(mixed, rope_positions=mixed.positions.expand(3, -1))
    assert prefill.bucket(mrope) is None


def test_cpu_runner_has_no_prefill_graphs(tmp_path):
    runner = make_runner(write_tiny_model(tmp_path, "qwen3_next"), torch.device("cpu"))
    assert runner.prefill_graph_sizes == ()


def test_replay_without_a_capture_is_an_error(tmp_path):
    device = torch.device("cpu")
    runner = make_runner(write_tiny_model(tmp_path, "qwen3_5_text"), device)
    prefill = PrefillGraphs(runner.model, runner.backend, runner.pools, (64,), device)
    batch = runner.backend.prepare(steps(device)[1])
    prefill.load(batch)
    with pytest.raises(ValueError, match="no piecewise graph of 64 tokens"):
        prefill.run(batch, 64)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_piecewise_replay_on_cuda_fp32(tmp_path):
    """The dense Qwen3.5 shape in fp32 on the reference kernels (torch ops only: nothing to compile; the CUDA
    backend's graphs are bf16, checked by gpu_bench's --check-graphs): pieces captured per bucket at start-up
    (`_capture_prefill`), replayed. Replay equals the same pieces and cores run eagerly bit for bit, and the
    unsplit forward up to fp32 rounding with the same greedy tokens; the pools likewise."""
    device = torch.device("cuda")
    runner = make_runner(write_tiny_model(tmp_path, "qwen3_5_text"), device)
    runner._prefill = runner._capture_prefill(256, block_size=BLOCK, kernel_block_size=PAGE)
    assert runner.prefill_graph_sizes == (16, 32, 64, 128, 256)
    start = snapshot(runner)
    replayed = split_and_unsplit(runner, runner.prefill_graph_sizes, replay=True)
    for pool, saved in zip((*runner.pools.kv_groups, *runner.pools.state_groups), start):
        pool.copy_(saved)
    eager = split_and_unsplit(runner, runner.prefill_graph_sizes, replay=False)
    for (want, got, unsplit_pools, split_pools), (_, got_eager, _, eager_pools) in zip(replayed, eager):
        assert torch.equal(got, got_eager)
        assert all(torch.equal(a, b) for a, b in zip(split_pools, eager_pools))
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert got.argmax(-1).tolist() == want.argmax(-1).tolist()
        for a, b in zip(unsplit_pools, split_pools):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
