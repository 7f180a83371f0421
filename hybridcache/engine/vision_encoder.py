"""The engine's image encoder: the vision tower plus an encoder cache keyed by content hash.

`VisionEncoder.encode(spans)` fills the embeddings of every image span that carries `pixel_values` and no
`embeds`: from the encoder cache when an image with the same content hash was encoded recently (a second turn
about the same image runs no ViT, even when its prefix was evicted from the prefix cache), else by running the
tower over the missing images of the call, several images per tower call up to `MAX_PATCHES_PER_CALL` patches
(`LLM.generate` encodes all its prompts' images in one `encode`). The cache is an LRU bounded by
`capacity_tokens` language-model tokens of embeddings; an image larger than the whole capacity is encoded and not
kept.

Counters: `num_encoded_images` (images the tower ran for), `num_cache_hits` (images served from the cache).

Memory (CUDA): `reserve_bytes(max_image_patches)` is what the engine keeps out of the pools for the encoder (see
`hybridcache.engine.memory`): the activation peak of the largest call `encode` can make, measured by running the
tower once at start-up on random pixels of that many patches (`largest_call_patches`), plus the encoder cache at
capacity. The embeddings a running sequence holds until it finishes (its images' tokens x out_hidden_size) are
not in it.
"""

from __future__ import annotations

import dataclasses
import math
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from pathlib import Path

import torch

from hybridcache.models.vision import VisionTower
from hybridcache.models.vision_loader import load_vision_tower
from hybridcache.multimodal import MultimodalInput

DEFAULT_CAPACITY_TOKENS = 65536
MAX_PATCHES_PER_CALL = 32768  # bounds one tower call's activations (an image larger than this runs alone)


class VisionEncoder:
    """The tower (on the engine's device, in its dtype) and the encoder cache (module docstring)."""

    def __init__(self, tower: VisionTower, capacity_tokens: int = DEFAULT_CAPACITY_TOKENS) -> None:
        self.tower = tower
        self.capacity_tokens = capacity_tokens
        self._cache: OrderedDict[Hashable, torch.Tensor] = OrderedDict()
        self._cached_tokens = 0
        self.num_encoded_images = 0
        self.num_cache_hits = 0

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, *, dtype: torch.dtype, device: torch.device,
                       load_format: str = "auto") -> VisionEncoder | None:
        """The encoder of a multimodal folder; None for a text model (no `vision_config`). `load_format`: as the
        language model's ("dummy": random weights drawn on the device, no safetensors read)."""
        tower = load_vision_tower(model_dir, dtype=dtype, device=device, load_format=load_format)
        return None if tower is None else cls(tower)

    @property
    def merge(self) -> int:
        return self.tower.config.spatial_merge_size

    @property
    def out_hidden_size(self) -> int:
        return self.tower.config.out_hidden_size

    def cache_bytes(self) -> int:
        """The encoder cache's bytes at capacity: capacity_tokens embeddings of out_hidden_size in the tower's dtype."""
        return self.capacity_tokens * self.out_hidden_size * self.tower.pos_embed.weight.element_size()

    def reserve_bytes(self, max_image_patches: int) -> int:
        """CUDA: the activation peak of one tower call of `largest_call_patches(max_image_patches)` patches (one
        square image of random pixels handed over on the host, as the processor's are; measured above what was
        allocated before, the allocator's cached blocks freed after) plus `cache_bytes()`. 0 on other devices."""
        device = self.tower.pos_embed.weight.device
        if device.type != "cuda":
            return 0
        merge = self.merge
        side = math.ceil(math.sqrt(largest_call_patches(max_image_patches)) / merge) * merge
        grid = (1, side, side)
        pixels = torch.randn(side * side, self.tower.config.patch_dim, generator=torch.Generator().manual_seed(0))
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        self.tower(pixels, [grid])
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - before
        torch.cuda.empty_cache()
        return peak + self.cache_bytes()

    def encode(self, spans: Sequence[MultimodalInput]) -> tuple[MultimodalInput, ...]:
        """`spans` with the embeddings of image spans filled in and their pixels dropped (other spans as given).
        Raises ValueError (the cache unchanged) when an image span's pixels do not fit its grid."""
        pending = [s for s in spans if s.embeds is None and s.pixel_values is not None]
        for span in pending:
            self.tower.check_grid(span.grid)
            t, h, w = span.grid
            want = (t * h * w, self.tower.config.patch_dim)
            if tuple(span.pixel_values.shape) != want:
                raise ValueError(f"image at [{span.start}, {span.end}) has pixel_values of shape "
                                 f"{tuple(span.pixel_values.shape)}, expected {want}")
        found: dict[Hashable, torch.Tensor] = {}
        missing: dict[Hashable, MultimodalInput] = {}
        for span in pending:
            key = span.content_hash
            if key in found or key in missing:
                continue
            if key in self._cache:
                self._cache.move_to_end(key)
                found[key] = self._cache[key]
                self.num_cache_hits += 1
            else:
                missing[key] = span
        for group in _groups(list(missing.values())):
            outputs = self.tower(torch.cat([s.pixel_values for s in group]), [s.grid for s in group])
            self.num_encoded_images += len(group)
            for span, embeds in zip(group, outputs, strict=True):
                found[span.content_hash] = embeds
                self._keep(span.content_hash, embeds)
        pending_ids = {id(s) for s in pending}
        return tuple(
            dataclasses.replace(s, embeds=found[s.content_hash], pixel_values=None) if id(s) in pending_ids else s
            for s in spans
        )

    def _keep(self, key: Hashable, embeds: torch.Tensor) -> None:
        num_tokens = embeds.shape[0]
        if num_tokens > self.capacity_tokens:
            return
        if embeds.untyped_storage().nbytes() > embeds.numel() * embeds.element_size():
            embeds = embeds.clone()  # a view of its tower call's output: kept alone, it would keep the whole call
        self._cache[key] = embeds
        self._cached_tokens += num_tokens
        while self._cached_tokens > self.capacity_tokens:
            _, dropped = self._cache.popitem(last=False)
            self._cached_tokens -= dropped.shape[0]


def largest_call_patches(max_image_patches: int) -> int:
    """Patches of the largest tower call `encode` makes when no image has more than `max_image_patches`: images
    are grouped up to `MAX_PATCHES_PER_CALL` patches, and a larger image runs alone."""
    return max(max_image_patches, MAX_PATCHES_PER_CALL)


def _groups(spans: list[MultimodalInput]) -> list[list[MultimodalInput]]:
    """Consecutive runs of `spans` of at most `MAX_PATCHES_PER_CALL` patches each (an image alone may exceed it)."""
    groups: list[list[MultimodalInput]] = []
    size = 0
    for span in spans:
        patches = span.pixel_values.shape[0]
        if not groups or size + patches > MAX_PATCHES_PER_CALL:
            groups.append([])
            size = 0
        groups[-1].append(span)
        size += patches
    return groups
