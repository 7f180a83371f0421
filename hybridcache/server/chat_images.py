"""Images in chat requests: the `image_url` content parts of `/v1/chat/completions`, and the server's media flags.

`check_media_parts(messages, takes_images)` refuses, with a 400 naming the part (`messages.i.content.j.type`), a
video part (not supported) and an image part sent to a model without a vision tower. `image_request(...)` loads,
processes and places the images of a rendered prompt: the placeholders expanded and one `MultimodalInput` span per
image, or a 400 with the reason (corrupt bytes, 0 pixels, too many pixels or bytes, a refused local path, a failed
fetch, more images than `--limit-mm-per-prompt`). The server awaits `image_request_async(...)`: it fetches the
http(s) URLs on the event loop (each within the fetch timeout in all: a slow server holds no thread), then runs
`image_request` on the media threads it is given.

Flags (`add_media_flags`): `--limit-mm-per-prompt '{"image": N}'` and `--allowed-local-media-path DIR`, as vLLM
spells them.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from hybridcache.images import ImageError, MediaLimits, fetch_urls
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


async def image_request_async(processor: ImageProcessor | None, prompt_ids: Sequence[int], sources: Sequence[Any],
                              limits: MediaLimits, pool: concurrent.futures.Executor
                              ) -> tuple[list[int], tuple[MultimodalInput, ...]]:
    """`image_request`, its http(s) URLs fetched first on the event loop (`images.fetch_urls`: all at once, each
    within `limits.fetch_timeout_s` in all), then the decoding and processing on `pool`. Nothing is fetched for a
    prompt refused anyway (a model without a vision tower, more images than `limits.max_images`)."""
    if processor is not None and len(sources) <= limits.max_images:
        try:
            sources = await fetch_urls(sources, limits)
        except ImageError as error:
            raise APIError(400, str(error), param="messages") from None
    return await asyncio.get_running_loop().run_in_executor(pool, image_request, processor, prompt_ids, sources,
                                                            limits)


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
