import pytest
import torch

from hybridcache.cache.plan import CopyKind, CopyOp, CopyPlan
from hybridcache.engine.input_builder import PageRows, SeqChunk, build_forward_batch, device_copies


def test_worked_example_from_the_docstring():
    batch = build_forward_batch(
        [SeqChunk([1, 2, 3, 4, 5], 20, [3, 7], slot=4), SeqChunk([9], 40, [1, 2, 5], slot=2)],
        block_size=16,
        kernel_block_size=8,
    )
    assert batch.positions.tolist() == [20, 21, 22, 23, 24, 40]
    assert batch.cu_seqlens.tolist() == [0, 5, 6]
    assert batch.context_lens.tolist() == [25, 41]
    assert batch.block_tables.tolist() == [[6, 7, 14, 15] + [0] * 12, [2, 3, 4, 5, 10, 11] + [0] * 10]
    assert batch.kv_rows.tolist() == [116, 117, 118, 119, 120, 88]
    assert batch.state_slots.tolist() == [4, 2]
    assert batch.logits_indices.tolist() == [4, 5]
    assert batch.query_lens_cpu == (5, 1) and batch.context_lens_cpu == (25, 41)
    assert batch.input_ids.dtype == torch.int64


@pytest.mark.parametrize("pages_per_block", [1, 2, 4])
def test_kv_rows_match_block_table(pages_per_block):
    kbs = 8
    block_size = kbs * pages_per_block
    chunk = SeqChunk(list(range(37)), 13, [5, 2, 9, 0, 11, 7, 3], slot=0)  # 50 tokens
    batch = build_forward_batch([chunk], block_size=block_size, kernel_block_size=kbs)
    pages = batch.block_tables[0].tolist()
    for row, pos in zip(batch.kv_rows.tolist(), batch.positions.tolist()):
        assert row == pages[pos // kbs] * kbs + pos % kbs


@pytest.mark.parametrize("num_tokens", [1, 8, 9, 128, 129, 300])
def test_block_table_width_is_a_multiple_of_16(num_tokens):
    """One row stride specialisation for Triton whatever the batch: never 1, always divisible by 16."""
    blocks = list(range(-(-num_tokens // 8)))
    batch = build_forward_batch([SeqChunk([1] * num_tokens, 0, blocks, slot=0)], block_size=8, kernel_block_size=8)
    width = batch.block_tables.shape[1]
    assert width % 16 == 0 and width >= len(blocks)
    assert batch.block_tables[0, : len(blocks)].tolist() == blocks


def _fields(batch):
    return {name: getattr(batch, name).tolist() for name in ("block_tables", "kv_rows", "state_slots", "positions")}


@pytest.mark.parametrize("pages_per_block", [1, 4])
def test_kept_page_rows_give_the_batch_a_fresh_build_gives(pages_per_block):
    """`PageRows` kept across steps: each step's batch equals one built afresh, while a slot's blocks grow, while
    another sequence takes a slot with other blocks (or the same ones), and when a block is replaced in place (a
    private copy of a frozen tail); and a row is reused only for equal block ids."""
    kbs, block_size = 8, 8 * pages_per_block
    kept = PageRows(pages_per_block)
    steps = [
        [SeqChunk([1], 20, [3, 7, 9], slot=0), SeqChunk([2, 3], 5, [4], slot=1)],
        [SeqChunk([1], 21, (3, 7, 9), slot=0), SeqChunk([4], 6, [4], slot=1)],  # the same blocks (tuple or list)
        [SeqChunk([1], 22, [3, 7, 9, 2], slot=0), SeqChunk([5], 7, [6], slot=1)],  # grown; block 4 -> 6 in place
        [SeqChunk([6, 6], 0, [4], slot=0), SeqChunk([1], 23, [3, 7, 9, 2], slot=3)],  # slots taken by others
    ]
    for chunks in steps:
        got = build_forward_batch(chunks, block_size=block_size, kernel_block_size=kbs, page_rows=kept)
        want = build_forward_batch(chunks, block_size=block_size, kernel_block_size=kbs)
        assert _fields(got) == _fields(want)
    row = kept.pages(3, [3, 7, 9, 2])
    assert kept.pages(3, [3, 7, 9, 2]) is row and kept.pages(3, [3, 7, 9, 5]) is not row
    last = [5 * pages_per_block + j for j in range(pages_per_block)]
    assert list(kept.pages(3, [3, 7, 9, 5]))[-pages_per_block:] == last
    with pytest.raises(ValueError, match="pages a block"):
        build_forward_batch(steps[0], block_size=2 * block_size, kernel_block_size=kbs, page_rows=kept)


def test_rejects_too_few_blocks_and_empty_chunks():
    with pytest.raises(ValueError, match="cannot hold"):
        build_forward_batch([SeqChunk([1] * 20, 0, [0], 0)], block_size=16, kernel_block_size=8)
    with pytest.raises(ValueError, match="at least one token"):
        build_forward_batch([SeqChunk([], 0, [0], 0)], block_size=16, kernel_block_size=8)


def _offset_in_packed(tensor: torch.Tensor) -> int:
    return tensor.data_ptr() - tensor.untyped_storage().data_ptr()


def test_every_field_and_copy_id_list_starts_16_byte_aligned():
    """Triton specialises kernels on 16-byte pointer alignment: fields whose offsets followed odd lengths (3 + 1
    tokens, 3 copy pairs) would flip it from step to step and compile extra variants mid-serving."""
    plan = CopyPlan((CopyOp(CopyKind.KV_RESTORE, (1, 2, 3), (4, 5, 6)), CopyOp(CopyKind.STATE_SAVE, (7,), (8,))))
    batch = build_forward_batch([SeqChunk([1, 2, 3], 0, [0], slot=1), SeqChunk([4], 9, [1], slot=2)],
                                block_size=16, kernel_block_size=8, copies=plan)
    ids = [batch.input_ids, batch.positions, batch.kv_rows, batch.state_slots, batch.logits_indices,
           *(t for op in batch.copies for t in (op.src_ids, op.dst_ids))]
    assert [_offset_in_packed(t) % 16 for t in ids] == [0] * len(ids)
    assert [(op.src_ids.tolist(), op.dst_ids.tolist()) for op in batch.copies] == [([1, 2, 3], [4, 5, 6]), ([7], [8])]
    assert batch.state_slots.tolist() == [1, 2] and batch.input_ids.tolist() == [1, 2, 3, 4]
    alone = device_copies(plan, "cpu")
    assert [_offset_in_packed(t) % 16 for op in alone for t in (op.src_ids, op.dst_ids)] == [0] * 4
    assert [(op.src_ids.tolist(), op.dst_ids.tolist()) for op in alone] == [([1, 2, 3], [4, 5, 6]), ([7], [8])]
