"""The engine's glue between the prefix cache's host tier and the disk tier (`engine/disk_tier.py`).

Two directions, both in the engine's process (tensor_parallel_size 1):

- `keep` (the host tier's fall-out callback, `PrefixCache.on_host_fall_out`): a host checkpoint the host tier's
  own eviction drops is read before its blocks are freed: its state and the chain blocks the disk lacks, from the
  host pool (host blocks) or the device pool (device blocks: a device-to-host copy, which on CUDA waits for the
  steps queued), and handed to the disk tier's writer thread.
- `fault_in` (when a request is added): the prompt's deepest usable state on disk, when it is deeper than what
  the device tier would hit, is read (checked) and put into the host tier with the chain blocks neither tier
  holds (`PrefixCache.adopt_stored`); the bytes go into the host pool at once, so the request's match promotes
  it as any host hit, in its step's plan.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hybridcache.cache import PrefixCache
from hybridcache.cache.host_tier import FallOut
from hybridcache.cache.request import CacheRequest
from hybridcache.engine.disk_tier import DiskTier
from hybridcache.engine.runner import ModelRunner


class DiskKeeper:
    """Keeps what `cache`'s host tier drops in `disk`, and gives it back (see the module docstring)."""

    def __init__(self, disk: DiskTier, cache: PrefixCache, runner: ModelRunner, block_size: int) -> None:
        if runner.host_pool is None:
            raise ValueError("the disk tier sits behind the host tier: the runner has no host pool")
        self.disk, self.cache, self.runner, self.block_size = disk, cache, runner, block_size
        self.num_not_kept = 0  # host fall-outs that could not be kept (`HostTier.fall_out` is None)
        cache.on_host_fall_out(self.keep)

    def keep(self, fall_out: FallOut | None) -> None:
        if fall_out is None:
            self.num_not_kept += 1
            return
        new_state, missing = self.disk.wants(fall_out)
        if not new_state and not missing:
            return
        blocks: dict[int, torch.Tensor] = {}
        on_host = [i for i in missing if fall_out.blocks[i].on_host]
        on_device = [i for i in missing if not fall_out.blocks[i].on_host]
        if on_host:
            rows = self.runner.host_pool.read([fall_out.blocks[i].block_id for i in on_host])
            blocks.update(zip(on_host, rows, strict=True))
        if on_device:
            ids = torch.tensor([fall_out.blocks[i].block_id for i in on_device], dtype=torch.int64)
            rows = self.runner.paged_states.gather_pages(ids).cpu()
            blocks.update(zip(on_device, rows, strict=True))
        state = self.runner.host_pool.read(fall_out.state_host_ids) if new_state else None
        self.disk.put(fall_out, blocks, state)

    def fault_in(self, prompt_ids: Sequence[int]) -> bool:
        """Put the prompt's deepest usable state on disk into the host tier when the device tier holds nothing as
        deep; whether it did."""
        request = CacheRequest("disk-probe", tuple(prompt_ids))
        hit = self.disk.find(prompt_ids, self.block_size, self.cache.max_match_step(request))
        if hit is None or self.cache.probe(request).cached_len >= hit.state.step:
            return False
        got: list[tuple[torch.Tensor, torch.Tensor]] = []

        def read(missing: tuple[int, ...]) -> bool:
            data = self.disk.read(hit, missing)
            if data is not None:
                got.append(data)
            return data is not None

        placed = self.cache.adopt_stored(hit.stored(), read)
        if placed is None:
            return False
        block_ids, state_ids = placed
        blocks, state = got[0]
        if block_ids:
            self.runner.host_pool.write([block_ids[i] for i in sorted(block_ids)], blocks)
        self.runner.host_pool.write(state_ids, state)
        return True

    def stats(self) -> dict:
        """The disk tier's counters (`DiskStats`) with the host tier's fall-outs it could not keep."""
        stats = vars(self.disk.stats).copy()
        stats["num_not_kept"] = self.num_not_kept
        return stats

    def close(self) -> None:
        """Write what is queued and stop the writer."""
        self.disk.close()
