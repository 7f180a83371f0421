"""Image prompts: chat messages with image parts -> template messages + images; images -> patches; one
`<|image_pad|>` placeholder per image -> as many placeholders as the image has language-model tokens, each run a
`MultimodalInput` span the engine encodes.

`ImageProcessor(model_dir, vision)` wraps transformers' image processor of the folder (`AutoImageProcessor`, from
preprocessor_config.json: its min/max pixels, resizing to multiples of patch x merge, normalisation). An image of
(after resizing) H x W pixels becomes a grid (1, H / patch, W / patch) of patches and H * W / (patch * merge)^2
language-model tokens. Its content hash is the xxh3-128 of its pixel values and grid: two different images never
share one (the prefix cache and the encoder cache tell images apart by it), the same image sent twice always does.

`split_chat_images(messages)` turns OpenAI-style messages into what chat templates take, for `LLM.chat` and the
server alike: each message must have one of `CHAT_ROLES`; its content goes through `template_content` (None is "",
a list of text parts one string, `TextParts`: the chat template's content format picks their separator); in a list
holding images, text parts stay, `{"type": "image_url", "image_url": {"url": ...}}` and `{"type": "image", "image":
...}` parts become `{"type": "image"}` (the template renders `<|vision_start|><|image_pad|><|vision_end|>`) and
their sources are returned in order; video parts raise `ImageError` (video input is not supported).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import xxhash

from hybridcache.images import ImageError, MediaLimits, load_image
from hybridcache.models.vision_config import VisionConfig
from hybridcache.multimodal import MultimodalInput
from hybridcache.tokenizer import TextParts

_VIDEO_PARTS = ("video_url", "video")
_IMAGE_PARTS = ("image_url", "image", "image_pil")
_TEXT_PART = "text"
CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")  # the server's `ChatMessage.role` takes these


@dataclass(frozen=True)
class ProcessedImage:
    """One image ready for the tower: `pixel_values` [t*h*w, patch_dim], `grid` (t, h, w) patches, its hash."""

    pixel_values: torch.Tensor
    grid: tuple[int, int, int]
    content_hash: str


def _sizes(sizes: dict[str, Any]) -> str:
    return ", ".join(f"{name} {value}" for name, value in sizes.items())


class ImageProcessor:
    """The folder's image processor and its image tokens (module docstring). ValueError when the folder has no
    preprocessor_config.json or its patch / merge / temporal patch sizes disagree with the vision tower's."""

    def __init__(self, model_dir: str | Path, vision: VisionConfig) -> None:
        from transformers import AutoImageProcessor

        model_dir = Path(model_dir)
        if not (model_dir / "preprocessor_config.json").is_file():
            raise ValueError(f"{model_dir} has a vision tower but no preprocessor_config.json")
        self.vision = vision
        self._hf = AutoImageProcessor.from_pretrained(model_dir, local_files_only=True)
        sizes = {name: getattr(self._hf, name, None) for name in ("patch_size", "merge_size", "temporal_patch_size")}
        tower = {"patch_size": vision.patch_size, "merge_size": vision.spatial_merge_size,
                 "temporal_patch_size": vision.temporal_patch_size}
        if sizes != tower:
            raise ValueError(f"{model_dir / 'preprocessor_config.json'} has {_sizes(sizes)}; the vision tower "
                             f"(config.json vision_config) has {_sizes(tower)}")

    @property
    def image_token_id(self) -> int:
        return self.vision.image_token_id

    def process(self, images: Sequence[Any]) -> list[ProcessedImage]:
        """Decoded RGB images -> patches; ImageError when the processor refuses one (too small, too narrow)."""
        out = []
        for image in images:
            try:
                batch = self._hf(images=[image], return_tensors="pt")
            except (ValueError, ZeroDivisionError) as error:
                raise ImageError(f"the image of {image.size[0]} x {image.size[1]} pixels cannot be processed: "
                                 f"{error}") from None
            pixels = batch["pixel_values"].float().contiguous()
            grid = tuple(int(v) for v in batch["image_grid_thw"][0])
            digest = xxhash.xxh3_128(pixels.numpy())  # the buffer itself, no copy
            digest.update(repr(grid).encode())
            out.append(ProcessedImage(pixels, grid, f"image:{digest.hexdigest()}"))
        return out

    @property
    def max_patches(self) -> int:
        """Patches of the largest image this processor emits: it resizes every image to at most `longest_edge`
        pixels (transformers' name for max_pixels), so at most longest_edge / patch^2 patches (t = 1)."""
        size = self._hf.size
        try:
            max_pixels = size["longest_edge"]
        except (KeyError, TypeError):
            max_pixels = getattr(size, "longest_edge", None)
        max_pixels = max_pixels or getattr(self._hf, "max_pixels", None)
        if not max_pixels:
            raise ValueError(f"the image processor {type(self._hf).__name__} names no largest image (its size has no "
                             f"longest_edge, it has no max_pixels): {size}")
        return int(max_pixels) // self.vision.patch_size**2

    @property
    def max_image_tokens(self) -> int:
        """Placeholder tokens of the largest image this processor emits (`max_patches` merged)."""
        return self.max_patches // self.vision.merge_unit

    def num_tokens(self, grid: tuple[int, int, int]) -> int:
        t, h, w = grid
        return t * h * w // self.vision.merge_unit

    def expand(self, token_ids: Sequence[int], images: Sequence[ProcessedImage]
               ) -> tuple[list[int], tuple[MultimodalInput, ...]]:
        """Replace the k-th `<|image_pad|>` of `token_ids` by `num_tokens` of them for image k; returns the new ids
        and one span per image (pixels and grid attached, for the engine to encode). ValueError when the prompt
        holds a different number of placeholders than images, or an image placeholder already expanded."""
        image_id = self.image_token_id
        places = [i for i, token in enumerate(token_ids) if token == image_id]
        if len(places) != len(images):
            raise ValueError(f"the prompt has {len(places)} image placeholders (<|image_pad|>, id {image_id}) "
                             f"for {len(images)} images")
        ids: list[int] = []
        spans = []
        previous = 0
        for place, image in zip(places, images, strict=True):
            ids.extend(token_ids[previous:place])
            n = self.num_tokens(image.grid)
            spans.append(MultimodalInput(len(ids), len(ids) + n, image.content_hash, grid=image.grid,
                                         merge=self.vision.spatial_merge_size, pixel_values=image.pixel_values))
            ids.extend([image_id] * n)
            previous = place + 1
        ids.extend(token_ids[previous:])
        return ids, tuple(spans)


def image_prompt(processor: ImageProcessor | None, token_ids: Sequence[int], sources: Sequence[Any],
                 limits: MediaLimits) -> tuple[list[int], tuple[MultimodalInput, ...]]:
    """A prompt's token ids (one placeholder per image) and its image sources -> the expanded ids and the image
    spans (`ImageProcessor.expand`). ImageError when the model takes no images, there are more than
    `limits.max_images`, or an image cannot be loaded or processed; ValueError when placeholders and images
    disagree in number (also for a prompt of a vision model that holds placeholders and no images)."""
    if processor is None:
        if sources:
            raise ImageError("this model takes no images (its folder has no vision tower)")
        return list(token_ids), ()
    if len(sources) > limits.max_images:
        raise ImageError(f"{len(sources)} images in one prompt; the limit is {limits.max_images} "
                         f"({limits.images_limited_by})")
    images = processor.process([load_image(source, limits) for source in sources])
    return processor.expand(token_ids, images)


def template_content(content: object) -> str | list[dict[str, Any]]:
    """A message's `content` as chat templates take it: a string as it is, None as "", a list of text parts as
    `TextParts` (their texts joined with "", or with "\\n" by `Tokenizer.apply_chat_template` for a template that
    takes strings only), a list holding an image or video part as the list. The server's
    `ChatMessage.as_template_input` and `split_chat_images` both take content through here, so `LLM.chat` and
    `/v1/chat/completions` render the same messages alike. ValueError for other content or an unknown part."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, (list, tuple)):
        raise ValueError(f"a message's content is a string or a list of content parts, got {type(content).__name__}")
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in (_TEXT_PART, *_IMAGE_PARTS, *_VIDEO_PARTS):
            raise ValueError(f"content part {j} must be a dict whose 'type' is 'text' or an image's ('image_url', "
                             f"'image', 'image_pil'), got {part!r:.80}")
        if kind == _TEXT_PART and not isinstance(part.get("text"), str):
            raise ValueError(f"content part {j} (type 'text') has no 'text' string: {part!r:.80}")
    if all(part["type"] == _TEXT_PART for part in content):
        return TextParts([part["text"] for part in content])
    return list(content)


def split_chat_images(messages: Sequence[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[Any]]:
    """OpenAI-style messages -> (messages for the chat template, image sources in order); see the module docstring.
    ValueError for a message without a role, with one not in `CHAT_ROLES` or with content `template_content`
    refuses; ImageError for a video part or an image part without a source."""
    rendered, sources = [], []
    for i, message in enumerate(messages):
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise ValueError(f"message {i} has no 'role'" if role is None else
                             f"message {i} has role {role!r}; a role is one of {', '.join(CHAT_ROLES)}")
        try:
            content = template_content(message.get("content"))
        except ValueError as error:
            raise ValueError(f"message {i}: {error}") from None
        if isinstance(content, list):
            content = [_template_part(part, sources) for part in content]
        message = {**message, "content": content}
        calls = message.pop("tool_calls", None)
        if calls:  # as the server takes them (vLLM's LLM.chat too); an empty list is left out
            message["tool_calls"] = [_template_call(call) for call in calls]
        rendered.append(message)
    return rendered, sources


def _template_call(call: Any) -> Any:
    """An OpenAI tool call of an assistant message with its arguments as the template takes them
    (`template_arguments`)."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or "arguments" not in function:
        return call
    return {**call, "function": {**function, "arguments": template_arguments(function["arguments"])}}


def template_arguments(arguments: Any) -> Any:
    """Tool-call arguments as a template takes them: an object where they are one or JSON text of one; none (null,
    "" or blanks) is `{}`, as vLLM has it (a template wrote `"arguments": }`, or failed iterating over ""); other
    text as it is."""
    if isinstance(arguments, dict):
        return arguments
    if arguments is None or (isinstance(arguments, str) and not arguments.strip()):
        return {}
    if not isinstance(arguments, str):
        return arguments
    try:
        parsed = json.loads(arguments)
    except (json.JSONDecodeError, RecursionError):  # (nested past Python's parser: kept as text)
        return arguments
    return parsed if isinstance(parsed, dict) else arguments


def _template_part(part: dict[str, Any], sources: list[Any]) -> dict[str, Any]:
    """A content part as the template takes it; an image part's source is appended to `sources`."""
    kind = part["type"]
    if kind in _VIDEO_PARTS:
        raise ImageError("video input is not supported (only text and images)")
    if kind in _IMAGE_PARTS:
        sources.append(_image_source(part, kind))
        return {"type": "image"}
    return part


def _image_source(part: dict[str, Any], kind: str) -> Any:
    value = part.get(kind)
    if kind == "image_pil" or (kind == "image" and value is not None and not isinstance(value, dict)):
        return value
    if isinstance(value, dict):
        value = value.get("url")
    if value is None:
        raise ImageError(f"the {kind} content part has no image (expected {{'{kind}': {{'url': ...}}}})")
    return value
