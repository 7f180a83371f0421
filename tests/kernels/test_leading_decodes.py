"""`gated_delta/fla.leading_decodes`: fla's view of a mixed step whose first sequences are decode rows (the rows run
in the step kernel; fla takes them as one throwaway sequence from a zero state). Host arithmetic and small device
ops, checked on the CPU; the kernels' results on such steps are checked on CUDA (`check_gated_delta`'s mixed
lengths, `test_cuda_backend.py`'s leading-decodes case)."""

from __future__ import annotations

import torch

from hybridcache.kernels.gated_delta.fla import CHUNK_SIZE, leading_decodes
from hybridcache.kernels.varlen import chunk_indices


def _lead(query_lens: list[int], context_lens: list[int], slots: list[int]):
    cu = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    return leading_decodes(cu, torch.tensor(context_lens, dtype=torch.int32), torch.tensor(slots), query_lens)


def test_the_docstring_example():
    lead = _lead([1, 1, 1, 40, 7], [10, 1, 30, 40, 50], [5, 2, 9, 4, 8])
    assert lead.count == 3
    assert lead.query_lens_cpu == (3, 40, 7)
    assert lead.cu_seqlens.tolist() == [0, 3, 43, 50] and lead.cu_seqlens.dtype == torch.int64
    assert lead.slots.tolist() == [4, 4, 8]  # the throwaway reads a real row (then zeroed), never writes one
    assert lead.fresh.tolist() == [True, True, False]  # the throwaway, a fresh 40-token prompt, a continuing chunk
    assert torch.equal(lead.chunks, chunk_indices(lead.cu_seqlens, (3, 40, 7), CHUNK_SIZE))


def test_a_fresh_one_token_prompt_counts_as_a_decode_row():
    lead = _lead([1, 1, 100], [1, 9, 100], [0, 1, 2])  # the first: a 1-token prompt (the step kernel zeroes it)
    assert lead.count == 2 and lead.query_lens_cpu == (2, 100) and lead.fresh.tolist() == [True, True]


def test_no_lead_without_a_leading_run_of_decodes_before_a_chunk():
    assert _lead([1, 1, 1], [5, 6, 7], [0, 1, 2]) is None  # all decode: the step kernel alone
    assert _lead([40, 1, 1], [40, 6, 7], [0, 1, 2]) is None  # a chunk first: fla for every sequence
    assert _lead([64], [64], [3]) is None
