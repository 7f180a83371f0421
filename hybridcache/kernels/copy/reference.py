"""The torch path of the block copies: chunked `index_select` / `index_copy_` over the page dim."""

from __future__ import annotations

import torch

from hybridcache.kernels.copy.geometry import PoolGeometry


def _block_pages(block_ids: torch.Tensor, pages_per_block: int) -> torch.Tensor:
    """[N] block ids -> [N * pages_per_block] int64 page ids, block by block."""
    offsets = torch.arange(pages_per_block, device=block_ids.device, dtype=torch.int64)
    return (block_ids.to(torch.int64)[:, None] * pages_per_block + offsets).reshape(-1)


def copy_blocks_torch(
    pool: torch.Tensor,
    src_ids: torch.Tensor,
    dst_ids: torch.Tensor,
    geometry: PoolGeometry,
    max_workspace_bytes: int,
) -> None:
    """index_select + index_copy_ over the page dim, in tiles of `[outer_rows, pages, page_numel]` whose
    temporary holds at most `max_workspace_bytes`. Tiles never overlap and destinations are disjoint from
    the sources of other pairs, so the order of the tiles does not matter. A float8 pool is copied as bytes
    (torch has no index_copy_ for float8 on the CPU)."""
    if pool.element_size() == 1:
        pool = pool.view(torch.uint8)
    flat = pool.view(geometry.num_outer, geometry.num_pages, geometry.page_numel)
    src_pages = _block_pages(src_ids, geometry.pages_per_block)
    dst_pages = _block_pages(dst_ids, geometry.pages_per_block)
    num_copy_pages = src_pages.numel()
    pages_per_tile = min(num_copy_pages, max_workspace_bytes // geometry.page_bytes)
    rows_per_tile = 1
    if pages_per_tile == num_copy_pages:
        rows_per_tile = min(geometry.num_outer, max_workspace_bytes // (num_copy_pages * geometry.page_bytes))
    for row in range(0, geometry.num_outer, rows_per_tile):
        rows = flat[row : row + rows_per_tile]
        for start in range(0, num_copy_pages, pages_per_tile):
            tile = rows.index_select(1, src_pages[start : start + pages_per_tile])
            rows.index_copy_(1, dst_pages[start : start + pages_per_tile], tile)
