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
class ModelShapes:
    """attention_head_dim / rotary_dim: the full-attention layers' head dim and RoPE'd channels (None without
    attention layers); delta_key_head_dim / delta_value_head_dim: the gated DeltaNet's (None without DeltaNet
    layers); num_experts: routed experts of the MoE layers (0: dense)."""

    attention_head_dim: int | None
    rotary_dim: int | None
    delta_key_head_dim: int | None
    delta_value_head_dim: int | None
    num_experts: int = 0


class UnsupportedModelError(ValueError):
    """A model whose shapes a kernel backend cannot run; the message names the backend and every reason."""


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def refuse(backend: str, problems: list[str]) -> None:
    """Raise `UnsupportedModelError` listing `problems` (what `backend` cannot run); nothing when there are none."""
    if problems:
        raise UnsupportedModelError(f"the {backend} kernel backend cannot run this model: " + "; ".join(problems))


def cuda_problems(shapes: ModelShapes) -> list[str]:
    """What `CudaBackend`'s own kernels (not its attention backend's) cannot run: the Triton DeltaNet decode step
    needs power-of-two key and value head dims, the rotary kernel an even rotary dim at most the head dim, the
    grouped MoE sorts expert ids as int16."""
    problems = []
    for name, dim in (("key", shapes.delta_key_head_dim), ("value", shapes.delta_value_head_dim)):
        if dim is not None and not is_power_of_two(dim):
            problems.append(f"the DeltaNet {name} head dim is {dim}, and the Triton decode step needs a power of two")
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
