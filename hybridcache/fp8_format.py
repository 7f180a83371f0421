"""How a linear layer's FP8 weight is scaled (a leaf: layers, models and kernels all read it).

- "block" (Qwen's fine-grained FP8, `quant_method: fp8`): weight [N, K] float8_e4m3fn and `weight_scale_inv`
  [ceil(N/bn), ceil(K/bk)] fp32, W[n, k] = weight[n, k] * weight_scale_inv[n // bn, k // bk]; (bn, bk) = (128, 128).
- "channel" (compressed-tensors FP8_DYNAMIC): weight [N, K] and `weight_scale` [N, 1], W[n, k] = weight[n, k] *
  weight_scale[n].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
FORMATS = ("block", "channel")


@dataclass(frozen=True)
class Fp8Format:
    """One linear's FP8 scaling: `kind` "block" (with `block` = (bn, bk)) or "channel"."""

    kind: str
    block: tuple[int, int] = (128, 128)

    def __post_init__(self) -> None:
        if self.kind not in FORMATS:
            raise ValueError(f"unknown FP8 weight format {self.kind!r}; known: {FORMATS}")
        if self.kind == "block" and (len(self.block) != 2 or min(self.block) < 1):
            raise ValueError(f"FP8 block size must be two positive ints, not {self.block}")

    @property
    def scale_name(self) -> str:
        """The scale tensor's checkpoint name beside `weight`."""
        return "weight_scale_inv" if self.kind == "block" else "weight_scale"

    def scale_shape(self, out_features: int, in_features: int) -> tuple[int, int]:
        """The scale tensor's shape for a weight [out_features, in_features]."""
        if self.kind == "channel":
            return (out_features, 1)
        bn, bk = self.block
        return (-(-out_features // bn), -(-in_features // bk))

    def describe(self) -> str:
        """e.g. `fp8-block128x128`, `fp8-channel` (startup line, /health)."""
        return f"fp8-block{self.block[0]}x{self.block[1]}" if self.kind == "block" else "fp8-channel"


BLOCK = Fp8Format("block")
CHANNEL = Fp8Format("channel")
