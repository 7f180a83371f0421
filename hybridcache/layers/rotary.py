"""The cos/sin table of partial rotary position embedding (rotate-half convention, as in transformers'
Qwen3-Next / Qwen3.5); the rotation itself is the backend's `rotary` op (`kernels/rotary/`).

Only the first `rotary_dim` channels of each head are rotated; the rest pass through unchanged. For
text-only input, Qwen3.5's interleaved M-RoPE has equal position ids on its three axes and reduces to
`rotary_cos_sin`; where images are present, `mrope_cos_sin` takes the (t, h, w) positions of every token.
"""

from __future__ import annotations

import torch

_INV_FREQ_TWICE: dict[tuple[str, int, float], torch.Tensor] = {}  # (device, rotary_dim, base) -> [rotary_dim]


def _inv_freq_twice(rotary_dim: int, base: float, device: torch.device) -> torch.Tensor:
    """The rotary_dim/2 inverse frequencies 1 / base^(2i / rotary_dim), repeated twice: [rotary_dim] fp32, built
    on `device` by torch (no host-to-device copy: CUDA graphs capture `rotary_cos_sin`) and kept for later steps,
    except when built inside a CUDA graph capture (its kernels have not run yet then)."""
    key = (str(device), rotary_dim, base)
    cached = _INV_FREQ_TWICE.get(key)
    if cached is not None:
        return cached
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=device).to(torch.float32)
    inv_freq = 1.0 / (base ** (exponents / rotary_dim))
    twice = torch.cat((inv_freq, inv_freq))
    if not (twice.is_cuda and torch.cuda.is_current_stream_capturing()):
        _INV_FREQ_TWICE[key] = twice
    return twice


def rotary_cos_sin(
    positions: torch.Tensor, rotary_dim: int, base: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T] int -> cos, sin [T, rotary_dim] of position * inv_freq, the rotary_dim/2 inverse frequencies
    repeated twice (`_inv_freq_twice`, kept between steps, so a step runs the product, cos, sin and the casts)."""
    emb = positions.float()[:, None] * _inv_freq_twice(rotary_dim, base, positions.device)[None, :]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def mrope_cos_sin(
    positions: torch.Tensor, rotary_dim: int, base: float, section: tuple[int, int, int], dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3.5's interleaved M-RoPE: positions [3, T] int (temporal, height, width axes) -> cos, sin
    [T, rotary_dim].

    Frequency j (of rotary_dim/2) turns with the height position where j % 3 == 1 and j < 3 * section[1], with the
    width position where j % 3 == 2 and j < 3 * section[2], and with the temporal position everywhere else (as
    transformers' `Qwen3_5TextRotaryEmbedding` lays them out). With three equal rows this is `rotary_cos_sin`.
    """
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=positions.device).to(torch.float32)
    inv_freq = 1.0 / (base ** (exponents / rotary_dim))
    freqs = positions.float()[..., None] * inv_freq  # [3, T, rotary_dim / 2]
    mixed = freqs[0].clone()
    for axis, offset in ((1, 1), (2, 2)):
        picked = slice(offset, section[axis] * 3, 3)
        mixed[:, picked] = freqs[axis][:, picked]
    emb = torch.cat((mixed, mixed), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)
