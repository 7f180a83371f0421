import pytest
import torch

from hybridcache.engine.input_builder import SeqChunk, build_forward_batch


def test_worked_example_from_the_docstring():
    batch = build_forward_batch(
        [SeqChunk([1, 2, 3, 4, 5], 20, [3, 7], slot=4), SeqChunk([9], 40, [1, 2, 5], slot=2)],
        block_size=16,
        kernel_block_size=8,
    )
    assert batch.positions.tolist() == [20, 21, 22, 23, 24, 40]
    assert batch.cu_seqlens.tolist() == [0, 5, 6]
    assert batch.context_lens.tolist() == [25, 41]
    assert batch.block_tables.tolist() == [[6, 7, 14, 15, 0, 0], [2, 3, 4, 5, 10, 11]]
    assert batch.slot_mapping.tolist() == [116, 117, 118, 119, 120, 88]
    assert batch.state_slots.tolist() == [4, 2]
    assert batch.logits_indices.tolist() == [4, 5]
    assert batch.query_lens_cpu == (5, 1) and batch.context_lens_cpu == (25, 41)
    assert batch.input_ids.dtype == torch.int64


@pytest.mark.parametrize("pages_per_block", [1, 2, 4])
def test_slot_mapping_matches_block_table(pages_per_block):
    kbs = 8
    block_size = kbs * pages_per_block
    chunk = SeqChunk(list(range(37)), 13, [5, 2, 9, 0, 11, 7, 3], slot=0)  # 50 tokens
    batch = build_forward_batch([chunk], block_size=block_size, kernel_block_size=kbs)
    pages = batch.block_tables[0].tolist()
    for row, pos in zip(batch.slot_mapping.tolist(), batch.positions.tolist()):
        assert row == pages[pos // kbs] * kbs + pos % kbs


def test_rejects_too_few_blocks_and_empty_chunks():
    with pytest.raises(ValueError, match="cannot hold"):
        build_forward_batch([SeqChunk([1] * 20, 0, [0], 0)], block_size=16, kernel_block_size=8)
    with pytest.raises(ValueError, match="at least one token"):
        build_forward_batch([SeqChunk([], 0, [0], 0)], block_size=16, kernel_block_size=8)
