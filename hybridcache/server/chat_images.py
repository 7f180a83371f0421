"""Images in chat requests: the `image_url` content parts of `/v1/chat/completions`, and the server's media flags.

`check_media_parts(messages, takes_images)` refuses, with a 400 naming the part (`messages.i.content.j.type`), a
video part (not supported) and an image part sent to a model without a vision tower. `image_request(...)` (run off
the event loop: it may fetch URLs) loads, processes and places the images of a rendered prompt: the placeholders
expanded and one `MultimodalInput` span per image, or a 400 with the reason (corrupt bytes, 0 pixels, too many
pixels or bytes, a refused local path, a failed fetch, more images than `--limit-mm-per-prompt`).

Flags (`add_media_flags`): `--limit-mm-per-prompt '{"image": N}'` and `--allowed-local-media-path DIR`, as vLLM
spells them.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from hybridcache.images import ImageError, MediaLimits
from hybridcache.images import media_limits as build_limits
from hybridcache.server.errors import APIError

if TYPE_CHECKING:  # both import torch; the `hybridcache` command line reads this module's flags without it
    from hybridcache.mm_processor import ImageProcessor
    from hybridcache.multimodal import MultimodalInput

_IMAGE, _VIDEO = "image_url", "video_url"


def check_media_parts(messages: Sequence[dict[str, Any]], takes_images: bool) -> None:
    """APIError(400) for a video part, or for an image part when the model takes no images."""
    for i, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            kind = part.get("type")
            param = f"messages.{i}.content.{j}.type"
            if kind == _VIDEO:
                raise APIError(400, "video input is not supported (content parts may be 'text' or 'image_url')",
                               param=param)
            if kind == _IMAGE and not takes_images:
                raise APIError(400, "content part type 'image_url' needs a model with a vision tower; this model "
                               "takes only 'text' parts", param=param)


def image_request(processor: ImageProcessor | None, prompt_ids: Sequence[int], sources: Sequence[Any],
                  limits: MediaLimits) -> tuple[list[int], tuple[MultimodalInput, ...]]:
    """`mm_processor.image_prompt` with its errors as APIError(400) on `messages`."""
    from hybridcache.mm_processor import image_prompt

    try:
        return image_prompt(processor, prompt_ids, sources, limits)
    except (ImageError, ValueError) as error:
        raise APIError(400, str(error), param="messages") from None


def add_media_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--limit-mm-per-prompt", type=_limits, default=None, metavar="JSON",
                        help=f'images per prompt, e.g. \'{{"image": 4}}\' (default {MediaLimits.max_images})')
    parser.add_argument("--allowed-local-media-path", default=None, metavar="DIR",
                        help="image_url parts may name local files under this folder (default: none)")


def media_limits(args: argparse.Namespace) -> MediaLimits:
    """The `MediaLimits` the parsed flags describe (ValueError naming a bad one)."""
    return build_limits(args.limit_mm_per_prompt, args.allowed_local_media_path)


def _limits(text: str) -> dict[str, int]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        raise argparse.ArgumentTypeError(f"not JSON: {text!r} (e.g. '{{\"image\": 4}}')") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object such as '{{\"image\": 4}}', got {text!r}")
    return value
