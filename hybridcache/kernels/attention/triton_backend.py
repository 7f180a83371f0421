"""The "triton" attention backend (CUDA): the paged flash-attention prefill kernel and the split-KV decode kernel
of `triton_paged.py`, imported on first use so that registering this backend never imports Triton."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridcache.forward_batch import ForwardBatch
from hybridcache.kernels.registry import ATTENTION
from hybridcache.kernels.varlen import chunk_indices


@dataclass(frozen=True)
class TritonAttentionMetadata:
    """all_decode: every sequence feeds one token (the decode kernel); max_context_len: the longest context (sizes
    the split-KV grid); chunks: [NT, 2] (sequence, block of the bf16 prefill kernel's rows), None when all-decode."""

    all_decode: bool
    max_context_len: int
    chunks: torch.Tensor | None


@ATTENTION.register("triton")
class TritonAttention:
    devices = ("cuda",)
    graph_safe = True

    def __init__(self) -> None:
        from hybridcache.kernels.attention import triton_paged

        self._kernels = triton_paged
        self._block_m = triton_paged.default_prefill_config(256, torch.bfloat16).block_m

    def prepare(self, batch: ForwardBatch) -> TritonAttentionMetadata:
        all_decode = all(length == 1 for length in batch.query_lens_cpu)
        chunks = None if all_decode else chunk_indices(batch.cu_seqlens.long(), batch.query_lens_cpu, self._block_m)
        return TritonAttentionMetadata(all_decode, max(batch.context_lens_cpu, default=0), chunks)

    def write_kv(self, kv_layer: torch.Tensor, key: torch.Tensor, value: torch.Tensor, batch: ForwardBatch) -> None:
        self._kernels.write_kv(kv_layer, key, value, batch.slot_mapping)

    def attention(
        self, query: torch.Tensor, kv_layer: torch.Tensor, batch: ForwardBatch, metadata: TritonAttentionMetadata,
        *, scale: float, kv_scales: tuple[float, float] = (1.0, 1.0),
    ) -> torch.Tensor:
        if metadata.all_decode:
            return self._kernels.paged_decode_attention(
                query, kv_layer, batch.block_tables, batch.context_lens, metadata.max_context_len, scale=scale,
                kv_scales=kv_scales,
            )
        config = self._kernels.default_prefill_config(query.shape[-1], query.dtype)
        table = metadata.chunks if config.block_m == self._block_m else None
        return self._kernels.paged_prefill_attention(
            query, kv_layer, batch.block_tables, batch.cu_seqlens, batch.context_lens, batch.query_lens_cpu,
            scale=scale, config=config, chunk_indices=table, kv_scales=kv_scales,
        )
