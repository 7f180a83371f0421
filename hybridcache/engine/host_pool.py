"""The host tier's memory: the device side of `HOST_SAVE`, `HOST_LOAD` and `HOST_FINISH` (`hybridcache.cache.plan`).

A host block holds the bytes of one scheduler block of the pool (KV, or a page of a checkpoint's state) laid out
as `PagedStates.gather_pages` lays them: [num_host_blocks, page_words] words, in pinned memory on CUDA (so the
copies are asynchronous) and plain memory on the CPU::

    HOST_SAVE   device blocks -> host blocks    gather the blocks' rows on the device, then one copy to the host
                                                per run of consecutive host ids
    HOST_FINISH runtime chunks -> host blocks   the pages a STATE_FINISH would have written, straight to the host
    HOST_LOAD   host blocks -> device blocks    one copy to the device per run of consecutive host ids, then
                                                scatter into the blocks' rows

Everything is queued on the current stream, in plan order (the cache orders a save of a block before any write
of it, and a load after the save that filled its host block), with no host synchronisation: the host ids are
known on the host (`DeviceCopyOp.host_ids`), the device ids stay on the device. The CPU never reads the host
blocks itself, so a copy into them that is still in flight is never observed early.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from hybridcache.engine.paged_state import PagedStates


class HostPool:
    """`num_blocks` host blocks of `paged.page_words` words (see the module docstring)."""

    def __init__(self, paged: PagedStates, num_blocks: int, *, pin: bool) -> None:
        if num_blocks < 1:
            raise ValueError(f"a host pool needs >= 1 block, got {num_blocks}")
        self.paged = paged
        # empty, not zeros: a host block is read only after a save or finish wrote it, and zeroing would cost
        # start-up time in proportion to the tier's size
        self.blocks = torch.empty((num_blocks, paged.page_words), dtype=paged.word_dtype, pin_memory=pin)

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
        data = torch.empty((len(host_ids), self.blocks.shape[1]), dtype=self.blocks.dtype,
                           device=device_blocks.device)
        for start, stop, first in _runs(host_ids):
            data[start:stop].copy_(self.blocks[first:first + stop - start], non_blocking=True)
        self.paged.scatter_pages(device_blocks, data)

    def _to_host(self, data: torch.Tensor, host_ids: Sequence[int]) -> None:
        if len(host_ids) != data.shape[0]:
            raise ValueError(f"{data.shape[0]} blocks for {len(host_ids)} host ids")
        for start, stop, first in _runs(host_ids):
            self.blocks[first:first + stop - start].copy_(data[start:stop], non_blocking=True)


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
