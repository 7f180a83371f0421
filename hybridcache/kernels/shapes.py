"""What kernels specialise on in a model, and the refusal of a model a backend cannot run.

`ModelShapes` carries the dims a backend's kernels depend on; the engine builds it from the model config before
the weights load (`engine.rank_runner.model_shapes`) and calls the backend's `check_model(shapes)`, which raises
`UnsupportedModelError` naming every reason, so a model the kernels cannot run is refused at load, never inside
a step. This module imports no Triton: the CUDA backend's checks run (and are tested) on any machine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class MLAShapes:
    """Multi-head latent attention's widths (Kimi Linear's `MLAConfig`): a rank's heads (all of them on one rank),
    each head's key part from the latent (Dn) and shared with every head (Dr), its value (Dv), and the latent's
    rank (R)."""

    num_heads: int
    nope_head_dim: int
    shared_head_dim: int
    value_head_dim: int
    latent_rank: int


@dataclass(frozen=True)
class ModelShapes:
    """attention_head_dim / rotary_dim: the full-attention layers' head dim and RoPE'd channels (None without
    attention layers); delta_key_head_dim / delta_value_head_dim: the gated DeltaNet's (None without DeltaNet
    layers); num_experts: routed experts of the MoE layers (0: dense); mla: the latent attention layers' widths
    (None without them)."""

    attention_head_dim: int | None
    rotary_dim: int | None
    delta_key_head_dim: int | None
    delta_value_head_dim: int | None
    num_experts: int = 0
    mla: MLAShapes | None = None


class UnsupportedModelError(ValueError):
    """A model whose shapes a kernel backend cannot run; the message names the backend and every reason."""


def refuse(backend: str, problems: list[str]) -> None:
    """Raise `UnsupportedModelError` listing `problems` (what `backend` cannot run); nothing when there are none."""
    if problems:
        raise UnsupportedModelError(f"the {backend} kernel backend cannot run this model: " + "; ".join(problems))


# fla's chunked gated delta rule (the CUDA prefill) keeps the state in 64-row blocks of the key dim, at most four
# (fla 0.6, `chunk_gated_delta_rule_fwd_h` asserts it); its other kernels and ours take any key and value head dim
FLA_MAX_KEY_HEAD_DIM = 256


def cuda_problems(shapes: ModelShapes) -> list[str]:
    """What `CudaBackend`'s own kernels (not its attention backend's) cannot run: fla's chunked DeltaNet prefill
    takes key head dims up to 256 (the Triton decode step and verify kernels take any head dims, their tiles
    rounded up to powers of two and masked), the rotary kernel needs an even rotary dim at most the head dim, the
    grouped MoE sorts expert ids as int16."""
    problems = []
    if shapes.delta_key_head_dim is not None and shapes.delta_key_head_dim > FLA_MAX_KEY_HEAD_DIM:
        problems.append(f"the DeltaNet key head dim is {shapes.delta_key_head_dim}, and fla's chunked prefill kernel "
                        f"takes at most {FLA_MAX_KEY_HEAD_DIM}")
    if shapes.rotary_dim is not None and shapes.attention_head_dim is not None and (
        shapes.rotary_dim % 2 or shapes.rotary_dim > shapes.attention_head_dim
    ):
        problems.append(f"the rotary dim {shapes.rotary_dim} must be even and at most the head dim "
                        f"{shapes.attention_head_dim}")
    if shapes.num_experts > 32767:
        problems.append(f"{shapes.num_experts} experts: the grouped MoE sorts expert ids as int16 (at most 32,767)")
    return problems


def check_cuda_model(shapes: ModelShapes, attention_backend: Any) -> None:
    """`CudaBackend.check_model`: refuse what its own kernels (`cuda_problems`) or its attention backend
    (`AttentionBackend.problems`) cannot run."""
    refuse("CUDA", cuda_problems(shapes) + attention_backend.problems(shapes))
