"""A second CUDA stream per device, for work that overlaps the main stream's: the sparse MoE block's shared
expert beside its routing and routed experts (`layers/mlp.py::SparseMoeBlock`), in eager steps and inside
captured CUDA graphs alike.

    pending = fork(side_stream(x.device), fn, *args)   # fn(*args) on the side stream (inline without one)
    ...                                                 # the main stream's own work, overlapping it
    out = pending.join()                                # the main stream waits for it; fn's result

Fork: the side stream waits on the main stream (the current stream; an event recorded after everything enqueued
on it so far, so after whatever produced `args`), then runs `fn` with the side stream current; an event is
recorded after it. Join: the main stream waits on that event. Under `torch.cuda.graph` capture the wait makes
the side stream join the capture (its work becomes graph nodes branching from the capture stream) and the join
merges it back; a fork that is never joined fails the capture at its end ("unjoined work"), loudly. Every fork
must therefore be joined before the captured region ends, and every `Pending` handed to a backend op is joined
by it (`KernelBackend.moe`'s contract).

Memory, without `Tensor.record_stream` (the caching allocator keeps a block per stream it was allocated on and
reuses a freed block for later allocations on that stream only, with no cross-stream check):
- tensors the side stream reads but the main stream allocated (`args`): `Pending.reads` keeps them referenced
  until the pending result is dropped, which is after its join; a block the main stream frees then is reused only
  by main-stream work enqueued after the join, so after the side stream's last read of it;
- tensors the side stream allocates (its intermediates and `fn`'s result): freed intermediates are reused by later
  side-stream work, ordered after them on the side stream; the result is read by the main stream after the join,
  and once dropped its block is reused only by a later side-stream allocation, i.e. inside a later `fork`, whose
  work is enqueued after that fork's wait on the main stream, so after the main stream's last read of it.
This holds because nothing but `fork` enqueues work on the side stream, and every fork begins with the wait. In a
capture the same ordering becomes the graph's edges (the allocator gives the side stream's captured allocations
the graph's private pool: torch assigns to it every stream joined to the capture), so replays keep it.

Device scratch: some kernels share one buffer per device between launches, on the promise that launches on one
stream never overlap: the skinny dense GEMM's split-K workspace and counters (`gemm/triton_skinny.py`), the FP8
split-K GEMM's (`gemm/triton_block_fp8.py::splitk_buffers`). Between a fork and its join the main stream must
therefore launch none of the kernels the side stream may launch: no dense or FP8 linear (the MoE block forks after
its input GEMMs, and its main stream then runs only the routing, the routed experts' own kernels and the combine).

One side stream per device, created on first use and kept (never one per layer or step), at the highest priority
(a kernel of the side stream's short work takes the next free SMs before the routed experts' remaining tiles, in
eager runs; CUDA graphs run their nodes at the launch stream's priority unless instantiated with node
priorities, which torch does not ask for).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}


def side_stream(device: torch.device) -> torch.cuda.Stream | None:
    """The side stream of a CUDA device (created once, then the same one); None for any other device (its work
    runs inline)."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _SIDE_STREAMS.get(index)
    if stream is None:
        stream = _SIDE_STREAMS[index] = torch.cuda.Stream(index, priority=-1)  # clamped to the highest there is
    return stream


@dataclass(frozen=True)
class Pending:
    """A result computed on the side stream. `join()` makes the current stream wait for it and returns it; until
    then the main stream must not read `value`. `done` is None where it ran inline (nothing to wait for).
    `reads`: the tensors it read, kept referenced until this object is dropped (after the join)."""

    value: torch.Tensor
    done: torch.cuda.Event | None
    reads: tuple[object, ...] = ()

    def join(self) -> torch.Tensor:
        """`value`, after the current stream was made to wait for the side stream's work (idempotent)."""
        if self.done is not None:
            torch.cuda.current_stream(self.value.device).wait_event(self.done)
        return self.value


def fork(stream: torch.cuda.Stream | None, fn: Callable[..., torch.Tensor], *args: object) -> Pending:
    """`fn(*args)` on `stream` after everything enqueued so far on the current stream (the main one); inline on the
    current stream when `stream` is None. Only the tensors among `args` are device data the side stream reads;
    the module docstring says why the allocator's reuse of their blocks and of the result's is safe."""
    if stream is None:
        return Pending(fn(*args), None)
    stream.wait_stream(torch.cuda.current_stream(stream.device))  # fork: after the main stream's work so far
    with torch.cuda.stream(stream):
        value = fn(*args)
        done = torch.cuda.Event()
        done.record(stream)
    return Pending(value, done, args)


def joined(value: torch.Tensor | Pending) -> torch.Tensor:
    """A tensor as is; a `Pending` joined (the current stream waits for it) and its tensor."""
    return value.join() if isinstance(value, Pending) else value
