"""CUDA-graph decode: the bucketing and the padding rows, checked eagerly on the CPU (the graphs replay exactly
these static batches on CUDA), and graph == eager greedy tokens on CUDA (skipped without it)."""

from __future__ import annotations

import dataclasses
import gc

import pytest
import torch

from hybridcache.engine.input_builder import SeqChunk, build_forward_batch
from hybridcache.engine.memory import pool_bytes, state_pages
from hybridcache.engine.runner import (
    ModelRunner,
    _DecodeGraphs,
    graph_batch_sizes,
    graph_bucket,
    is_decode_only,
    is_uniform_verify,
)
from hybridcache.models import load_model

from .graph_checks import replay_and_eager_tokens
from .markers import needs_cuda_engine
from .model_folders import write_tiny_model

BLOCK, PAGE = 16, 8


def test_buckets():
    assert graph_batch_sizes(1) == (1,)
    assert graph_batch_sizes(48) == (1, 2, 4, 8, 16, 32, 64)
    assert graph_batch_sizes(64) == (1, 2, 4, 8, 16, 32, 64)
    sizes = graph_batch_sizes(64)
    assert [graph_bucket(n, sizes) for n in (1, 2, 3, 5, 33, 64)] == [1, 2, 4, 8, 64, 64]
    assert graph_bucket(65, sizes) is None


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    folder = write_tiny_model(tmp_path_factory.mktemp("next"), "qwen3_next")
    model = load_model(folder)
    # 12 blocks + 1 scratch block, 4 slots + 1 scratch slot, as the runner allocates them with graphs
    return ModelRunner(model, num_blocks=13, block_size=BLOCK, kernel_block_size=PAGE, num_slots=5,
                       state_pages=runner_state_pages(model),
                       dtype=torch.float32, state_dtype=torch.float32, device=torch.device("cpu"))


def runner_state_pages(model: torch.nn.Module) -> int:
    """k of the model's fp32 pools at BLOCK tokens per block."""
    kv, state = pool_bytes(model.state_specs(torch.float32, torch.float32), BLOCK, model.slot_specs(torch.float32))
    return state_pages(state, kv)


def snapshot(runner: ModelRunner) -> list[torch.Tensor]:
    return [t.clone() for t in (*runner.pools.kv_groups, *runner.pools.state_groups)]


def test_padded_decode_rows_change_nothing_but_scratch(runner):
    """Three sequences decode one token each: eagerly as is, then as the 4-row static batch the graph of bucket
    4 replays (with true host lengths, which the reference backend reads). Same logits and greedy tokens; the
    pools differ only in the scratch slot and scratch block (up to fp32 rounding: a 4-row matmul may round
    differently from a 3-row one; a padding row leaking into a real one would differ by O(1))."""
    gen = torch.Generator().manual_seed(0)
    lengths, slots = (5, 17, 30), (0, 2, 3)
    blocks = ([0, 1], [2, 3, 4], [5, 6])
    prefill = [SeqChunk(torch.randint(0, 300, (n,), generator=gen).tolist(), 0, b, s)
               for n, b, s in zip(lengths, blocks, slots)]
    runner.execute(build_forward_batch(prefill, block_size=BLOCK, kernel_block_size=PAGE))
    decode = [SeqChunk([7 + i], n, b, s) for i, (n, b, s) in enumerate(zip(lengths, blocks, slots))]
    batch = build_forward_batch(decode, block_size=BLOCK, kernel_block_size=PAGE)
    assert is_decode_only(batch)
    before = snapshot(runner)
    want = runner.execute(batch)
    after_eager = snapshot(runner)
    for pool, saved in zip((*runner.pools.kv_groups, *runner.pools.state_groups), before):
        pool.copy_(saved)

    scratch_slot, scratch_page = 4, 12 * (BLOCK // PAGE)
    graphs = _DecodeGraphs((1, 2, 4), width=8, max_model_len=64, scratch_slot=scratch_slot,
                           scratch_page=scratch_page, kernel_block_size=PAGE, device=torch.device("cpu"))
    graphs.load(build_forward_batch(decode, block_size=BLOCK, kernel_block_size=PAGE), 4)
    static = dataclasses.replace(graphs.static_batch(4), context_lens_cpu=(*batch.context_lens_cpu, 1))
    assert static.state_slots.tolist() == [*slots, scratch_slot]
    assert static.kv_rows[3].item() == scratch_page * PAGE
    got = runner.execute(static)
    torch.testing.assert_close(got[:3], want, rtol=1e-5, atol=1e-5)
    assert got[:3].argmax(-1).tolist() == want.argmax(-1).tolist()
    for pool, eager in zip((*runner.pools.kv_groups, *runner.pools.state_groups), after_eager):
        if pool.dim() >= 5 and pool.shape[1] == 2:  # kv [layers, 2, pages, PAGE, Hkv, D]
            torch.testing.assert_close(pool[:, :, :scratch_page], eager[:, :, :scratch_page], rtol=1e-5, atol=1e-5)
        else:  # state [layers, slots, ...]
            torch.testing.assert_close(pool[:, :scratch_slot], eager[:, :scratch_slot], rtol=1e-5, atol=1e-5)

    # a smaller step afterwards: stale rows from the bigger one become padding again
    graphs.load(build_forward_batch(decode[:1], block_size=BLOCK, kernel_block_size=PAGE), 2)
    assert graphs.state_slots[:2].tolist() == [slots[0], scratch_slot]
    assert graphs.context_lens[:2].tolist() == [lengths[0] + 1, 1]
    assert graphs.block_tables[1, 0].item() == scratch_page


def test_padded_verify_rows_change_nothing_but_scratch(tmp_path):
    """Speculative decoding's verify graphs: three verify rows of 2 drafts each, eagerly as is, then as the 4-row
    static batch the verify graph of bucket 4 replays (rows of 3 tokens; the padding row fresh on the scratch slot,
    its draft rows and the scratch page). Same logits (each row's last token, then the draft rows) and the same
    pools outside the scratch rows: draft states included."""
    model = load_model(write_tiny_model(tmp_path, "qwen3_next"))
    k = 2
    runner = ModelRunner(model, num_blocks=13, block_size=BLOCK, kernel_block_size=PAGE, num_slots=5,
                         state_pages=runner_state_pages(model), num_speculative_tokens=k,
                         dtype=torch.float32, state_dtype=torch.float32, device=torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    lengths, slots = (5, 17, 30), (0, 2, 3)
    blocks = ([0, 1], [2, 3, 4], [5, 6, 7])
    prefill = [SeqChunk(torch.randint(0, 300, (n,), generator=gen).tolist(), 0, b, s)
               for n, b, s in zip(lengths, blocks, slots)]
    runner.execute(build_forward_batch(prefill, block_size=BLOCK, kernel_block_size=PAGE))
    verify = [SeqChunk([7 + i, 9 + i, 11 + i], n, b, s) for i, (n, b, s) in enumerate(zip(lengths, blocks, slots))]
    drafts = [runner.draft_slots(s, k) for s in slots]
    batch = build_forward_batch(verify, block_size=BLOCK, kernel_block_size=PAGE, draft_slots=drafts)
    assert is_uniform_verify(batch, k) and not is_uniform_verify(batch, 1) and not is_decode_only(batch)
    before = snapshot(runner)
    want = runner.execute(batch)
    after_eager = snapshot(runner)
    for pool, saved in zip((*runner.pools.kv_groups, *runner.pools.state_groups), before):
        pool.copy_(saved)

    scratch_slot, scratch_page = 4, 12 * (BLOCK // PAGE)
    scratch_rows = [scratch_slot, *runner.draft_slots(scratch_slot, k)]
    graphs = _DecodeGraphs((1, 2, 4), width=8, max_model_len=64, scratch_slot=scratch_slot,
                           scratch_page=scratch_page, kernel_block_size=PAGE, device=torch.device("cpu"),
                           num_drafts=k, scratch_drafts=runner.draft_slots(scratch_slot, k))
    graphs.load(batch, 4)
    static = dataclasses.replace(graphs.static_batch(4, batch.draft_slots_cpu),
                                 context_lens_cpu=(*batch.context_lens_cpu, 1 + k))
    assert static.state_slots.tolist() == [*slots, scratch_slot]
    assert static.kv_rows[9:].tolist() == [scratch_page * PAGE + j for j in range(1 + k)]
    assert static.draft_slots.tolist() == [*sum(drafts, ()), *runner.draft_slots(scratch_slot, k)]
    got = graphs.rows(runner.execute(static), 3, 4)
    assert got.shape == want.shape == (3 + 3 * k, want.shape[1])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    keep = [row for row in range(runner.pools.state_groups[0].shape[1]) if row not in scratch_rows]
    for pool, eager in zip((*runner.pools.kv_groups, *runner.pools.state_groups), after_eager):
        if pool.dim() >= 5 and pool.shape[1] == 2:  # kv [layers, 2, pages, PAGE, Hkv, D]
            torch.testing.assert_close(pool[:, :, :scratch_page], eager[:, :, :scratch_page], rtol=1e-5, atol=1e-5)
        else:  # state [layers, slots and draft rows, ...]
            torch.testing.assert_close(pool[:, keep], eager[:, keep], rtol=1e-5, atol=1e-5)

    # a smaller step afterwards: stale rows from the bigger one become padding again
    graphs.load(build_forward_batch(verify[:1], block_size=BLOCK, kernel_block_size=PAGE, draft_slots=drafts[:1]), 2)
    assert graphs.state_slots[:2].tolist() == [slots[0], scratch_slot]
    assert graphs.context_lens[:2].tolist() == [lengths[0] + 1 + k, 1 + k]
    assert graphs.positions[:6].tolist() == [lengths[0] + j for j in range(1 + k)] + list(range(1 + k))
    assert graphs.draft_slots[: 2 * k].tolist() == [*drafts[0], *runner.draft_slots(scratch_slot, k)]


def test_cpu_runner_never_captures(runner):
    assert runner.graph_batch_sizes == ()


@needs_cuda_engine
def test_graph_decode_equals_eager_on_cuda(tmp_path):
    """Graph replay must give exactly the tokens of the same captured batches run eagerly (`without_replay`,
    `graph_checks.replay_and_eager_tokens`); the plain
    eager path sizes its split-KV splits per step, so in bf16 it is only compared where the two agree
    trivially: an `enforce_eager` engine captures nothing."""
    from hybridcache import LLM

    folder = write_tiny_model(tmp_path, "qwen3_next")
    llm = LLM(folder, device="cuda", dtype="bfloat16", max_num_seqs=32, gpu_memory_utilization=0.2)
    assert llm.engine.runner.graph_batch_sizes == (1, 2, 4, 8, 16, 32)
    graph, eager = replay_and_eager_tokens(llm)
    assert graph == eager
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    eager_llm = LLM(folder, device="cuda", dtype="bfloat16", max_num_seqs=32, gpu_memory_utilization=0.2,
                    enforce_eager=True)
    assert eager_llm.engine.runner.graph_batch_sizes == ()


def test_start_up_copies_touch_only_block_1(tmp_path):
    """The copy-kernel warm-up a CUDA runner runs at construction (`_compile_copies`): block 0 onto block 1 in
    every KV group, nothing else; the state slots are untouched (the paged state copies' kernel compiles without
    running, `PagedStates.compile`). Run here on the CPU's torch copy path."""
    model = load_model(write_tiny_model(tmp_path, "qwen3_next"))
    runner = ModelRunner(model, num_blocks=4, block_size=BLOCK, kernel_block_size=PAGE, num_slots=3,
                         state_pages=runner_state_pages(model),
                         dtype=torch.float32, state_dtype=torch.float32, device=torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    for pool in (*runner.pools.kv_groups, *runner.pools.state_groups):
        pool.copy_(torch.randn(pool.shape, generator=gen))
    before = snapshot(runner)
    runner._compile_copies(num_blocks=4)
    pages = BLOCK // PAGE
    num_kv = len(runner.pools.kv_groups)
    for old, new in zip(before[:num_kv], runner.pools.kv_groups, strict=True):
        expected = old.clone()
        expected[:, :, pages: 2 * pages] = old[:, :, :pages]
        assert torch.equal(new, expected)
    for old, new in zip(before[num_kv:], runner.pools.state_groups, strict=True):
        assert torch.equal(new, old)
