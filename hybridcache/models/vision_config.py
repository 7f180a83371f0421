"""`VisionConfig`: the vision tower and image tokens of a multimodal Qwen3.5 / Qwen3.5-MoE config.json.

This module imports no torch. A config.json without `vision_config` (a text model) has no `VisionConfig`
(`VisionConfig.from_dict` returns None).

Fields read from `vision_config` (names as transformers' `Qwen3_5VisionConfig` spells them): `depth` blocks of
width `hidden_size` with `num_heads` heads and an MLP of `intermediate_size` (`hidden_act`), a patch embedding over
`in_channels` x `temporal_patch_size` x `patch_size` x `patch_size` pixels, a learned position table of
`num_position_embeddings` (a square grid) and 2-D rotary positions (`rope_parameters.rope_theta`), and a merger of
`spatial_merge_size` x `spatial_merge_size` patches into one language-model token of `out_hidden_size`. From the
top level: `image_token_id` (the `<|image_pad|>` placeholder), `video_token_id`, `vision_start_token_id`,
`vision_end_token_id`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu")


@dataclass(frozen=True)
class VisionConfig:
    """The vision tower's hyper-parameters and the image token ids (see the module docstring)."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    hidden_act: str
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    out_hidden_size: int
    num_position_embeddings: int
    rope_theta: float
    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Values of one patch row of `pixel_values`: channels x temporal x patch x patch."""
        return self.in_channels * self.temporal_patch_size * self.patch_size * self.patch_size

    @property
    def merge_unit(self) -> int:
        """Patches per language-model token."""
        return self.spatial_merge_size**2

    @property
    def grid_side(self) -> int:
        """Side of the learned (square) position grid."""
        return int(self.num_position_embeddings**0.5)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> VisionConfig | None:
        """Parse config.json's dict; None when it has no `vision_config`. Raises ValueError on settings the
        tower does not implement (an activation other than GELU, heads that do not divide the width, an odd
        head dim, a position table that is not a square grid)."""
        vision = raw.get("vision_config")
        if not vision:
            return None
        if not isinstance(vision, dict):
            raise ValueError(f"config.json vision_config must be an object, not {type(vision).__name__}")
        rope = dict(vision.get("rope_parameters") or {})
        config = cls(
            depth=int(vision.get("depth", 27)),
            hidden_size=int(vision.get("hidden_size", 1152)),
            intermediate_size=int(vision.get("intermediate_size", 4304)),
            num_heads=int(vision.get("num_heads", 16)),
            hidden_act=str(vision.get("hidden_act", "gelu_pytorch_tanh")),
            in_channels=int(vision.get("in_channels", 3)),
            patch_size=int(vision.get("patch_size", 16)),
            temporal_patch_size=int(vision.get("temporal_patch_size", 2)),
            spatial_merge_size=int(vision.get("spatial_merge_size", 2)),
            out_hidden_size=int(vision.get("out_hidden_size", 3584)),
            num_position_embeddings=int(vision.get("num_position_embeddings", 2304)),
            rope_theta=float(rope.get("rope_theta", vision.get("rope_theta", 10000.0))),
            image_token_id=int(raw.get("image_token_id", 248056)),
            video_token_id=int(raw.get("video_token_id", 248057)),
            vision_start_token_id=int(raw.get("vision_start_token_id", 248053)),
            vision_end_token_id=int(raw.get("vision_end_token_id", 248054)),
        )
        if config.hidden_act not in _ACTIVATIONS:
            raise ValueError(f"vision hidden_act {config.hidden_act!r} is not supported (only {_ACTIVATIONS})")
        if config.hidden_size % config.num_heads or config.head_dim % 4:
            raise ValueError(f"vision hidden_size {config.hidden_size} / {config.num_heads} heads: the head dim "
                             "must be a whole multiple of 4 (2-D rotary over half-dims)")
        if config.grid_side**2 != config.num_position_embeddings:
            raise ValueError(f"vision num_position_embeddings {config.num_position_embeddings} is not a square")
        return config
