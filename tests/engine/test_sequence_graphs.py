"""Whole-step graphs of one-sequence steps (`engine/prefill_graphs.SequenceGraphs`): which steps they take, what a
step loads (CPU), and on CUDA (skipped without it and the cuda extra) a bf16 runner whose one-sequence steps replay
them: replay equals the same static batch run eagerly bit for bit, and the piecewise path (the cores on the step's
own rows) in greedy tokens, logits and every pool row the step owns up to bf16 rounding."""

from __future__ import annotations

import dataclasses

import torch

from hybridcache.engine.input_builder import SeqChunk, build_forward_batch
from hybridcache.engine.memory import pool_bytes, state_pages
from hybridcache.engine.prefill_graphs import PrefillGraphs, SequenceGraphs, is_sequence_step
from hybridcache.kernels.backend import ReferenceBackend
from hybridcache.models import load_model

from .markers import needs_cuda_engine
from .model_folders import write_tiny_model
from .test_decode_graphs import snapshot

BLOCK, PAGE = 16, 8


def batch_of(*chunks: SeqChunk, device: torch.device | str = "cpu"):
    return build_forward_batch(list(chunks), block_size=BLOCK, kernel_block_size=PAGE, device=device)


def test_which_steps_are_sequence_steps():
    """One text sequence, fresh or extending what it holds: yes. Two sequences, given embeddings: no."""
    ids = list(range(40))
    assert is_sequence_step(batch_of(SeqChunk(ids, 160, list(range(13)), 0)))
    assert is_sequence_step(batch_of(SeqChunk(ids, 0, list(range(3)), 0)))  # fresh
    two = batch_of(SeqChunk(ids, 160, list(range(13)), 0), SeqChunk([1], 30, [20, 21], 1))
    assert not is_sequence_step(two)
    hit = batch_of(SeqChunk(ids, 160, list(range(13)), 0))
    assert not is_sequence_step(dataclasses.replace(hit, embed_rows=torch.tensor([0]), embeds=torch.zeros(1, 64)))


def test_load_fills_the_static_buffers(tmp_path):
    """A 40-token step over 160 cached tokens, loaded into buckets of up to 64 rows: ids, positions, KV rows,
    cu_seqlens [0, 40], context 200, its slot and block table; bucket 64 (no graph captured: `bucket` is None)."""
    device = torch.device("cpu")
    model = load_model(write_tiny_model(tmp_path, "qwen3_next"), device=device)
    prefill = PrefillGraphs(model, ReferenceBackend(), None, (16, 32, 64), device)
    whole = SequenceGraphs(model, ReferenceBackend(), None, prefill, table_width=32, max_model_len=400,
                           scratch_slot=4, scratch_page=80, kernel_block_size=PAGE)
    ids = list(range(100, 140))
    batch = batch_of(SeqChunk(ids, 160, list(range(13)), 2))
    assert whole.bucket(batch) is None  # nothing captured
    whole.load(batch)
    assert whole.input_ids[:40].tolist() == ids
    assert whole.positions[:40].tolist() == list(range(160, 200))
    assert whole.kv_rows[:40].tolist() == batch.kv_rows.tolist()
    assert whole.kv_rows[40:].tolist() == [-1] * 24  # no KV row (padding writes nothing) until a step writes them
    assert whole.cu_seqlens.tolist() == [0, 40]
    assert whole.context_lens.tolist() == [200]
    assert whole.state_slots.tolist() == [2]
    width = batch.block_tables.shape[1]
    assert whole.block_tables[0, :width].tolist() == batch.block_tables[0].tolist()


def _cuda_runner(tmp_path):
    from hybridcache.engine.runner import ModelRunner
    from hybridcache.kernels.backend import get_backend

    device = torch.device("cuda")
    model = load_model(write_tiny_model(tmp_path, "qwen3_next"), device=device, dtype=torch.bfloat16)
    kv, state = pool_bytes(model.state_specs(torch.bfloat16, torch.float32), BLOCK, model.slot_specs(torch.bfloat16))
    return ModelRunner(model, num_blocks=40, block_size=BLOCK, kernel_block_size=PAGE, num_slots=4,
                       state_pages=state_pages(state, kv), dtype=torch.bfloat16, state_dtype=torch.float32,
                       device=device, backend=get_backend(device), max_num_seqs=4, max_model_len=400,
                       max_num_batched_tokens=256, cuda_graphs=True)


@needs_cuda_engine
def test_cuda_sequence_graphs_equal_eager_and_pieces(tmp_path):
    """A fresh 160-token prompt (bucket 256: its slot holds another sequence's state, which it must not read), then
    three steps extending it by 40, 64 and 100 tokens (buckets 64, 64 with no padding row, 128): each replayed
    whole, then (pools restored) the same static batch eagerly, then the pieces. Whole replay == eager, logits
    and pools, bit for bit; the pieces give the same greedy tokens, logits and pool rows (but the scratch page's:
    the padding rows' KV) up to bf16 rounding (printed: whether bit for bit)."""
    runner = _cuda_runner(tmp_path)
    prefill = runner._prefill
    assert prefill is not None and prefill.sequence is not None
    whole = prefill.sequence
    assert sorted(whole.graphs) == [16, 32, 64, 128, 256]
    device = runner.device
    gen = torch.Generator().manual_seed(0)
    blocks = list(range(25))
    runner.execute(batch_of(SeqChunk(torch.randint(0, 300, (300,), generator=gen).tolist(), 0, blocks, 0),
                            device=device))  # slot 0 and the pages now hold a sequence the next one replaces
    start = 0
    pages = slice(0, runner.scratch_page)  # the pages a sequence can own (the scratch page is last)
    for new in (160, 40, 64, 100):
        batch = batch_of(SeqChunk(torch.randint(0, 300, (new,), generator=gen).tolist(), start, blocks, 0),
                         device=device)
        assert whole.bucket(batch) is not None
        before = snapshot(runner)
        results = []
        for mode in ("replay", "eager", "pieces"):
            for pool, saved in zip((*runner.pools.kv_groups, *runner.pools.state_groups), before):
                pool.copy_(saved)
            if mode == "replay":
                logits = runner.execute(batch)
            elif mode == "eager":
                with runner.without_replay():
                    logits = runner.execute(batch)
            else:
                prefill.sequence = None
                logits = runner.execute(batch)
                prefill.sequence = whole
            torch.cuda.synchronize()
            results.append((logits.clone(), snapshot(runner)))
        (replayed, replay_pools), (eager, eager_pools), (pieces, piece_pools) = results
        assert torch.isfinite(replayed).all()
        assert torch.equal(replayed, eager), new
        assert all(torch.equal(a, b) for a, b in zip(replay_pools, eager_pools)), new
        # against the pieces: the same real rows, but the padding rows differ (zeros here, stale rows there), and a
        # MoE expert's row count with them, which may change a grouped GEMM's kernel: equal up to bf16 rounding
        torch.testing.assert_close(replayed, pieces, rtol=2e-2, atol=2e-2)
        assert replayed.argmax(-1).tolist() == pieces.argmax(-1).tolist(), new
        kv_count = len(runner.pools.kv_groups)  # KV [layers, 2, pages, ...]: the pieces' padding rows write the
        # scratch page (the whole-step graph's write nothing)
        for a, b in zip(replay_pools[:kv_count], piece_pools[:kv_count]):
            torch.testing.assert_close(a[:, :, pages], b[:, :, pages], rtol=2e-2, atol=2e-2)
        for a, b in zip(replay_pools[kv_count:], piece_pools[kv_count:]):
            torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)
        print(f"+{new}: whole replay == pieces bit for bit: logits {torch.equal(replayed, pieces)}, pools "
              f"{all(torch.equal(a, b) for a, b in zip(replay_pools[kv_count:], piece_pools[kv_count:]))}")
        for pool, saved in zip((*runner.pools.kv_groups, *runner.pools.state_groups), replay_pools):
            pool.copy_(saved)
        start += new
