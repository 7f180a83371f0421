"""Sampling on the device: `greedy_tokens` (the engine's argmax for `sampling.sample_async`), `triton_argmax`
(its CUDA kernel)."""

from __future__ import annotations

import torch


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """logits [rows, vocab] -> [rows] int64, `logits.argmax(dim=-1)` (the first of equal values; NaN largest).
    On CUDA one read of the logits in two Triton launches (`triton_argmax.argmax_rows`), several times faster than
    torch's copy and argmax at a decode batch's 64 x 248,320 (docs/bench.md, issue 32's sixth pass)."""
    if logits.device.type != "cuda" or logits.dim() != 2 or logits.stride(-1) != 1:
        return logits.argmax(dim=-1)
    from hybridcache.kernels.sampling.triton_argmax import argmax_rows

    return argmax_rows(logits)
