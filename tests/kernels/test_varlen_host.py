"""The varlen index tables built on the host (`kernels/varlen.py`): the chunk table equals the device-built one
for any lengths, dtype and chunk; `any_fresh` from the host lengths; on CUDA the table comes without a host sync,
a CUDA graph that builds one reads the step's device lengths at replay, and fla's chunked rule with the host's
"no fresh sequence" (no mask) is bit-identical to the masked call."""

from __future__ import annotations

import random

import pytest
import torch

from hybridcache.kernels.varlen import _device_chunk_indices, any_fresh, chunk_indices, fresh_mask

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _cu(lengths, dtype=torch.int64, device="cpu") -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()], dtype=dtype, device=device)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_host_chunk_table_equals_the_device_built_one(dtype: torch.dtype) -> None:
    rng = random.Random(0)
    cases = [(3, 1, 5), (200,), (16200 - 16000,), (64, 65, 63, 1, 128), (1,) * 9]
    cases += [tuple(rng.randint(1, 700) for _ in range(rng.randint(1, 12))) for _ in range(20)]
    for lengths in cases:
        for chunk in (2, 64, 128):
            cu = _cu(lengths, dtype)
            host, device = chunk_indices(cu, lengths, chunk), _device_chunk_indices(cu, lengths, chunk)
            assert host.dtype == dtype and host.shape == device.shape
            assert torch.equal(host, device), (lengths, chunk)
    assert chunk_indices(_cu((3, 1, 5), dtype), (3, 1, 5), 2).tolist() == [[0, 0], [0, 1], [1, 0], [2, 0], [2, 1],
                                                                              [2, 2]]  # the module's example


def test_empty_batch_has_an_empty_table() -> None:
    table = chunk_indices(torch.zeros(1, dtype=torch.int64), (), 64)
    assert table.shape == (0, 2) and table.dtype == torch.int64


def test_any_fresh_agrees_with_the_device_mask() -> None:
    cases = [((3, 7, 5), (3, 1, 5)), ((16200,), (200,)), ((10, 1), (10, 1)), ((64, 65), (1, 1))]
    for context, query in cases:
        mask = fresh_mask(_cu(query), torch.tensor(context))
        assert any_fresh(context, query) == bool(mask.any())
    with pytest.raises(ValueError):
        any_fresh((1, 2), (1,))  # lengths of different batches


@needs_cuda
def test_cuda_host_chunk_table_without_sync_and_under_capture() -> None:
    device = torch.device("cuda")
    lengths = (1, 17, 63, 64, 65, 200, 1500)
    cu = _cu(lengths, device=device)
    chunk_indices(cu, lengths, 64)  # warm the pinned allocator
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        table = chunk_indices(cu, lengths, 64)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(table, _device_chunk_indices(cu, lengths, 64))
    # captured: built from the device lengths at each replay
    other = (65, 17, 63, 64, 1, 200, 1500)  # the same number of blocks, seq 0 and 4 swapped
    static = cu.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        chunk_indices(static, lengths, 64)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = chunk_indices(static, lengths, 64)
    static.copy_(_cu(other, device=device))
    for _ in range(8):  # the host's pinned buffers turn over meanwhile
        chunk_indices(cu, lengths, 64)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, _device_chunk_indices(static, other, 64))


@needs_cuda
@pytest.mark.parametrize("history", [(5, 100, 64, 37), (0, 100, 0, 37)], ids=["no-fresh", "some-fresh"])
def test_cuda_fla_without_the_mask_is_bit_identical(history: tuple[int, ...]) -> None:
    pytest.importorskip("fla")
    from hybridcache.kernels.gated_delta.fla import chunk_gated_delta_rule_varlen
    from tests.kernels.cuda_checks import _gdn_inputs, varlen_batch

    device = torch.device("cuda")
    lengths = (17, 63, 200, 65)
    batch = varlen_batch(lengths, history, device)
    gen = torch.Generator().manual_seed(1)
    q, k, v, g, beta = _gdn_inputs(sum(lengths), (2, 4), (128, 128), torch.bfloat16, device, gen)
    pool = (0.1 * torch.randn(batch.num_slots, 4, 128, 128, generator=gen)).to(device)
    results = []
    for host in (None, batch.context_lens_cpu):
        state = pool.clone()
        out = chunk_gated_delta_rule_varlen(q, k, v, g, beta, state, batch.state_slots, batch.cu_seqlens,
                                            batch.context_lens, batch.query_lens_cpu, context_lens_cpu=host)
        results.append((out, state))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
