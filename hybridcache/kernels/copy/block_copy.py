"""Batched copies of logical KV blocks inside the device pool.

The runner executes a step's KV copy ops (`DeviceCopyOp`s of a `CopyPlan`) with `copy_blocks` (restore before
the forward, save after it); checkpoint states are paged into the same blocks by `hybridcache.engine.paged_state`.
Each call is one batched operation over all pairs and all layers: one Triton launch on CUDA, or a few bounded
`index_select` / `index_copy_` calls with the torch path. Neither synchronises with the host when the ids
are already on the pool's device.

A pool is read as `[outer, num_pages, page]`: every dim before `page_dim` is folded into `outer` (layers,
and K/V for the KV pool), every dim after it into `page`. Scheduler block `b` is the run of kernel pages
`b * pages_per_block + j`, `j < pages_per_block` (see `hybridcache.engine.input_builder`).

Modules: `geometry` (the pool view and the argument checks), `reference` (the torch path), `triton` (the
Triton kernel, imported only when used); this module dispatches between them.

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
from importlib.util import find_spec

import torch

from hybridcache.kernels.copy.geometry import PoolGeometry, check_copy_args
from hybridcache.kernels.copy.reference import copy_blocks_torch

DEFAULT_MAX_WORKSPACE_BYTES = 64 << 20
_IMPLS = ("auto", "torch", "triton")


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

    Contract: destinations are unique and disjoint from the other pairs' sources (a pair may copy a block onto
    itself: a no-op, as when a speculative step's select keeps a slot's own state); sources may repeat; nothing
    outside the destination blocks changes. The ids live on the pool's device or on the CPU. Ids on the CPU are
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
        from hybridcache.kernels.copy.triton import launch_copy_blocks

        launch_copy_blocks(pool, src_ids, dst_ids, geometry)
    else:
        copy_blocks_torch(pool, src_ids, dst_ids, geometry, max_workspace_bytes)


