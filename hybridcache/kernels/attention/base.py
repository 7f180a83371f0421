"""The attention op family's protocol: what an attention backend implements (see `hybridcache.kernels.registry`).

The kernel backend (`hybridcache.kernels.backend`) holds one attention backend and calls it: `prepare` once per
step (its result is kept in the step's metadata and handed back to `attention`), `write_kv` and `attention` per
layer. Shapes and semantics are those of `KernelBackend.write_kv` / `KernelBackend.attention`.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from hybridcache.forward_batch import ForwardBatch
from hybridcache.kernels.shapes import ModelShapes


class AttentionBackend(Protocol):
    """`graph_safe`: whether its ops may be captured in a CUDA graph (no host sync, nothing sized on the host
    beyond what `prepare` fixed)."""

    graph_safe: bool

    def problems(self, shapes: ModelShapes) -> list[str]:
        """Why its kernels cannot run a model of these shapes (empty: they can); called at load."""
        ...

    def prepare(self, batch: ForwardBatch) -> Any:
        """This backend's metadata for the step (None when it needs none); computed once per step."""
        ...

    def write_kv(self, kv_layer: torch.Tensor, key: torch.Tensor, value: torch.Tensor, batch: ForwardBatch) -> None:
        """Write the step's keys and values into one layer's paged pool at `batch.kv_rows` (a negative row: that
        token is not written)."""
        ...

    def attention(
        self, query: torch.Tensor, kv_layer: torch.Tensor, batch: ForwardBatch, metadata: Any, *, scale: float,
        kv_scales: tuple[float, float] = (1.0, 1.0),
    ) -> torch.Tensor:
        """Causal GQA attention of every sequence over its pages; `metadata`: what `prepare` returned. A
        float8_e4m3fn pool is read as stored x `kv_scales` (k_scale, v_scale); a backend that cannot read one
        raises."""
        ...
