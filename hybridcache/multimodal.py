"""Multimodal spans of a prompt: positions whose input embeddings come from an encoder, not from token ids.

A span `[start, end)` of the prompt carries a content hash (the identity of the image, audio clip, ...) and
its embeddings `[end - start, hidden]`. The caller supplies the embeddings, or the placeholder encoder below
derives deterministic ones from the content hash (until a real vision encoder lands). The token ids at span
positions are placeholders; the prefix cache tells spans apart by content hash, and a chunk never ends
strictly inside a span.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch
import xxhash


@dataclass(frozen=True)
class MultimodalInput:
    """One span: prompt positions [start, end), content hash, optional embeddings [end - start, hidden]."""

    start: int
    end: int
    content_hash: Hashable
    embeds: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


def placeholder_embeds(content_hash: Hashable, num_tokens: int, hidden_size: int) -> torch.Tensor:
    """Deterministic stand-in embeddings [num_tokens, hidden_size] (fp32, unit variance) for a content hash."""
    seed = xxhash.xxh64_intdigest(repr(content_hash).encode()) & 0x7FFF_FFFF_FFFF_FFFF
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(num_tokens, hidden_size, generator=generator)


def resolve_inputs(
    inputs: Sequence[MultimodalInput], prompt_len: int, hidden_size: int
) -> tuple[MultimodalInput, ...]:
    """Validate spans against a prompt and fill in placeholder embeddings; sorted by start.

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
        embeds = item.embeds
        if embeds is None:
            embeds = placeholder_embeds(item.content_hash, item.num_tokens, hidden_size)
        elif tuple(embeds.shape) != (item.num_tokens, hidden_size):
            raise ValueError(
                f"multimodal span [{item.start}, {item.end}) has embeddings of shape {tuple(embeds.shape)}, "
                f"expected {(item.num_tokens, hidden_size)}"
            )
        resolved.append(MultimodalInput(item.start, item.end, item.content_hash, embeds.detach().float()))
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
