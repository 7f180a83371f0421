"""The host tier's memory (`hybridcache.engine.host_pool`): blocks saved to the host and loaded back into other
blocks come back byte for byte (KV blocks and state pages alike), a runtime slot finished straight to the host
restores into a slot exactly, and nothing but the destinations changes (on CUDA through the side streams). The
streams' ordering contract is checked on the CPU with streams that log every call."""

from __future__ import annotations

import contextlib

import pytest
import torch

from hybridcache.engine.host_pool import CopyStreams, HostPool, _runs
from hybridcache.engine.paged_state import PagedStates
from tests.engine.test_paged_state import LAYOUTS, NUM_BLOCKS, make_pools

DEVICES = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])


def ids(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)


def streams_of(device: torch.device) -> CopyStreams | None:
    return CopyStreams(device) if device.type == "cuda" else None


@pytest.mark.parametrize("device", DEVICES, ids=str)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_blocks_saved_to_the_host_and_loaded_back_are_identical(layout, device):
    pools, ppb, k = make_pools(layout, device)
    paged = PagedStates(pools, pages_per_block=ppb, num_blocks=NUM_BLOCKS, k=k)
    host = HostPool(paged, 12, pin=device.type == "cuda", streams=streams_of(device))
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
    host = HostPool(paged, 2 * k, pin=device.type == "cuda", streams=streams_of(device))
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


class LoggedStreams:
    """`Streams` on the CPU that log every call: streams are names, events are ("event", n, stream), and a copy
    runs at once (so the bytes are checked too); `log` lists ("record", event), ("wait", stream, event),
    ("on", stream), ("off", stream) and ("keep", stream) in call order."""

    d2h, h2d = "d2h", "h2d"

    def __init__(self) -> None:
        self.log: list[tuple] = []
        self.num_events = 0

    def main(self) -> str:
        return "main"

    def record(self, stream: str) -> tuple:
        event = ("event", self.num_events, stream)
        self.num_events += 1
        self.log.append(("record", event))
        return event

    def wait(self, stream: str, event: tuple) -> None:
        self.log.append(("wait", stream, event))

    @contextlib.contextmanager
    def on(self, stream: str):
        self.log.append(("on", stream))
        yield
        self.log.append(("off", stream))

    def keep(self, tensor: torch.Tensor, stream: str) -> None:
        self.log.append(("keep", stream))

    def waits(self, stream: str) -> list[str]:
        """The streams whose events `stream` waited for, in order."""
        return [entry[2][2] for entry in self.log if entry[0] == "wait" and entry[1] == stream]


def test_copies_run_on_side_streams_ordered_by_events_and_saves_never_hold_the_forward():
    cpu = torch.device("cpu")
    pools, ppb, k = make_pools(sorted(LAYOUTS)[0], cpu)
    paged = PagedStates(pools, pages_per_block=ppb, num_blocks=NUM_BLOCKS, k=k)
    streams = LoggedStreams()
    host = HostPool(paged, 8, pin=False, streams=streams)
    want = paged.gather_pages(ids([5, 6], cpu)).clone()

    # step 1: a demotion (5, 6 -> host 0, 1); the forward stream waits for nothing
    host.save(ids([5, 6], cpu), [0, 1])
    assert streams.log == [("record", ("event", 0, "main")), ("wait", "d2h", ("event", 0, "main")),
                           ("on", "d2h"), ("off", "d2h"), ("keep", "d2h"), ("record", ("event", 1, "d2h"))]
    assert streams.waits("main") == []

    # step 2: the promotion of the same chain (host 0, 1 -> 20, 21): the load waits for that save, the forward
    # stream for the load before the scatter, and the staging buffer is kept for the forward stream
    streams.log.clear()
    host.load([0, 1], ids([20, 21], cpu))
    assert streams.log == [("wait", "h2d", ("event", 1, "d2h")), ("on", "h2d"), ("off", "h2d"),
                           ("record", ("event", 2, "h2d")), ("wait", "main", ("event", 2, "h2d")), ("keep", "main")]
    assert torch.equal(paged.gather_pages(ids([20, 21], cpu)), want)

    # step 3: host block 1 (freed by the load) takes a new save: it waits for its gather and for that load
    streams.log.clear()
    host.save(ids([7], cpu), [1])
    assert streams.waits("d2h") == ["main", "h2d"] and streams.waits("main") == []

    # one wait per event: a second load of host block 1 waits for step 3's save, a third one for nothing more
    streams.log.clear()
    host.load([1], ids([30], cpu))
    host.load([1], ids([31], cpu))
    assert streams.waits("h2d") == ["d2h"]
    assert streams.waits("main") == ["h2d", "h2d"]
    assert torch.equal(paged.gather_pages(ids([31], cpu)), paged.gather_pages(ids([7], cpu)))


def test_a_finish_to_the_host_runs_on_the_save_stream():
    cpu = torch.device("cpu")
    pools, ppb, k = make_pools(sorted(LAYOUTS)[0], cpu)
    paged = PagedStates(pools, pages_per_block=ppb, num_blocks=NUM_BLOCKS, k=k)
    streams = LoggedStreams()
    host = HostPool(paged, 2 * k, pin=False, streams=streams)
    host.finish(ids(list(range(k)), cpu), list(range(k)))
    assert ("on", "d2h") in streams.log and ("on", "h2d") not in streams.log
    assert streams.waits("d2h") == ["main"] and streams.waits("main") == []
