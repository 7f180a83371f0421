"""The cos/sin table of partial rotary position embedding (rotate-half convention, as in transformers'
Qwen3-Next / Qwen3.5); the rotation itself is the backend's `rotary` op (`kernels/rotary/`).

Only the first `rotary_dim` channels of each head are rotated; the rest pass through unchanged. For
text-only input, Qwen3.5's interleaved M-RoPE has equal position ids on its three axes and reduces to
`rotary_cos_sin`; where images are present, `mrope_cos_sin` takes the (t, h, w) positions of every token.

Scaled RoPE (`scaling`: config.json's rope_type and its keys, `ModelConfig.attention.rope_scaling`; empty for
plain RoPE): the inverse frequencies and the factor that multiplies cos and sin are transformers'
`ROPE_INIT_FUNCTIONS[rope_type]` (YaRN, linear, llama3), as its models compute them::

    inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](config)   # once, on the CPU, fp32
    cos, sin = cos(position * inv_freq) * attention_scaling, sin(...) * attention_scaling   # every step
"""

from __future__ import annotations

from typing import Any

import torch

RopeScaling = tuple[tuple[str, Any], ...]  # config.json's rope_type and scaling keys, as `AttentionConfig` holds them

# (device, rotary_dim, base, scaling, max_position_embeddings) -> ([rotary_dim] fp32, cos/sin factor)
_TABLES: dict[tuple[str, int, float, RopeScaling, int], tuple[torch.Tensor, float]] = {}


def scaled_inv_freq(rotary_dim: int, base: float, scaling: RopeScaling,
                    max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """transformers' `ROPE_INIT_FUNCTIONS[rope_type]` of a config with these settings: the rotary_dim/2 inverse
    frequencies [fp32, CPU] and the factor of cos/sin (`attention_scaling`). `max_position_embeddings`: the model's
    (YaRN without a factor divides it by original_max_position_embeddings)."""
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    parameters = dict(scaling)
    rope_type = parameters["rope_type"]
    # head_dim = rotary_dim with partial_rotary_factor 1: the same rotated width as the model's head_dim * factor
    config = transformers.PretrainedConfig(
        rope_parameters={**parameters, "rope_theta": base, "partial_rotary_factor": 1.0},
        head_dim=rotary_dim, hidden_size=rotary_dim, num_attention_heads=1,
        max_position_embeddings=max_position_embeddings,
    )
    inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
    return inv_freq.to(torch.float32), float(attention_scaling)


def rope_table(rotary_dim: int, base: float, device: torch.device, scaling: RopeScaling = (),
               max_position_embeddings: int = 32768) -> tuple[torch.Tensor, float]:
    """The rotary_dim/2 inverse frequencies repeated twice ([rotary_dim] fp32 on `device`) and the factor of cos and
    sin (1.0 without `scaling`), kept for later steps.

    Plain RoPE: 1 / base^(2i / rotary_dim), built on `device` by torch, so also inside a CUDA graph capture (and
    then not kept: its kernels have not run yet). Scaled RoPE: `scaled_inv_freq` on the CPU, copied to `device`,
    which a capture cannot do: the engine runs every graph once eagerly before capturing it, which builds the table
    (`RuntimeError` otherwise)."""
    key = (str(device), rotary_dim, base, scaling, max_position_embeddings)
    cached = _TABLES.get(key)
    if cached is not None:
        return cached
    capturing = torch.device(device).type == "cuda" and torch.cuda.is_current_stream_capturing()
    if scaling:
        if capturing:
            raise RuntimeError(f"the scaled RoPE table {dict(scaling)} on {device} must be built before a CUDA "
                               "graph capture (run a step eagerly first)")
        inv_freq, attention_scaling = scaled_inv_freq(rotary_dim, base, scaling, max_position_embeddings)
        inv_freq = inv_freq.to(device)
    else:
        exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=device).to(torch.float32)
        inv_freq, attention_scaling = 1.0 / (base ** (exponents / rotary_dim)), 1.0
    table = (torch.cat((inv_freq, inv_freq)), attention_scaling)
    if not capturing:
        _TABLES[key] = table
    return table


def _cos_sin(emb: torch.Tensor, attention_scaling: float,
             dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the fp32 angles `emb`, times `attention_scaling` (as transformers: before the cast)."""
    cos, sin = emb.cos(), emb.sin()
    if attention_scaling != 1.0:
        cos, sin = cos * attention_scaling, sin * attention_scaling
    return cos.to(dtype), sin.to(dtype)


def rotary_cos_sin(
    positions: torch.Tensor, rotary_dim: int, base: float, dtype: torch.dtype, scaling: RopeScaling = (),
    max_position_embeddings: int = 32768,
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T] int -> cos, sin [T, rotary_dim] of position * inv_freq, the rotary_dim/2 inverse frequencies
    repeated twice (`rope_table`, kept between steps, so a step runs the product, cos, sin and the casts), times
    the scaled RoPE's factor where `scaling` names one."""
    inv_freq_twice, attention_scaling = rope_table(rotary_dim, base, positions.device, scaling,
                                                   max_position_embeddings)
    emb = positions.float()[:, None] * inv_freq_twice[None, :]
    return _cos_sin(emb, attention_scaling, dtype)


def mrope_cos_sin(
    positions: torch.Tensor, rotary_dim: int, base: float, section: tuple[int, int, int], dtype: torch.dtype,
    scaling: RopeScaling = (), max_position_embeddings: int = 32768,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3.5's interleaved M-RoPE: positions [3, T] int (temporal, height, width axes) -> cos, sin
    [T, rotary_dim].

    Frequency j (of rotary_dim/2) turns with the height position where j % 3 == 1 and j < 3 * section[1], with the
    width position where j % 3 == 2 and j < 3 * section[2], and with the temporal position everywhere else (as
    transformers' `Qwen3_5TextRotaryEmbedding` lays them out). With three equal rows this is `rotary_cos_sin`.
    """
    inv_freq_twice, attention_scaling = rope_table(rotary_dim, base, positions.device, scaling,
                                                   max_position_embeddings)
    freqs = positions.float()[..., None] * inv_freq_twice[: rotary_dim // 2]  # [3, T, rotary_dim / 2]
    mixed = freqs[0].clone()
    for axis, offset in ((1, 1), (2, 2)):
        picked = slice(offset, section[axis] * 3, 3)
        mixed[:, picked] = freqs[axis][:, picked]
    emb = torch.cat((mixed, mixed), dim=-1)
    return _cos_sin(emb, attention_scaling, dtype)


def batch_cos_sin(batch: Any, attention: Any, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The cos, sin of a forward batch's rows as the model rotates them (`attention`: its `AttentionConfig`):
    M-RoPE from `batch.rope_positions` where the batch has them (rows of a sequence with images, 3-D where they
    lie on an image), else from `batch.positions`."""
    if batch.rope_positions is not None:
        return mrope_cos_sin(batch.rope_positions, attention.rotary_dim, attention.rope_theta, attention.mrope_section,
                             dtype, attention.rope_scaling, attention.max_position_embeddings)
    return rotary_cos_sin(batch.positions, attention.rotary_dim, attention.rope_theta, dtype, attention.rope_scaling,
                          attention.max_position_embeddings)
