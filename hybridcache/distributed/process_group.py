"""The tensor-parallel process group: one `torch.distributed` world of N ranks, one per device.

gloo on the CPU, NCCL on CUDA (rank r on `cuda:(base + r)`, NVLink multicast off: `NCCL_NVLS_ENABLE=0`, which
the lent machines require). Ranks meet through a file store in a folder the driver creates. Collectives that
wait longer than `COLLECTIVE_TIMEOUT` fail (a rank that hangs cannot hang the others forever; a rank that dies
fails gloo's collectives at once, its connections closing). On NCCL a rank that dies leaves its peers' collectives
spinning: the driver's `LivenessMonitor` then calls `abort_group` (see `monitor.py`).

On the CPU the ranks share one machine's cores, so joining the group gives each rank an equal share of the
intra-op threads its process had (`torch.set_num_threads(max(1, threads // size))`): with every rank running a
thread per core, their OpenMP threads would fight for the cores (docs/bench.md, "Tensor parallelism"). The driver
(rank 0) gets its count back when its executor shuts down.
"""

from __future__ import annotations

import contextlib
import os
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

COLLECTIVE_TIMEOUT = timedelta(seconds=300)


def rank_device(base: torch.device, rank: int) -> torch.device:
    """The device of `rank`: the CPU for every rank on the CPU; on CUDA the base index plus the rank."""
    if base.type != "cuda":
        return base
    return torch.device("cuda", (base.index or 0) + rank)


def init_group(store_dir: Path, rank: int, size: int, device: torch.device) -> int | None:
    """Join the group (blocks until all `size` ranks have joined). On the CPU the rank then runs its share of this
    thread's intra-op threads (the module docstring): returns the count from before, to give back; None on CUDA."""
    threads = None
    if device.type == "cuda":
        os.environ["NCCL_NVLS_ENABLE"] = "0"
        torch.cuda.set_device(device)
    else:
        threads = torch.get_num_threads()
        torch.set_num_threads(max(1, threads // size))
    dist.init_process_group(
        backend="nccl" if device.type == "cuda" else "gloo",
        init_method=f"file://{store_dir / 'store'}",
        rank=rank,
        world_size=size,
        timeout=COLLECTIVE_TIMEOUT,
    )
    return threads


def broadcast_from_driver(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` as rank 0 holds it, on every rank, in place (a collective: every rank calls it at the same
    point; the others pass a buffer of the same shape and dtype). On NCCL it is queued on the device like the
    forward's collectives: no rank's host waits for it."""
    dist.broadcast(tensor, src=0)
    return tensor


def abort_group() -> None:
    """Abort this process's communicators (thread-safe; the group stays registered until `leave_group`). NCCL:
    collectives in flight stop waiting for their peers (their results are garbage) and later ones raise. gloo:
    nothing happens (a dead peer already fails its collectives)."""
    group = dist.group.WORLD
    if group is not None:
        group.abort()


def leave_group(aborted: bool = False) -> None:
    """Leave the group if this process is in one, never raising. `aborted`: the group failed (a rank died, a
    step raised): abort it rather than destroy it, since destroying an NCCL group first waits for its pending
    collectives, which a dead peer never completes."""
    if not dist.is_initialized():
        return
    with contextlib.suppress(Exception):  # a peer that died leaves the group unusable; leaving must not raise
        if aborted:
            dist.distributed_c10d._abort_process_group()
        else:
            dist.destroy_process_group()
