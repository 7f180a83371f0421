"""The engine's side of the executor seam: what the engine calls to run a step, and how it gets one.

An `Executor` runs the engine's steps on the device pools: a `ForwardBatch` with its copy ops (`execute`), a
step with copies only (`execute_copies`), logits from kept hidden states (`logits_from_slots`); it owns the
memory plan its pools follow and is stopped by `shutdown`. Two implement it:

- `ModelRunner` (`hybridcache.engine.runner`): one device, in the engine's process (tensor_parallel_size 1);
- `TensorParallelExecutor` (`hybridcache.distributed.executor`): N ranks, rank 0 in the engine's process.

Dependencies run one way: `hybridcache.distributed` imports the engine (this protocol, `RunnerSpec`,
`build_runner`), never the reverse. The engine reaches the tensor-parallel executor by name only
(`EXECUTOR_BACKENDS`, resolved when an engine asks for it), as vLLM resolves its distributed executor backend.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from importlib import import_module
from typing import Any, Protocol

import torch

from hybridcache.engine.memory import MemoryPlan
from hybridcache.engine.mtp_draft import DraftPlan
from hybridcache.engine.rank_runner import RunnerSpec, build_runner
from hybridcache.engine.token_feed import TokenFeed
from hybridcache.forward_batch import DeviceCopyOp, ForwardBatch
from hybridcache.layers.parallel import TensorParallel


class Executor(Protocol):
    """What the engine calls. `memory_plan`: the plan every rank's pools follow; `backend`: the kernel backend
    (its name is logged); `graph_batch_sizes`: the captured decode batch sizes, () when steps run eagerly;
    `input_device`: where the engine builds a step's inputs (`ForwardBatch`, copy ops, slot ids)."""

    memory_plan: MemoryPlan
    backend: Any

    @property
    def graph_batch_sizes(self) -> tuple[int, ...]: ...

    @property
    def input_device(self) -> torch.device: ...

    @property
    def num_host_blocks(self) -> int:
        """The host tier's blocks (each rank holds its shard of every one); 0 without a host tier."""

    def execute(self, batch: ForwardBatch, feed: TokenFeed | None = None) -> torch.Tensor:
        """The step's BEFORE_FORWARD copies, the forward, its AFTER_FORWARD copies; fp32 logits (`ModelRunner`).
        `feed`: input rows that take the step before's sampled tokens on the device (async scheduling)."""

    def check_results(self) -> None:
        """Raise if what the steps launched so far computed cannot be trusted (a tensor-parallel peer failed
        while they ran); the engine calls it after waiting for a step's sampled tokens, before using them."""

    def execute_copies(self, copies: tuple[DeviceCopyOp, ...]) -> None:
        """A step with no forward: its copy ops, BEFORE_FORWARD ones first."""

    def logits_from_slots(self, slots: torch.Tensor) -> torch.Tensor:
        """fp32 logits [len(slots), vocab] from each slot's kept last hidden state."""

    def draft(self, plan: DraftPlan) -> torch.Tensor:
        """Speculative decoding: the MTP head's work after a step (`engine/mtp_draft.py`) on every rank; the
        proposed tokens (int64, on the device)."""

    def draft_after_verify(self, batch: ForwardBatch, logits: torch.Tensor,
                           near_pages: torch.Tensor) -> torch.Tensor | None:
        """Speculative decoding: the drafting after a uniform all-greedy verify step, queued before its verdicts
        (`ModelRunner.draft_after_verify`), or None where it is not done (then `draft` runs after them)."""

    def draft_slots(self, slot: int, num_drafts: int) -> tuple[int, ...]:
        """Speculative decoding: the state pool rows of runtime slot `slot`'s first `num_drafts` draft states."""

    def eager(self) -> contextlib.AbstractContextManager[None]:
        """Within the block every step runs eagerly (no graph)."""

    def without_replay(self) -> contextlib.AbstractContextManager[None]:
        """Within the block decode steps run the graphs' batches eagerly (see `ModelRunner.without_replay`)."""

    def shutdown(self) -> None:
        """Stop whatever the executor started (idempotent)."""


def _local(spec: RunnerSpec, device: torch.device) -> Executor:
    runner, _ = build_runner(spec, TensorParallel(), device)
    return runner


# name -> a factory (spec, device) -> Executor, or "module:attribute" of one (imported when first asked for)
EXECUTOR_BACKENDS: dict[str, Callable[[RunnerSpec, torch.device], Executor] | str] = {
    "local": _local,
    "tensor_parallel": "hybridcache.distributed.executor:TensorParallelExecutor.from_spec",
}


def executor_backend(spec: RunnerSpec) -> str:
    """The backend an engine of this spec uses: tensor_parallel when tensor_parallel_size > 1, else local."""
    return "tensor_parallel" if spec.config.tensor_parallel_size > 1 else "local"


def make_executor(spec: RunnerSpec, device: torch.device) -> Executor:
    """The executor of `spec` on `device` (its backend per `executor_backend`)."""
    factory = EXECUTOR_BACKENDS[executor_backend(spec)]
    if isinstance(factory, str):
        module, _, attribute = factory.partition(":")
        factory = import_module(module)
        for part in attribute.split("."):
            factory = getattr(factory, part)
    return factory(spec, device)
