"""The host tier's memory: the device side of `HOST_SAVE`, `HOST_LOAD` and `HOST_FINISH` (`hybridcache.cache.plan`).

A host block holds the bytes of one scheduler block of the pool (KV, or a page of a checkpoint's state) laid out
as `PagedStates.gather_pages` lays them: [num_host_blocks, page_words] words, in pinned memory on CUDA (so the
copies are asynchronous) and plain memory on the CPU::

    HOST_SAVE   device blocks -> host blocks    gather the blocks' rows on the device, then one copy to the host
                                                per run of consecutive host ids
    HOST_FINISH runtime chunks -> host blocks   the pages a STATE_FINISH would have written, straight to the host
    HOST_LOAD   host blocks -> device blocks    one copy to the device per run of consecutive host ids, then
                                                scatter into the blocks' rows

Streams (CUDA; `CopyStreams`): the gathers and scatters run on the current (forward's) stream, in plan order,
so they read a freed block before this step's restores and forward write it, and write a promoted one before
they read it. The copies across PCIe run on two side streams, one per direction, ordered by events, with no
host synchronisation::

    forward stream   gather ─●─────────────── restores, forward ... ──────   (never waits for a save)
                             ╰─> d2h:  copy to host ─●                     saves overlap the forward
    forward stream   ...  ─────────────────────────────── wait ─ scatter ─ restores, forward
                          h2d:  (wait for the save that wrote the block) copy ─●─╯   a load precedes the forward

- a save's copy waits for its gather (an event on the forward stream), and for the last load that read any of
  its host blocks (a host block read by a load may be reused from the next step on);
- a load's copy waits for the last save that wrote any of its host blocks (a chain demoted and promoted again
  soon after, even within one step), and the forward stream waits for the load before its scatter;
- the staging buffers are kept alive for the stream that reads them last (`record_stream`).

The host ids are known on the host (`DeviceCopyOp.host_ids`), the device ids stay on the device, and the CPU
never reads the host blocks itself, so a copy into them that is still in flight is never observed early. On the
CPU (no streams) every copy runs in plan order, at once.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch

from hybridcache.engine.paged_state import PagedStates


class Streams(Protocol):
    """What `HostPool` needs of the device's streams (`CopyStreams` on CUDA; a test may log the calls)."""

    d2h: Any  # the side stream of device -> host copies
    h2d: Any  # the side stream of host -> device copies

    def main(self) -> Any:
        """The current stream (the forward's)."""

    def record(self, stream: Any) -> Any:
        """A new event recorded on `stream` now."""

    def wait(self, stream: Any, event: Any) -> None:
        """`stream` waits (on the device) for `event`."""

    def on(self, stream: Any) -> AbstractContextManager:
        """Make `stream` current within the block (allocations there are `stream`'s)."""

    def keep(self, tensor: torch.Tensor, stream: Any) -> None:
        """`tensor`'s memory is not reused before `stream`'s work queued so far is done."""


class CopyStreams:
    """The CUDA `Streams`: two side streams of `device` and its current stream."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.d2h = torch.cuda.Stream(device)
        self.h2d = torch.cuda.Stream(device)

    def main(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def record(self, stream: torch.cuda.Stream) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def wait(self, stream: torch.cuda.Stream, event: torch.cuda.Event) -> None:
        stream.wait_event(event)

    def on(self, stream: torch.cuda.Stream) -> AbstractContextManager:
        return torch.cuda.stream(stream)

    def keep(self, tensor: torch.Tensor, stream: torch.cuda.Stream) -> None:
        tensor.record_stream(stream)


class HostPool:
    """`num_blocks` host blocks of `paged.page_words` words (see the module docstring); `streams`: the side
    streams the copies run on (None: in plan order on the current stream, as on the CPU)."""

    def __init__(self, paged: PagedStates, num_blocks: int, *, pin: bool, streams: Streams | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"a host pool needs >= 1 block, got {num_blocks}")
        self.paged = paged
        # empty, not zeros: a host block is read only after a save or finish wrote it, and zeroing would cost
        # start-up time in proportion to the tier's size
        self.blocks = torch.empty((num_blocks, paged.page_words), dtype=paged.word_dtype, pin_memory=pin)
        self.streams = streams
        self._written: dict[int, Any] = {}  # host block -> event after the save that wrote it, until a load waits
        self._read: dict[int, Any] = {}  # host block -> event after the load that read it, until a save waits

    @property
    def num_blocks(self) -> int:
        return self.blocks.shape[0]

    @property
    def nbytes(self) -> int:
        return self.blocks.numel() * self.blocks.element_size()

    def save(self, device_blocks: torch.Tensor, host_ids: Sequence[int]) -> None:
        """HOST_SAVE: device block `device_blocks[i]` -> host block `host_ids[i]`."""
        self._to_host(self.paged.gather_pages(device_blocks), host_ids)

    def finish(self, chunks: torch.Tensor, host_ids: Sequence[int]) -> None:
        """HOST_FINISH: runtime chunk `chunks[i]` (whole slots, j in order) -> host block `host_ids[i]`."""
        self._to_host(self.paged.slot_chunks(chunks), host_ids)

    def load(self, host_ids: Sequence[int], device_blocks: torch.Tensor) -> None:
        """HOST_LOAD: host block `host_ids[i]` -> device block `device_blocks[i]` (destinations unique)."""
        streams = self.streams
        shape, dtype, device = (len(host_ids), self.blocks.shape[1]), self.blocks.dtype, device_blocks.device
        if streams is None:
            data = torch.empty(shape, dtype=dtype, device=device)
            self._copy_runs(data, host_ids, to_host=False)
            self.paged.scatter_pages(device_blocks, data)
            return
        for event in _pop_events(self._written, host_ids):
            streams.wait(streams.h2d, event)
        with streams.on(streams.h2d):
            data = torch.empty(shape, dtype=dtype, device=device)  # the side stream's memory: no wait to reuse it
            self._copy_runs(data, host_ids, to_host=False)
        done = streams.record(streams.h2d)
        for host_id in host_ids:
            self._read[host_id] = done
        main = streams.main()
        streams.wait(main, done)
        streams.keep(data, main)
        self.paged.scatter_pages(device_blocks, data)

    def read(self, host_ids: Sequence[int]) -> torch.Tensor:
        """[n, page_words] CPU copies of host blocks `host_ids` (for the disk tier), once the saves that wrote them
        are done: on CUDA a wait on the host only for a save of those blocks still in flight."""
        self._wait_on_host(self._written, host_ids)
        return self.blocks[list(host_ids)].clone()

    def write(self, host_ids: Sequence[int], data: torch.Tensor) -> None:
        """Host blocks `host_ids` take the rows of CPU tensor `data` (a disk tier's bytes, before the plan that
        loads them runs), once the copies that last wrote or read those blocks are done (on CUDA a wait on the
        host only for one still in flight)."""
        self._wait_on_host(self._written, host_ids)
        self._wait_on_host(self._read, host_ids)
        self.blocks[list(host_ids)] = data.to(self.blocks.dtype)

    def _wait_on_host(self, table: dict[int, Any], host_ids: Sequence[int]) -> None:
        for event in _pop_events(table, host_ids):
            event.synchronize()

    def _to_host(self, data: torch.Tensor, host_ids: Sequence[int]) -> None:
        if len(host_ids) != data.shape[0]:
            raise ValueError(f"{data.shape[0]} blocks for {len(host_ids)} host ids")
        streams = self.streams
        if streams is None:
            self._copy_runs(data, host_ids, to_host=True)
            return
        streams.wait(streams.d2h, streams.record(streams.main()))  # the gather is done
        for event in _pop_events(self._read, host_ids):
            streams.wait(streams.d2h, event)
        with streams.on(streams.d2h):
            self._copy_runs(data, host_ids, to_host=True)
        streams.keep(data, streams.d2h)
        done = streams.record(streams.d2h)
        for host_id in host_ids:
            self._written[host_id] = done

    def _copy_runs(self, data: torch.Tensor, host_ids: Sequence[int], *, to_host: bool) -> None:
        """data[i] <-> host block host_ids[i], one copy per run of consecutive host ids (on the current stream)."""
        for start, stop, first in _runs(host_ids):
            host = self.blocks[first:first + stop - start]
            if to_host:
                host.copy_(data[start:stop], non_blocking=True)
            else:
                data[start:stop].copy_(host, non_blocking=True)


def _pop_events(table: dict[int, Any], host_ids: Sequence[int]) -> list[Any]:
    """The distinct events `table` holds for `host_ids`, taken out of it (one wait orders every later copy of that
    side stream too)."""
    events: dict[int, Any] = {}
    for host_id in host_ids:
        event = table.pop(host_id, None)
        if event is not None:
            events[id(event)] = event
    return list(events.values())


def _runs(host_ids: Sequence[int]) -> Iterator[tuple[int, int, int]]:
    """(start, stop, first host id) of each run of consecutive ids: host_ids[start:stop] == first, first + 1, ...

    >>> list(_runs([4, 5, 6, 9, 2, 3]))
    [(0, 3, 4), (3, 4, 9), (4, 6, 2)]
    """
    start = 0
    for i in range(1, len(host_ids) + 1):
        if i == len(host_ids) or host_ids[i] != host_ids[i - 1] + 1:
            yield start, i, host_ids[start]
            start = i


def measure_copy_rates(device: torch.device, dtype: torch.dtype) -> tuple[float, float]:
    """(host -> device bytes/s, dense matmul FLOP/s) of `device`, what `CostModel.promotion_pays` weighs: on CUDA
    one timed 64 MiB copy from pinned memory and one timed 4,096-cubed matmul in `dtype` (after a warm-up each; at
    start-up, so the synchronisation costs nothing later); on the CPU (inf, 1e15): a host block is a memcpy away,
    so a promotion always pays."""
    if device.type != "cuda":
        return float("inf"), 1e15
    host = torch.empty(64 << 20, dtype=torch.uint8, pin_memory=True)
    target = torch.empty_like(host, device=device)
    a = torch.randn(4096, 4096, dtype=dtype, device=device)

    def timed(run) -> float:
        run()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1000

    bandwidth = host.numel() / timed(lambda: target.copy_(host, non_blocking=True))
    flops = 2 * 4096 ** 3 / timed(lambda: a @ a)
    return bandwidth, flops
