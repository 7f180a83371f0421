"""What every block of a decoder layer reads during one forward (the model builds it once per step)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridcache.forward_batch import ForwardBatch
from hybridcache.kernels.backend import KernelBackend


@dataclass(frozen=True)
class StepContext:
    """batch: the step, prepared by `backend.prepare`; backend: the kernels every layer calls;
    rope: (cos, sin) [T, rotary_dim] at batch.positions, in the hidden dtype."""

    batch: ForwardBatch
    backend: KernelBackend
    rope: tuple[torch.Tensor, torch.Tensor]
