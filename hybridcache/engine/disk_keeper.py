"""The engine's side of the prefix cache's tier behind the host tier (`cache/host_tier.TierBehind`): the disk tier.

`DiskKeeper` is handed to the `PrefixCache` when the scheduler is built (`tier_behind`), so the cache stays the
scheduler's alone; it holds the runner (whose pools hold the bytes) and the files (`engine/disk_tier.py`), all in
the engine's process (tensor_parallel_size 1):

- `keep`: a host checkpoint the host tier's own eviction drops is read before its blocks are freed: its state and
  the chain blocks the disk lacks, from the host pool (host blocks) or the device pool (device blocks: a
  device-to-host copy, which on CUDA waits for the queued steps), and handed to the disk tier's writer thread.
  At shutdown the same for every checkpoint the cache holds, device-resident ones included (their state is read
  from the device pool).
- `find`, `read`, `placed`: on a match, the prompt's usable states on disk, deepest first; the deepest one that is
  deeper than what the device and host tiers hold and fits in the host tier (its state and the chain blocks
  neither tier holds) is read (and checked), its bytes written into the host pool at once, and it is hung in the
  host tier, so the match promotes it as any host hit, in its step's plan.
- `clear`: the prefix cache was cleared (`LLM.reset_prefix_cache`): the disk tier's files go too.

A host tier smaller than one state's pages and a block can never take a checkpoint back: the keeper says so at
start-up (the disk would only be written).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

import torch
from tqdm.auto import tqdm

from hybridcache.cache.host_tier import FallOut, StoredCheckpoint
from hybridcache.cache.request import CacheRequest
from hybridcache.cache.trie import RootKey, chain_hash, prompt_block_hashes
from hybridcache.engine.disk_tier import DiskHit, DiskTier
from hybridcache.engine.host_pool import HostPool
from hybridcache.engine.paged_state import PagedStates

SHUTDOWN_WRITE_BYTES = 1 << 30  # at shutdown, the writer is waited for whenever this much is queued
_logger = logging.getLogger("hybridcache.disk")


class DiskKeeper:
    """The disk tier as the prefix cache's `TierBehind` (see the module docstring)."""

    def __init__(self, disk: DiskTier, paged: PagedStates, host_pool: HostPool) -> None:
        self.disk, self.paged, self.host_pool = disk, paged, host_pool
        self.num_not_kept = 0  # host fall-outs that could not be kept (`HostTier.fall_out` is None)
        self.num_put_bytes = 0  # bytes handed to the writer thread
        self._hits: dict[StoredCheckpoint, DiskHit] = {}  # the last match's, until the next one
        self._read: dict[StoredCheckpoint, tuple[torch.Tensor, torch.Tensor]] = {}
        if host_pool.num_blocks < paged.k + 1:
            _logger.warning(
                "hybridcache: a host tier of %d blocks cannot take back any disk checkpoint (one needs its %d state "
                "pages and a block of its chain or its frozen tail in the host tier at once): the disk tier at %s "
                "will be written, never read; raise host_cache_gib", host_pool.num_blocks, paged.k, disk.dir)

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
            rows = self.host_pool.read([fall_out.blocks[i].block_id for i in on_host])
            blocks.update(zip(on_host, rows, strict=True))
        if on_device:
            ids = torch.tensor([fall_out.blocks[i].block_id for i in on_device], dtype=torch.int64)
            rows = self.paged.gather_pages(ids).cpu()
            blocks.update(zip(on_device, rows, strict=True))
        state = None
        if new_state:
            ids = fall_out.state_host_ids
            state = (self.host_pool.read(ids) if fall_out.state_on_host
                     else self.paged.gather_pages(torch.tensor(ids, dtype=torch.int64)).cpu())
        self.disk.put(fall_out, blocks, state)
        self.num_put_bytes += sum(b.numel() * b.element_size() for b in blocks.values()) + (
            0 if state is None else state.numel() * state.element_size())

    def find(self, request: CacheRequest, block_size: int, max_step: int) -> Iterator[StoredCheckpoint]:
        """Deepest first, each made when the host tier asks for the next. The base model's unsalted text prompts
        only (the disk keeps no adapter's, cache salt's or multimodal content: `HostTier.fall_out` hands none of it
        here, and the host tier asks only for the unsalted root)."""
        self._hits, self._read = {}, {}
        if request.root_key != RootKey() or request.mm_spans:
            return
        hashes = prompt_block_hashes(request, block_size, chain_hash)  # memoized on the request
        for hit in self.disk.hits(request.prompt_ids, block_size, max_step, hashes):
            stored = hit.stored()
            self._hits[stored] = hit
            yield stored

    def read(self, stored: StoredCheckpoint, missing: tuple[int, ...]) -> bool:
        data = self.disk.read(self._hits[stored], missing)
        if data is not None:
            self._read = {stored: data}
        return data is not None

    def placed(self, stored: StoredCheckpoint, block_ids: dict[int, int], state_ids: tuple[int, ...]) -> None:
        blocks, state = self._read.pop(stored)
        if block_ids:
            self.host_pool.write([block_ids[i] for i in sorted(block_ids)], blocks)
        self.host_pool.write(state_ids, state)

    def clear(self) -> None:
        self._hits, self._read = {}, {}
        self.disk.clear()

    def stats(self) -> dict:
        """The disk tier's counters (`DiskStats`) with the host tier's fall-outs it could not keep."""
        return {**vars(self.disk.stats), "num_not_kept": self.num_not_kept}

    def keep_at_shutdown(self, keep_behind: Callable[[Callable[[int, int], None]], int]) -> int:
        """Run `keep_behind(progress)` (the scheduler's `keep_cache_behind`: every checkpoint the cache holds comes
        to `keep`) with a progress bar (on a terminal), waiting for the writer whenever `SHUTDOWN_WRITE_BYTES` are
        queued, so that the copies read out of the pools take at most that much host memory plus one checkpoint's
        (its state and the chain blocks the disk lacks); then wait for the writes. Returns how many checkpoints
        were handed."""
        flushed = self.num_put_bytes
        with tqdm(desc="hybridcache: prefix cache to disk", unit="ckpt", disable=None) as bar:
            def progress(done: int, total: int) -> None:
                nonlocal flushed
                bar.total = total
                bar.update(done - bar.n)
                if self.num_put_bytes - flushed >= SHUTDOWN_WRITE_BYTES:
                    self.disk.flush()
                    flushed = self.num_put_bytes

            handed = keep_behind(progress)
            self.disk.flush()
        return handed

    def close(self) -> None:
        """Write what is queued and stop the writer."""
        self.disk.close()
