"""Encoder attention: bidirectional attention within each segment of a packed varlen batch, never across segments
(the vision tower's attention over each frame of each image). No KV cache, no mask beyond the segments.

Backends, registered by name in `hybridcache.kernels.registry.ENCODER_ATTENTION` when this package is imported:
`reference.py` ("reference": torch SDPA per segment, any device, the ground truth) and `flash_varlen.py`
("flash_varlen": one FlashAttention varlen call over all segments, CUDA, fp16 / bf16). The protocol is in
`base.py`; `default_encoder_attention` names the one a device and dtype get.
"""

from __future__ import annotations

import torch

from hybridcache.kernels.encoder_attention import flash_varlen, reference  # noqa: F401 (they register)
from hybridcache.kernels.registry import ENCODER_ATTENTION


def default_encoder_attention(device_type: str, dtype: torch.dtype, head_dim: int) -> str:
    """"flash_varlen" on CUDA when it can run this dtype and head dim (fp16 / bf16, a head dim that is a multiple
    of 8 up to 256, a torch with `torch.nn.attention.varlen`); else "reference"."""
    if device_type == "cuda" and not ENCODER_ATTENTION.create("flash_varlen", "cuda").problems(head_dim, dtype):
        return "flash_varlen"
    return "reference"
