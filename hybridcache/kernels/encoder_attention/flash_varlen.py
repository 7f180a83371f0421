"""The "flash_varlen" encoder attention: torch's `torch.nn.attention.varlen.varlen_attn` (FlashAttention's varlen
forward, shipped inside torch's CUDA build) over the whole packed batch in one call per layer: no padding, no
per-segment launch. CUDA only, fp16 / bf16, head dims that are multiples of 8 up to 256.

Called with only the arguments every torch that has it takes (q, k, v, cu_seq_q, cu_seq_k, max_q, max_k): full
bidirectional attention, scale 1 / sqrt(D)."""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hybridcache.kernels.registry import ENCODER_ATTENTION

_DTYPES = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class VarlenMetadata:
    """cu_seqlens [S + 1] int32 on the device (segment s is rows cu_seqlens[s]:cu_seqlens[s+1]); max_len its
    longest segment (from the host lengths: no device read)."""

    cu_seqlens: torch.Tensor
    max_len: int


@ENCODER_ATTENTION.register("flash_varlen")
class FlashVarlenEncoderAttention:
    devices = ("cuda",)

    def problems(self, head_dim: int, dtype: torch.dtype) -> list[str]:
        found = []
        if importlib.util.find_spec("torch.nn.attention.varlen") is None:
            found.append(f"torch {torch.__version__} has no torch.nn.attention.varlen (torch 2.10 or later has)")
        if dtype not in _DTYPES:
            found.append(f"FlashAttention runs float16 or bfloat16, not {dtype}")
        if head_dim % 8 or head_dim > 256:
            found.append(f"FlashAttention needs a head dim that is a multiple of 8 up to 256, not {head_dim}")
        return found

    def prepare(self, lengths: Sequence[int], device: torch.device) -> VarlenMetadata:
        offsets = [0]
        for n in lengths:
            offsets.append(offsets[-1] + int(n))
        cu_seqlens = torch.tensor(offsets, dtype=torch.int32).to(device, non_blocking=True)
        return VarlenMetadata(cu_seqlens, max(lengths))

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, metadata: VarlenMetadata) -> torch.Tensor:
        from torch.nn.attention.varlen import varlen_attn

        m = metadata
        return varlen_attn(q.contiguous(), k.contiguous(), v.contiguous(), m.cu_seqlens, m.cu_seqlens, m.max_len,
                           m.max_len)
