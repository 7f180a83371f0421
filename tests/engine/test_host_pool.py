"""The host tier's memory (`hybridcache.engine.host_pool`): blocks saved to the host and loaded back into other
blocks come back byte for byte (KV blocks and state pages alike), a runtime slot finished straight to the host
restores into a slot exactly, and nothing but the destinations changes."""

from __future__ import annotations

import pytest
import torch

from hybridcache.engine.host_pool import HostPool, _runs
from hybridcache.engine.paged_state import PagedStates
from tests.engine.test_paged_state import LAYOUTS, NUM_BLOCKS, make_pools

DEVICES = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])


def ids(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)


@pytest.mark.parametrize("device", DEVICES, ids=str)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_blocks_saved_to_the_host_and_loaded_back_are_identical(layout, device):
    pools, ppb, k = make_pools(layout, device)
    paged = PagedStates(pools, pages_per_block=ppb, num_blocks=NUM_BLOCKS, k=k)
    host = HostPool(paged, 12, pin=device.type == "cuda")
    blocks = [5, 9, 2, 40, 41]
    before = paged.gather_pages(ids(blocks, device)).clone()
    host.save(ids(blocks, device), [3, 4, 5, 0, 11])  # runs (3, 4, 5), (0), (11)
    others = [7, 8, 1, 30, 31]
    untouched = [b for b in range(NUM_BLOCKS) if b not in others]
    rest = paged.gather_pages(ids(untouched, device)).clone()
    host.load([3, 4, 5, 0, 11], ids(others, device))
    assert torch.equal(paged.gather_pages(ids(others, device)), before)
    assert torch.equal(paged.gather_pages(ids(untouched, device)), rest)


@pytest.mark.parametrize("device", DEVICES, ids=str)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_slot_finished_to_the_host_restores_exactly(layout, device):
    pools, ppb, k = make_pools(layout, device)
    paged = PagedStates(pools, pages_per_block=ppb, num_blocks=NUM_BLOCKS, k=k)
    host = HostPool(paged, 2 * k, pin=device.type == "cuda")
    slot, other = 2, 4
    want = [_bytes(g[:, slot]) for g in pools.state_groups]  # as bytes: random bits include NaNs
    host.finish(ids([slot * k + j for j in range(k)], device), list(range(k, 2 * k)))
    pages = list(range(10, 10 + k))
    host.load(list(range(k, 2 * k)), ids(pages, device))
    paged.restore(ids(pages, device), ids([other * k + j for j in range(k)], device))
    for group, expected in zip(pools.state_groups, want):
        assert torch.equal(_bytes(group[:, other]), expected)


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(torch.uint8).clone()


def test_runs_of_consecutive_host_ids():
    assert list(_runs([4, 5, 6, 9, 2, 3])) == [(0, 3, 4), (3, 4, 9), (4, 6, 2)]
    assert list(_runs([7])) == [(0, 1, 7)]
    assert list(_runs([])) == []
