"""Multimodal spans of a prompt: positions whose input embeddings come from an encoder, not from token ids.

A span `[start, end)` of the prompt carries a content hash (the identity of the image, audio clip, ...) and
its embeddings `[end - start, hidden]`. The embeddings come from the caller, from the engine's vision tower (an
image span carries its `pixel_values` and patch `grid`; see `hybridcache.engine.vision_encoder`), or, for spans
with neither, from the placeholder encoder below (deterministic vectors from the content hash, for tests of the
cache). The token ids at span positions are placeholders; the prefix cache tells spans apart by content hash,
and a chunk never ends strictly inside a span.

Positions (Qwen3.5's M-RoPE, as transformers' `Qwen3_5Model.get_rope_index`): an image span with a language-model
grid (t, h, w) (patches merged) gives its tokens the positions (o + i_t, o + i_h, o + i_w), o being the position
its first token would have had as text, and moves every later token's position by max(h, w) - t*h*w. Text tokens
have equal positions on the three axes. Worked example (text 0..2, a 1 x 2 x 3 image at 3..8, text from 9)::

    index      0  1  2 | 3  4  5  6  7  8 | 9  10
    temporal   0  1  2 | 3  3  3  3  3  3 | 6  7
    height     0  1  2 | 3  3  3  4  4  4 | 6  7
    width      0  1  2 | 3  4  5  3  4  5 | 6  7       (shift after the image: 3 - 6 = -3)
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch
import xxhash


@dataclass(frozen=True)
class MultimodalInput:
    """One span: prompt positions [start, end), content hash, optional embeddings [end - start, hidden].

    An image span also carries `grid`, its patch grid (t, h, w) as the image processor gives it (`image_grid_thw`),
    and `merge`, the vision tower's spatial merge size: its tokens are the t x h/merge x w/merge merged patches, and
    it takes M-RoPE positions (module docstring). `pixel_values` [t*h*w, patch_dim]: the processor's patches,
    which the engine encodes when `embeds` is None (dropped once encoded). A span without a grid has text
    positions."""

    start: int
    end: int
    content_hash: Hashable
    embeds: torch.Tensor | None = None
    grid: tuple[int, int, int] | None = None
    merge: int = 1
    pixel_values: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return self.end - self.start

    @property
    def llm_grid(self) -> tuple[int, int, int] | None:
        """(t, h, w) of the merged grid: one language-model token per cell; None for a span without a grid."""
        if self.grid is None:
            return None
        t, h, w = self.grid
        return t, h // self.merge, w // self.merge


def placeholder_embeds(content_hash: Hashable, num_tokens: int, hidden_size: int) -> torch.Tensor:
    """Deterministic stand-in embeddings [num_tokens, hidden_size] (fp32, unit variance) for a content hash."""
    seed = xxhash.xxh64_intdigest(repr(content_hash).encode()) & 0x7FFF_FFFF_FFFF_FFFF
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(num_tokens, hidden_size, generator=generator)


def resolve_inputs(
    inputs: Sequence[MultimodalInput], prompt_len: int, hidden_size: int
) -> tuple[MultimodalInput, ...]:
    """Validate spans against a prompt and fill in placeholder embeddings; sorted by start. Embeddings keep their
    dtype and device (the vision tower's: the model's; the input builder moves them, the model casts them).

    Raises ValueError naming the span when it is empty, outside the prompt, overlapping another, or when its
    embeddings do not have shape [end - start, hidden_size].
    """
    resolved = []
    previous_end = 0
    for item in sorted(inputs, key=lambda i: i.start):
        if not 0 <= item.start < item.end <= prompt_len:
            raise ValueError(
                f"multimodal span [{item.start}, {item.end}) is empty or outside the prompt of {prompt_len} tokens"
            )
        if item.start < previous_end:
            raise ValueError(f"multimodal span [{item.start}, {item.end}) overlaps the previous span")
        grid = item.llm_grid
        if grid is not None and grid[0] * grid[1] * grid[2] != item.num_tokens:
            raise ValueError(f"multimodal span [{item.start}, {item.end}) has {item.num_tokens} tokens, but its "
                             f"grid {item.grid} merged by {item.merge} gives {grid[0] * grid[1] * grid[2]}")
        embeds = item.embeds
        if embeds is None:
            embeds = placeholder_embeds(item.content_hash, item.num_tokens, hidden_size)
        elif tuple(embeds.shape) != (item.num_tokens, hidden_size):
            raise ValueError(
                f"multimodal span [{item.start}, {item.end}) has embeddings of shape {tuple(embeds.shape)}, "
                f"expected {(item.num_tokens, hidden_size)}"
            )
        resolved.append(MultimodalInput(item.start, item.end, item.content_hash, embeds.detach(),
                                        item.grid, item.merge))
        previous_end = item.end
    return tuple(resolved)


def chunk_embeds(
    inputs: Sequence[MultimodalInput], start: int, end: int
) -> tuple[tuple[int, torch.Tensor], ...]:
    """The (offset in chunk, vectors) pairs of the spans overlapping the chunk [start, end)."""
    pieces = []
    for item in inputs:
        lo, hi = max(item.start, start), min(item.end, end)
        if lo < hi:
            pieces.append((lo - start, item.embeds[lo - item.start : hi - item.start]))
    return tuple(pieces)


def rope_shift(inputs: Sequence[MultimodalInput], index: int) -> int:
    """How far M-RoPE moves the position of a text token at `index` (past every image span ending at or before
    it): the sum of max(h, w) - t*h*w over those spans (module docstring). 0 without spans with a grid."""
    shift = 0
    for item in inputs:
        grid = item.llm_grid
        if grid is not None and item.end <= index:
            shift += max(grid[1], grid[2]) - item.num_tokens
    return shift


def overlaps_image(inputs: Sequence[MultimodalInput], start: int, end: int) -> bool:
    """True when positions [start, end) overlap a span with a grid (whose tokens need 3-D positions)."""
    return any(item.grid is not None and item.start < end and start < item.end for item in inputs)


def rope_positions(inputs: Sequence[MultimodalInput], start: int, end: int) -> torch.Tensor | None:
    """M-RoPE positions [3, end - start] int64 of prompt (or output) indices [start, end) of a sequence whose
    spans are `inputs` (sorted by start); None when no span has a grid (every axis is then the index). See the
    module docstring for the rule and an example."""
    if all(item.grid is None for item in inputs):
        return None
    out = torch.arange(start, end, dtype=torch.int64).repeat(3, 1)
    shift = 0
    for item in inputs:
        grid = item.llm_grid
        if grid is None:
            continue
        if item.start >= end:
            break
        t, h, w = grid
        lo, hi = max(item.start, start), min(item.end, end)
        if lo < hi:
            j = torch.arange(lo - item.start, hi - item.start)
            origin = item.start + shift
            out[:, lo - start : hi - start] = torch.stack([j // (h * w), (j // w) % h, j % w]) + origin
        delta = max(h, w) - item.num_tokens
        shift += delta
        first = max(item.end, start) - start
        if first < end - start:
            out[:, first:] += delta
    return out
