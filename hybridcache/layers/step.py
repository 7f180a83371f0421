"""What every block of a decoder layer reads during one forward (the model builds it once per step), and the
split points between the token-wise parts of a forward and its sequence-structured cores (`StepContext.core`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from hybridcache.forward_batch import ForwardBatch
from hybridcache.kernels.backend import KernelBackend

# A sequence-structured core: (step, *token_inputs) -> [T, ...]; it reads the step's per-sequence metadata
Core = Callable[..., torch.Tensor]
# What runs a core instead of calling it (`engine/prefill_graphs.py`): (core, step, token_inputs) -> its output
Splitter = Callable[[Core, "StepContext", tuple[torch.Tensor, ...]], torch.Tensor]


@dataclass(frozen=True)
class StepContext:
    """batch: the step, prepared by `backend.prepare`; backend: the kernels every layer calls;
    rope: (cos, sin) [T, rotary_dim] at batch.positions, in the hidden dtype; splitter: None (a plain forward), or
    what runs each core of a piecewise forward (`core`)."""

    batch: ForwardBatch
    backend: KernelBackend
    rope: tuple[torch.Tensor, torch.Tensor]
    splitter: Splitter | None = None

    def core(self, fn: Core, *tokens: torch.Tensor) -> torch.Tensor:
        """fn(self, *tokens): a layer's sequence-structured core (the paged attention; the DeltaNet conv and
        recurrence), the only part of a forward that reads the step's per-sequence metadata (cu_seqlens, context
        lengths, block tables, state slots). `tokens` are its inputs, each [T, ...] with one row per token of the
        step, and its output is [T, ...], read before the next core of the step runs; everything outside a core
        is token-wise (row t of its output depends on row t of its inputs only). With a splitter, the splitter
        runs it (piecewise CUDA graphs)."""
        if self.splitter is None:
            return fn(self, *tokens)
        return self.splitter(fn, self, tokens)
