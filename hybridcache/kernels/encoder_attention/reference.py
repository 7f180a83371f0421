"""The "reference" encoder attention: torch's scaled_dot_product_attention, one call per segment (any device and
dtype; SDPA picks its kernel: on CUDA a fused one, FlashAttention or memory-efficient, whose memory grows with the
segment's length, not its square; one launch per segment and layer)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F  # noqa: N812

from hybridcache.kernels.registry import ENCODER_ATTENTION


@ENCODER_ATTENTION.register("reference")
class ReferenceEncoderAttention:
    def problems(self, head_dim: int, dtype: torch.dtype) -> list[str]:
        return []

    def prepare(self, lengths: Sequence[int], device: torch.device) -> list[int]:
        return [int(n) for n in lengths]

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, metadata: list[int]) -> torch.Tensor:
        outputs = []
        for q_i, k_i, v_i in zip(q.split(metadata), k.split(metadata), v.split(metadata), strict=True):
            # [1, H, n, D]: SDPA picks its fused kernels only for 4-D inputs (3-D ones take the math kernel, which
            # holds the [H, n, n] scores: docs/bench.md, "Images")
            out = F.scaled_dot_product_attention(q_i.transpose(0, 1)[None], k_i.transpose(0, 1)[None],
                                                 v_i.transpose(0, 1)[None])
            outputs.append(out[0].transpose(0, 1))
        return torch.cat(outputs)
