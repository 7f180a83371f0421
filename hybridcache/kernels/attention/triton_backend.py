"""The "triton" attention backend (CUDA): the paged flash-attention prefill kernel (its keys split across programs
when a short chunk's programs would leave multiprocessors idle over a long context) and the split-KV decode kernel
of `triton_paged.py`, imported on first use so that registering this backend never imports Triton.

A mixed step whose first `lead` sequences are decode rows (running sequences come first) runs them in the decode
kernel: the prefill kernel's grid leaves out their query blocks (the first `lead` rows of the chunk table, one
block each), and the decode kernel writes their rows of its output. In the prefill kernel each decode row would take
a whole block of query rows for one query, over its whole context, one program per head (on next-16b, 63 decode rows
beside a 94-token prefill took 453 us a layer against the decode kernel's 41 for 64 rows)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridcache.forward_batch import ForwardBatch
from hybridcache.kernels.registry import ATTENTION
from hybridcache.kernels.shapes import ModelShapes
from hybridcache.kernels.varlen import chunk_indices, leading_decode_rows, num_chunks

# The kernels take any head dim D up to this one (`triton_paged`: tiles D rounded up to a power of two wide, the lanes
# past D masked). Past 256 the tiles would be 512 wide, and the bf16 prefill tile (128 queries x 64 keys, two
# stages) would need 256 KiB of shared memory, over the 227 KiB a Hopper program may have (at 256: 128 KiB).
MAX_HEAD_DIM = 256
HEAD_DIM_LIMIT = ("the Triton attention kernels' tiles are the head dim rounded up to a power of two, and 512-wide "
                  "ones would not fit a multiprocessor's shared memory")


@dataclass(frozen=True)
class TritonAttentionMetadata:
    """all_decode: every sequence feeds one token (the decode kernel); max_context_len: the longest context (sizes
    the split-KV grids: decode, and the prefill kernel's key splits, `triton_paged.prefill_splits`); chunks:
    [NT, 2] (sequence, block of the bf16 prefill kernel's rows), None when all-decode; lead: the decode rows that
    begin a mixed step (module docstring), 0 when none."""

    all_decode: bool
    max_context_len: int
    chunks: torch.Tensor | None
    lead: int = 0


@ATTENTION.register("triton")
class TritonAttention:
    devices = ("cuda",)
    graph_safe = True

    def __init__(self) -> None:
        from hybridcache.kernels.attention import triton_paged

        self._kernels = triton_paged
        self._block_m = triton_paged.default_prefill_config(256, torch.bfloat16).block_m

    @staticmethod
    def problems(shapes: ModelShapes) -> list[str]:
        """The paged kernels take any head dim up to MAX_HEAD_DIM (HEAD_DIM_LIMIT says why no more)."""
        dim = shapes.attention_head_dim
        if dim is None or dim <= MAX_HEAD_DIM:
            return []
        return [f"the attention head dim is {dim}, over {MAX_HEAD_DIM}: {HEAD_DIM_LIMIT}"]

    def prepare(self, batch: ForwardBatch) -> TritonAttentionMetadata:
        lens = batch.query_lens_cpu
        all_decode = all(length == 1 for length in lens)
        chunks = None if all_decode else chunk_indices(batch.cu_seqlens.long(), lens, self._block_m)
        lead = 0 if all_decode else leading_decode_rows(lens)
        return TritonAttentionMetadata(all_decode, max(batch.context_lens_cpu, default=0), chunks, lead)

    def write_kv(self, kv_layer: torch.Tensor, key: torch.Tensor, value: torch.Tensor, batch: ForwardBatch) -> None:
        self._kernels.write_kv(kv_layer, key, value, batch.kv_rows)

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
        lead = metadata.lead
        if lead:  # the prefill kernel skips the leading decode rows' blocks (the table's first `lead` rows)
            if table is None:
                table = chunk_indices(batch.cu_seqlens.long(), batch.query_lens_cpu, config.block_m)
            table = table[lead:]
        blocks = table.shape[0] if table is not None else num_chunks(batch.query_lens_cpu, config.block_m)
        splits = self._kernels.prefill_splits(blocks * query.shape[1], metadata.max_context_len,
                                              self._kernels.num_sms(query.device))
        out = self._kernels.paged_prefill_attention(
            query, kv_layer, batch.block_tables, batch.cu_seqlens, batch.context_lens, batch.query_lens_cpu,
            scale=scale, config=config, chunk_indices=table, kv_scales=kv_scales, num_splits=splits,
        )
        if lead:
            self._kernels.paged_decode_attention(
                query[:lead], kv_layer, batch.block_tables[:lead], batch.context_lens[:lead], metadata.max_context_len,
                scale=scale, kv_scales=kv_scales, out=out[:lead],
            )
        return out
