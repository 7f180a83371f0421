"""The "reference" attention backend: the torch kernels of `reference.py` (any device; the ground truth)."""

from __future__ import annotations

from typing import Any

import torch

from hybridcache.forward_batch import ForwardBatch
from hybridcache.kernels.attention import reference
from hybridcache.kernels.registry import ATTENTION


@ATTENTION.register("reference")
class ReferenceAttention:
    """`paged_attention` (decode rows batched inside it); reads host lengths, so it is not graph safe."""

    graph_safe = False

    def prepare(self, batch: ForwardBatch) -> Any:
        return None

    def write_kv(self, kv_layer: torch.Tensor, key: torch.Tensor, value: torch.Tensor, batch: ForwardBatch) -> None:
        reference.write_kv(kv_layer, key, value, batch.slot_mapping)

    def attention(
        self, query: torch.Tensor, kv_layer: torch.Tensor, batch: ForwardBatch, metadata: Any, *, scale: float,
        kv_scales: tuple[float, float] = (1.0, 1.0),
    ) -> torch.Tensor:
        return reference.paged_attention(
            query, kv_layer, batch.block_tables, batch.cu_seqlens, batch.query_lens_cpu, batch.context_lens_cpu,
            scale=scale, kv_scales=kv_scales,
        )
