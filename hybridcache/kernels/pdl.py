"""Programmatic dependent launch (PDL) for the small Triton kernels of a step, on Hopper and newer GPUs.

A decode step is ~300 kernels of a few microseconds each, most of them back to back on one stream. Without PDL a
kernel's first block starts only after the kernel before it has finished and its memory is flushed; each boundary
costs the launch of a grid and the drain of the last one. With PDL (CUDA's programmatic stream serialization,
captured into CUDA graphs as programmatic edges) a kernel may be scheduled while the one before it still runs,
and it waits for it inside, at `griddepcontrol.wait`, which returns once the earlier kernel has completed and its
writes are visible.

The contract, for every kernel launched with `options(x)`:

    @triton.jit
    def _kernel(..., PDL: tl.constexpr):
        pdl.start(PDL)          # first: no load or store of global memory before it
        ...

`start` waits for the kernel before (so reading what it wrote and overwriting what it reads are both ordered after
it) and then lets the next kernel be scheduled. Nothing is read or written before the wait, so a kernel launched
this way may follow any kernel, PDL or not, and be followed by any: a kernel launched without PDL waits for
completion as always. A kernel's blocks spinning at the wait hold no global memory, so scratch shared between
launches on one stream (`streams.py`, "Device scratch") stays safe.

`options` gives `{"PDL": True, "launch_pdl": True}` for a CUDA tensor on a device of compute capability 9 or more,
else `{"PDL": False}` (the CPU interpreter, `TRITON_INTERPRET=1`, and older GPUs run the plain launch; the branch is
compiled out). The flag is fixed per device, so it never makes the engine compile after its warm-up.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl


@functools.cache
def _supported(index: int) -> bool:
    return os.environ.get("TRITON_INTERPRET") != "1" and torch.cuda.get_device_capability(index)[0] >= 9


def enabled(device: torch.device) -> bool:
    """Whether kernels on `device` launch with PDL."""
    if device.type != "cuda":
        return False
    return _supported(device.index if device.index is not None else torch.cuda.current_device())


def options(x: torch.Tensor) -> dict:
    """Launch keywords for a kernel that begins with `start(PDL)`, on `x`'s device (module docstring)."""
    return {"PDL": True, "launch_pdl": True} if enabled(x.device) else {"PDL": False}


@triton.jit
def start(PDL: tl.constexpr):
    """A PDL kernel's first statement: wait for the kernel before, then let the next one be scheduled."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
