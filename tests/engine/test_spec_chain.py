"""The async speculative steps' glue in graphs (`engine/spec_chain.py`: `ChainTables`, `ChainGraphs`), on the CPU.

`ChainGraphs` runs its work without capture on the same buffers its graphs replay on CUDA, over every row of a
bucket (the rows past the step's as padding rows). Checked here against the eager glue the CPU engine runs
(`next_verify_batch` after the rollback select, `DraftGraphs.run_after_verify`): the same rollback in the state
pools, the same verify inputs and near pages for the step's rows (a row that stops becomes a padding row), padding
rows past them, and the same device values (accepted counts, drafts, target argmaxes) from the same verify outputs.
`ChainTables` writes a row only when its sequence or its blocks change.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from hybridcache.config import EngineConfig
from hybridcache.engine.engine import LLMEngine
from hybridcache.engine.input_builder import SeqChunk, build_forward_batch
from hybridcache.engine.runner import _DecodeGraphs
from hybridcache.engine.spec_chain import ChainGraphs, ChainTables, next_verify_batch, select_rows

from .model_folders import write_tiny_model
from .spec_helpers import cpu_drafting_graphs, spec

K = 2
CONFIG = {"block_size": 16, "kernel_block_size": 8, "max_num_batched_tokens": 96, "max_num_seqs": 6,
          "max_model_len": 200}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    engine = LLMEngine(write_tiny_model(tmp_path_factory.mktemp("chain"), "qwen3_next"),
                       EngineConfig(**CONFIG, speculative_config=spec(K)))
    cpu_drafting_graphs(engine)
    yield engine
    engine.close()


def _chain(engine) -> ChainGraphs:
    """ChainGraphs on the engine's CPU runner, over verify buffers like the ones its CUDA runner captures."""
    runner = engine.runner
    verify = _DecodeGraphs((1, 2, 4, 8), width=-(-(engine.max_model_len + 2 * K) // runner.kernel_block_size),
                           max_model_len=engine.max_model_len, scratch_slot=runner.scratch_slot,
                           scratch_page=runner.scratch_page, kernel_block_size=runner.kernel_block_size,
                           device=runner.device, num_drafts=K,
                           scratch_drafts=runner.draft_slots(runner.scratch_slot, K))
    return ChainGraphs(verify, runner._draft_graphs, runner.chain_tables, runner.pools.state_groups, k=K,
                       kernel_block_size=runner.kernel_block_size, draft_base=runner.draft_base,
                       scratch_slot=runner.scratch_slot, scratch_page=runner.scratch_page,
                       scratch_drafts=torch.tensor(runner.draft_slots(runner.scratch_slot, K)))


def _step(engine, starts: list[int], slots: list[int], seed: int):
    """A uniform verify step t of len(starts) rows (row r: its last token and K drafts at starts[r] ..; its own
    blocks), its chunks for `ChainTables` and random device values of it (accepted counts 0..K, drafts, target
    argmaxes)."""
    runner, block_size = engine.runner, CONFIG["block_size"]
    gen = torch.Generator().manual_seed(seed)
    chunks, seqs = [], []
    for r, (start, slot) in enumerate(zip(starts, slots, strict=True)):
        blocks = tuple(range(10 * r + 1, 10 * r + 1 + -(-(start + 3 * K + 1) // block_size)))
        tokens = torch.randint(0, 256, (1 + K,), generator=gen).tolist()
        seq = SimpleNamespace(seq_id=100 + r, stops=set())
        chunks.append(SimpleNamespace(seq=seq, block_ids=blocks))
        seqs.append(SeqChunk(token_ids=tokens, start=start, block_ids=blocks, slot=slot))
    batch = build_forward_batch(seqs, block_size=block_size, kernel_block_size=runner.kernel_block_size,
                                draft_slots=[runner.draft_slots(slot, K) for slot in slots])
    n = len(starts)
    accepted = torch.randint(0, K + 1, (n,), generator=gen)
    values = torch.cat([accepted, torch.randint(0, 256, (K * n + n * (1 + K),), generator=gen)])
    return batch, chunks, values


def _values(values: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    q = 1 + K
    return values[:n], values[n + K * n:].view(n, q)


def test_chain_prep_on_the_verify_buffers_equals_the_eager_glue(engine):
    """`ChainGraphs.prepare` (its prep work on the verify buffers, bucket 4 for 3 rows) queues the rollback and
    writes the next verify inputs the eager glue builds (`select_rows` + `next_verify_batch`): rows 0-2 equal, a
    row whose emitted tokens hold its stop token a padding row in both, row 3 a padding row."""
    runner, chain = engine.runner, _chain(engine)
    starts, slots = [20, 37, 50], [0, 2, 5]
    batch, chunks, values = _step(engine, starts, slots, seed=1)
    accepted, target = _values(values, 3)
    chunks[1].seq.stops = {int(target[1, accepted[1]])}  # row 1 emits its stop token: a padding row next
    runner.chain_tables.update(chunks, lambda seq: seq.stops)
    n, size = 3, 4
    groups = runner.pools.state_groups
    for group in groups:
        group.copy_(torch.randn(group.shape, generator=torch.Generator().manual_seed(3)).to(group.dtype))
    before = [group.clone() for group in groups]

    source = select_rows(batch.state_slots, values[:n], k=K, draft_base=runner.draft_base)
    for group in groups:
        group.index_copy_(1, batch.state_slots, group.index_select(1, source))
    want, want_near = next_verify_batch(
        batch, values, runner.chain_tables.tables[:n], runner.chain_tables.stops[:n], k=K,
        kernel_block_size=runner.kernel_block_size, scratch_slot=runner.scratch_slot,
        scratch_page=runner.scratch_page, scratch_drafts=torch.tensor(runner.draft_slots(runner.scratch_slot, K)),
        host_lengths=True)
    rolled = [group.clone() for group in groups]
    for group, old in zip(groups, before, strict=True):
        group.copy_(old)

    chain.verify.load(batch, size)
    got, near = chain.prepare(batch, values, size, replay=False)
    kept = [s for s in range(groups[0].shape[1]) if s != runner.scratch_slot]  # (padding rows write the scratch)
    for group, expected in zip(groups, rolled, strict=True):
        assert torch.equal(group[:, kept], expected[:, kept])
    assert not all(torch.equal(group, old) for group, old in zip(groups, before, strict=True))
    assert torch.equal(near, want_near)
    for name in ("input_ids", "positions", "kv_rows", "state_slots", "context_lens", "block_tables", "draft_slots"):
        assert torch.equal(getattr(got, name).to(torch.int64), getattr(want, name).to(torch.int64)), name
    assert int(got.state_slots[1]) == runner.scratch_slot and got.positions[3:6].tolist() == [0, 1, 2]
    assert int(got.state_slots[0]) == slots[0] and int(got.positions[0]) == starts[0] + int(accepted[0]) + 1
    v, q = chain.verify, 1 + K
    assert v.positions[n * q: size * q].tolist() == [0, 1, 2] and int(v.state_slots[n]) == runner.scratch_slot
    assert v.kv_rows[n * q: size * q].tolist() == [runner.scratch_page * runner.kernel_block_size + i for i in range(q)]
    assert int(v.block_tables[n, 0]) == runner.scratch_page and int(v.context_lens[n]) == q
    assert v.draft_slots[n * K: size * K].tolist() == list(runner.draft_slots(runner.scratch_slot, K))
    assert chain.owns(got) and not chain.owns(batch)


def test_chain_drafting_from_the_verify_buffers_equals_run_after_verify(engine):
    """`ChainGraphs.draft` (its after work over all 4 rows of the bucket, then the drafting graph's work) gives
    the values `DraftGraphs.run_after_verify` gives for the step's 3 rows from the same logits and hidden rows."""
    runner, chain = engine.runner, _chain(engine)
    drafting = runner._draft_graphs
    n, size, q = 3, 4, 1 + K
    batch, chunks, _ = _step(engine, [30, 41, 66], [1, 3, 4], seed=5)
    gen = torch.Generator().manual_seed(7)
    vocab, hidden_size = runner.model.config.vocab_size, runner.model.config.hidden_size
    logits = torch.randn(size + size * K, vocab, generator=gen)
    logits[torch.arange(size * (1 + K)), torch.randint(0, vocab, (size * (1 + K),), generator=gen)] += 50
    hidden = torch.randn(size * q, hidden_size, generator=gen)
    ids = batch.input_ids.view(n, q).clone()  # drafts that the target's argmax keeps for a while
    target = torch.cat([logits[size: size + n * K].argmax(-1).view(n, K), logits[:n].argmax(-1)[:, None]], dim=1)
    ids[0, 1:] = target[0, :K]
    ids[1, 1] = target[1, 0]
    batch = SimpleNamespace(**{f: getattr(batch, f) for f in (
        "positions", "kv_rows", "state_slots", "context_lens", "block_tables", "context_lens_cpu", "draft_slots",
        "draft_slots_cpu", "cu_seqlens", "logits_indices", "query_lens_cpu", "draft_rows", "copies", "embeds",
        "rope_positions", "prompt_logits_rows", "embed_rows")}, input_ids=ids.reshape(-1), num_seqs=n)
    runner.chain_tables.update(chunks, lambda seq: seq.stops)
    near = torch.stack([runner.chain_tables.tables[r, int(batch.positions[r * q]) // runner.kernel_block_size:][
        : chain.near.shape[1]] for r in range(n)])
    rows = torch.cat([logits[:n], logits[size: size + n * K]])
    want = drafting.run_after_verify(batch, rows, hidden, near, size, replay=False)

    chain.verify.load(batch, size)
    chain.verify.outputs[size], chain.verify.hidden[size] = logits, hidden
    chain.near[:n] = near
    chain.near[n:size] = runner.scratch_page
    got = chain.draft(n, size, replay=False)
    assert torch.equal(got, want)
    assert got[:n].tolist()[:2] == [K, 1]


def test_chain_tables_write_only_the_rows_that_change():
    """A row is written when its sequence or its blocks change, not otherwise; pages and stop tokens as given."""
    tables = ChainTables(4, 16, pages_per_block=2, scratch_page=99, device=torch.device("cpu"))
    seqs = [SimpleNamespace(seq_id=i, stops={7, 3 + i}) for i in range(3)]
    chunks = [SimpleNamespace(seq=seqs[i], block_ids=(2 * i, 2 * i + 1)) for i in range(3)]
    calls = []
    original = tables.tables.index_copy_

    def counted(dim, index, source):
        calls.append(index.tolist())
        return original(dim, index, source)

    tables.tables.index_copy_ = counted
    tables.update(chunks, lambda seq: seq.stops)
    assert calls == [[0, 1, 2]]
    assert tables.tables[1, :5].tolist() == [4, 5, 6, 7, 99] and tables.stops[2, :3].tolist() == [5, 7, -1]
    tables.update(chunks, lambda seq: seq.stops)
    assert calls == [[0, 1, 2]]
    chunks[1] = SimpleNamespace(seq=seqs[1], block_ids=(2, 3, 8))
    tables.update(chunks[1:], lambda seq: seq.stops)  # (rows move up when a sequence ends)
    assert calls == [[0, 1, 2], [0, 1]]
    assert tables.tables[0, :7].tolist() == [4, 5, 6, 7, 16, 17, 99] and tables.tables[1, :5].tolist() == [
        8, 9, 10, 11, 99]
    assert tables.stops[0, :3].tolist() == [4, 7, -1] and tables.stops[1, :3].tolist() == [5, 7, -1]
