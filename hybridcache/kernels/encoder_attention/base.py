"""The encoder attention family's protocol (see `hybridcache.kernels.encoder_attention`).

A caller runs many layers over one packed batch: `prepare(lengths, device)` once (its result is the batch's
metadata: segment offsets on the device, the longest segment), then `attention(q, k, v, metadata)` per layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch


class EncoderAttention(Protocol):
    """Bidirectional attention within segments; a class may set `devices` (the device types it runs on)."""

    def problems(self, head_dim: int, dtype: torch.dtype) -> list[str]:
        """Why it cannot run heads of `head_dim` in `dtype` (empty: it can); asked once, when a model picks it."""
        ...

    def prepare(self, lengths: Sequence[int], device: torch.device) -> Any:
        """The metadata of a batch whose segments have `lengths` rows (positive, in order), for every layer."""
        ...

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, metadata: Any) -> torch.Tensor:
        """q, k, v [N, H, D] (N = sum of the lengths, last dim contiguous) -> out [N, H, D] in q's dtype: row i of
        segment s attends to every row of s, scaled by 1 / sqrt(D)."""
        ...
