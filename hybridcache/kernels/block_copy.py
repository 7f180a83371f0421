"""Batched copies of logical KV blocks and state slots inside the device pools.

The runner executes a step's `CopyPlan` (as `DeviceCopyOp`s) with these functions: `copy_blocks` for the KV pool
(restore before the forward, save after it) and `copy_slots` for the conv and ssm state pools. Each call
is one batched operation over all pairs and all layers: one Triton launch on CUDA, or a few bounded
`index_select` / `index_copy_` calls with the torch path. Neither synchronises with the host when the ids
are already on the pool's device.

A pool is read as `[outer, num_pages, page]`: every dim before `page_dim` is folded into `outer` (layers,
and K/V for the KV pool), every dim after it into `page`. Scheduler block `b` is the run of kernel pages
`b * pages_per_block + j`, `j < pages_per_block` (see `hybridcache.engine.input_builder`).

Worked example (KV pool, 2 attention layers, pages_per_block 2, plan src_ids [5, 5], dst_ids [1, 3])::

    kv [2 layers, 2 (K|V), 8 pages, kernel_block_size, num_kv_heads, head_dim]
    block 5 = pages 10, 11   block 1 = pages 2, 3   block 3 = pages 6, 7
    pages   0  1  2  3  4  5  6  7  8  9 10 11 ...
    before  .  .  a  b  .  .  c  d  .  .  X  Y
    after   .  .  X  Y  .  .  X  Y  .  .  X  Y      in each of the 4 (layer, K|V) rows

Block 5 is restored into two requests (sources may repeat); pages 2, 3, 6, 7 change in every layer, for
keys and values alike, and nothing else in the pool does.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from importlib.util import find_spec

import torch

DEFAULT_MAX_WORKSPACE_BYTES = 64 << 20
_IMPLS = ("auto", "torch", "triton")
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


def copy_blocks(
    pool: torch.Tensor,
    src_ids: torch.Tensor,
    dst_ids: torch.Tensor,
    *,
    pages_per_block: int,
    page_dim: int = 2,
    impl: str = "auto",
    max_workspace_bytes: int = DEFAULT_MAX_WORKSPACE_BYTES,
) -> None:
    """Copy scheduler block `src_ids[i]` onto block `dst_ids[i]` in `pool`, in place, for every i.

    pool    : [*outer, num_pages, *page], contiguous, any dtype; `page_dim` = len(outer). For the KV pool
              [num_attention_layers, 2, num_pages, kernel_block_size, num_kv_heads, head_dim], page_dim=2,
              and every layer's keys and values are copied.
    src_ids : [N] int32 or int64, scheduler block ids (0 <= id < num_pages // pages_per_block).
    dst_ids : [N] int32 or int64, same length.
    Block `b` is pages `b * pages_per_block ... b * pages_per_block + pages_per_block - 1`.

    Contract: destinations are unique and disjoint from the sources; sources may repeat; nothing outside
    the destination blocks changes. The ids live on the pool's device or on the CPU. Ids on the CPU are
    checked (range, unique destinations, disjointness) before anything runs; ids already on the device are
    not (that would synchronise with the host), so out-of-range ids there are undefined behaviour.
    `N == 0` is a no-op.

    impl: "triton" (one kernel launch; on CPU tensors only under TRITON_INTERPRET=1), "torch" (chunked
    index_select/index_copy_ whose temporary never exceeds `max_workspace_bytes`), or "auto" (Triton on
    CUDA when it is installed, torch otherwise).

    Example: `copy_blocks(kv, torch.tensor([5, 5]), torch.tensor([1, 3]), pages_per_block=2)` copies
    pages 10, 11 onto pages 2, 3 and onto pages 6, 7 in every layer (see the module docstring).
    """
    geometry = check_copy_args(pool, src_ids, dst_ids, pages_per_block=pages_per_block, page_dim=page_dim)
    _dispatch(pool, src_ids, dst_ids, geometry, impl=impl, max_workspace_bytes=max_workspace_bytes)


def copy_slots(
    pool: torch.Tensor,
    src_ids: torch.Tensor,
    dst_ids: torch.Tensor,
    *,
    impl: str = "auto",
    max_workspace_bytes: int = DEFAULT_MAX_WORKSPACE_BYTES,
) -> None:
    """Copy state row `src_ids[i]` onto row `dst_ids[i]` in every layer of `pool`, in place, for every i.

    pool    : [num_layers, num_slots, *state], contiguous, e.g. conv [L, num_slots, conv_dim, conv_width]
              or ssm [L, num_slots, num_v_heads, k_head_dim, v_head_dim].
    src_ids : [N] int32 or int64 slot ids; dst_ids: [N], same length.

    Same contract as `copy_blocks` (unique destinations disjoint from the sources, repeated sources
    allowed, nothing else changes, empty plan = no-op). Example: src_ids [7, 7], dst_ids [0, 2] sets
    pool[l, 0] = pool[l, 2] = pool[l, 7] for every layer l.
    """
    geometry = check_copy_args(pool, src_ids, dst_ids, pages_per_block=1, page_dim=1)
    _dispatch(pool, src_ids, dst_ids, geometry, impl=impl, max_workspace_bytes=max_workspace_bytes)


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
    overlap = torch.isin(dst_ids, src_ids)
    if bool(overlap.any()):
        raise ValueError(f"dst_ids must be disjoint from src_ids; both hold {dst_ids[overlap].tolist()}")


def _dispatch(
    pool: torch.Tensor,
    src_ids: torch.Tensor,
    dst_ids: torch.Tensor,
    geometry: PoolGeometry,
    *,
    impl: str,
    max_workspace_bytes: int,
) -> None:
    if impl not in _IMPLS:
        raise ValueError(f"impl must be one of {_IMPLS}, got {impl!r}")
    if impl == "auto":
        impl = "triton" if pool.device.type == "cuda" and find_spec("triton") is not None else "torch"
    if impl == "triton":
        if pool.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("impl='triton' on CPU tensors needs TRITON_INTERPRET=1 set before triton is "
                             "imported; use impl='torch' on the CPU")
        if pool.device.type not in ("cpu", "cuda"):
            raise ValueError(f"impl='triton' supports CUDA (or interpreted CPU) tensors, not {pool.device}")
    elif not isinstance(max_workspace_bytes, int) or max_workspace_bytes < geometry.page_bytes:
        raise ValueError(f"max_workspace_bytes must be an int >= one page row ({geometry.page_bytes} bytes), "
                         f"got {max_workspace_bytes!r}")
    if src_ids.numel() == 0 or pool.numel() == 0:
        return
    src_ids = src_ids.to(pool.device, non_blocking=True)
    dst_ids = dst_ids.to(pool.device, non_blocking=True)
    if impl == "triton":
        from hybridcache.kernels.triton_block_copy import launch_copy_blocks

        launch_copy_blocks(pool, src_ids, dst_ids, geometry)
    else:
        _copy_blocks_torch(pool, src_ids, dst_ids, geometry, max_workspace_bytes)


def _block_pages(block_ids: torch.Tensor, pages_per_block: int) -> torch.Tensor:
    """[N] block ids -> [N * pages_per_block] int64 page ids, block by block."""
    offsets = torch.arange(pages_per_block, device=block_ids.device, dtype=torch.int64)
    return (block_ids.to(torch.int64)[:, None] * pages_per_block + offsets).reshape(-1)


def _copy_blocks_torch(
    pool: torch.Tensor,
    src_ids: torch.Tensor,
    dst_ids: torch.Tensor,
    geometry: PoolGeometry,
    max_workspace_bytes: int,
) -> None:
    """index_select + index_copy_ over the page dim, in tiles of `[outer_rows, pages, page_numel]` whose
    temporary holds at most `max_workspace_bytes`. Tiles never overlap and destinations are disjoint from
    sources, so the order of the tiles does not matter."""
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
