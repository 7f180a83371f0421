"""The geometry of a pool seen by the block copies, and the checks every copy runs before it starts.

A pool is read as `[outer, num_pages, page]`: every dim before `page_dim` is folded into `outer`, every
dim after it into `page` (see `hybridcache.kernels.copy.block_copy`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_ID_DTYPES = (torch.int32, torch.int64)


@dataclass(frozen=True)
class PoolGeometry:
    """A pool viewed as `[num_outer, num_pages, page_numel]`, with `pages_per_block` pages per block."""

    num_outer: int
    num_pages: int
    page_numel: int
    pages_per_block: int
    element_size: int

    @property
    def num_blocks(self) -> int:
        return self.num_pages // self.pages_per_block

    @property
    def page_bytes(self) -> int:
        return self.page_numel * self.element_size

    @property
    def block_bytes(self) -> int:
        """Bytes one pair copies, over all outer rows."""
        return self.num_outer * self.pages_per_block * self.page_bytes


def check_copy_args(
    pool: torch.Tensor,
    src_ids: torch.Tensor,
    dst_ids: torch.Tensor,
    *,
    pages_per_block: int,
    page_dim: int,
) -> PoolGeometry:
    """Check every argument of a copy (see `copy_blocks`) and return the pool's geometry.

    Raises TypeError for wrong types and dtypes, ValueError for wrong shapes, devices, layouts and plans.
    """
    if not isinstance(pool, torch.Tensor):
        raise TypeError(f"pool must be a torch.Tensor, got {type(pool).__name__}")
    if pool.layout != torch.strided:
        raise ValueError(f"pool must be a dense (strided) tensor, got layout {pool.layout}")
    if not isinstance(page_dim, int) or not 0 <= page_dim < pool.dim():
        raise ValueError(f"page_dim must be an int in [0, {pool.dim()}) for a pool of shape "
                         f"{tuple(pool.shape)}, got {page_dim!r}")
    if not pool.is_contiguous():
        raise ValueError(f"pool must be contiguous; shape {tuple(pool.shape)} has strides {pool.stride()}")
    num_pages = pool.shape[page_dim]
    if not isinstance(pages_per_block, int) or pages_per_block < 1:
        raise ValueError(f"pages_per_block must be a positive int, got {pages_per_block!r}")
    if pages_per_block > num_pages:
        raise ValueError(f"pages_per_block {pages_per_block} exceeds the pool's {num_pages} pages")
    num_outer = 1
    for size in pool.shape[:page_dim]:
        num_outer *= size
    page_numel = 1
    for size in pool.shape[page_dim + 1 :]:
        page_numel *= size
    geometry = PoolGeometry(num_outer, num_pages, page_numel, pages_per_block, pool.element_size())

    for name, ids in (("src_ids", src_ids), ("dst_ids", dst_ids)):
        if not isinstance(ids, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(ids).__name__}")
        if ids.dtype not in _ID_DTYPES:
            raise TypeError(f"{name} must be int32 or int64, got {ids.dtype}")
        if ids.dim() != 1:
            raise ValueError(f"{name} must be 1-D, got shape {tuple(ids.shape)}")
        if ids.device != pool.device and ids.device.type != "cpu":
            raise ValueError(f"{name} is on {ids.device}; it must be on the pool's device ({pool.device}) "
                             "or on the CPU")
    if src_ids.shape != dst_ids.shape:
        raise ValueError(f"src_ids has {src_ids.numel()} ids but dst_ids has {dst_ids.numel()}")
    if src_ids.numel() and src_ids.device.type == "cpu" and dst_ids.device.type == "cpu":
        _check_host_plan(src_ids, dst_ids, geometry.num_blocks)
    return geometry


def _check_host_plan(src_ids: torch.Tensor, dst_ids: torch.Tensor, num_blocks: int) -> None:
    for name, ids in (("src_ids", src_ids), ("dst_ids", dst_ids)):
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= num_blocks:
            raise ValueError(f"{name} must lie in [0, {num_blocks}), got values in [{low}, {high}]")
    if torch.unique(dst_ids).numel() != dst_ids.numel():
        raise ValueError("dst_ids must be unique (a destination written twice is a race)")
    moving = src_ids != dst_ids  # (a block copied onto itself changes nothing)
    overlap = torch.isin(dst_ids[moving], src_ids)
    if bool(overlap.any()):
        raise ValueError(f"dst_ids must be disjoint from src_ids; both hold {dst_ids[moving][overlap].tolist()}")
