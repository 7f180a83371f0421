"""Reading images from what users send: OpenAI-style image URLs, local files, bytes or PIL images.

`load_image(source, limits)` returns a decoded RGB `PIL.Image.Image` (transparency composited on white) or raises
`ImageError` (a ValueError) with the reason: a source of an unknown kind, a local path outside
`limits.allowed_local_media_path` (or any local path when none is allowed), an http(s) fetch that fails, times out
or exceeds `limits.max_bytes`, bytes that are not an image in one of `IMAGE_FORMATS`, an image of 0 pixels, or one
of more than `limits.max_pixels` pixels (checked from the header, before the pixels are decoded: so only formats
whose header Pillow reads without decoding are accepted; an ICO, say, is decoded whole when opened).

Accepted sources:
- `data:image/...;base64,<data>` URIs;
- `http://` and `https://` URLs (fetched within `limits.fetch_timeout_s` in all: connecting, the headers and the
  body under one deadline, as vLLM's aiohttp `ClientTimeout(total=...)`; at most `max_bytes`, at most
  `MAX_REDIRECTS` redirects; as urllib did: certificates checked against the system's CA store, each hop through
  the http_proxy / https_proxy of its URL's scheme unless no_proxy names its host, ALL_PROXY ignored);
- `file://` URLs and plain paths, only under `limits.allowed_local_media_path`;
- raw `bytes` and `PIL.Image.Image` objects (the offline API), and `FetchedImage`s.

A server fetches on its event loop, so that no thread waits on a slow server: `await fetch_urls(sources, limits)`
turns every http(s) URL among a prompt's sources into a `FetchedImage` (its URL and body), which `load_image` then
decodes on a worker thread. `load_image` given a URL fetches it itself (on an event loop of its own).

Needs Pillow (the `vision` extra), and httpx (the `serve` extra's) for http(s) URLs.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import concurrent.futures
import functools
import io
import ssl
import urllib.parse
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")  # Pillow's names (JPEG includes MPO)
MAX_REDIRECTS = 10  # as urllib's
LOOP_EXECUTOR_THREADS = 64  # the server's default executor: each fetch resolves its host on one (see below)


class DetachedThreadPool(concurrent.futures.ThreadPoolExecutor):
    """A thread pool whose `shutdown` never waits for its threads. The server makes one of
    `LOOP_EXECUTOR_THREADS` its event loop's default executor, on which anyio resolves the hosts of image URLs
    (`loop.getaddrinfo`): asyncio's own has min(32, cpus + 4) threads, which a DNS server that never answers holds
    for the resolver's timeout (starving the other fetches), and `asyncio.run` joins it at exit (a shutdown would
    wait for them past --shutdown-timeout; the server's process ends with os._exit, so nothing needs the join)."""

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        super().shutdown(wait=False, cancel_futures=cancel_futures)


class ImageError(ValueError):
    """An image that cannot be used; the message names the reason."""


class FetchedImage(NamedTuple):
    """The body fetched from an http(s) `url` (`fetch_urls`), not yet decoded."""

    url: str
    data: bytes


@dataclass(frozen=True)
class MediaLimits:
    """What the API accepts: `max_images` per prompt, `max_bytes` of one encoded image, `max_pixels` of one decoded
    image, `fetch_timeout_s` for http(s) fetches; local files only under `allowed_local_media_path` (None: none)."""

    max_images: int = 8
    max_bytes: int = 20 * 1024 * 1024
    max_pixels: int = 8192 * 8192
    fetch_timeout_s: float = 10.0
    allowed_local_media_path: Path | None = None
    images_limited_by: str = "--limit-mm-per-prompt"  # what set `max_images`, for the error past it


def media_limits(limit_mm_per_prompt: dict[str, int] | None, allowed_local_media_path: str | Path | None
                 ) -> MediaLimits:
    """`MediaLimits` from vLLM-style options: `{"image": n}` (other modalities are refused) and a folder."""
    limits = {name: n for name, n in (limit_mm_per_prompt or {}).items() if not (name != "image" and n == 0)}
    images = limits.pop("image", MediaLimits.max_images)
    if limits:  # (a zero limit turns a modality off, as vLLM's docs advise for video: that is the case here)
        raise ValueError(f"limit_mm_per_prompt names {sorted(limits)}; only 'image' is supported (other "
                         "modalities only with a limit of 0)")
    if isinstance(images, bool) or not isinstance(images, int) or images < 0:
        raise ValueError(f"limit_mm_per_prompt['image'] must be a non-negative integer, got {images!r}")
    root = None if allowed_local_media_path is None else Path(allowed_local_media_path)
    if root is not None and not root.is_dir():
        raise ValueError(f"allowed_local_media_path {str(root)!r} is not a folder")
    return MediaLimits(max_images=images, allowed_local_media_path=root)


def load_image(source: Any, limits: MediaLimits) -> Any:
    """The image `source` names, decoded to RGB (see the module docstring); ImageError when it cannot be used."""
    from PIL import Image

    if isinstance(source, Image.Image):
        return _checked(source, limits)
    if isinstance(source, FetchedImage):
        return _decode(source.data, limits, source.url)
    if isinstance(source, (bytes, bytearray)):
        return _decode(bytes(source), limits, "the image bytes")
    if not isinstance(source, str):
        raise ImageError(f"an image is a URL, a path, bytes or a PIL image, not {type(source).__name__}")
    if source[:5].lower() == "data:":  # schemes are case-insensitive (RFC 3986 3.1)
        return _decode(_data_uri(source, limits), limits, "the data: URI")
    scheme = _scheme(source)
    if scheme in ("http", "https"):
        return _decode(_fetch(source, limits), limits, source)
    if scheme == "file":
        return _decode(_read_local(Path(urllib.parse.unquote(urllib.parse.urlsplit(source).path)), limits),
                       limits, source)
    if scheme and len(scheme) > 1:  # one letter: a Windows drive, i.e. a path
        raise ImageError(f"image URL scheme {scheme!r} is not supported (use data:, http(s):, or a local file)")
    return _decode(_read_local(Path(source), limits), limits, source)


def _data_uri(uri: str, limits: MediaLimits) -> bytes:
    header, sep, data = uri[len("data:"):].partition(",")
    if not sep or not header.endswith(";base64"):
        raise ImageError("a data: image URI must be data:<media type>;base64,<data>")
    if not header.lower().startswith("image/"):  # media types are too (RFC 2045)
        raise ImageError(f"a data: URI of type {header[:-len(';base64')]!r} is not an image")
    if len(data) * 3 // 4 > limits.max_bytes:
        raise ImageError(f"the data: image is larger than {limits.max_bytes} bytes")
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError("the data: image URI is not valid base64") from None


async def fetch_urls(sources: Sequence[Any], limits: MediaLimits) -> list[Any]:
    """`sources` with every http(s) URL fetched into a `FetchedImage` (all at once, each within
    `limits.fetch_timeout_s` in all), the others as they are; ImageError for the first that fails (the rest are
    cancelled)."""
    tasks = {i: asyncio.ensure_future(fetch_image(source, limits)) for i, source in enumerate(sources)
             if isinstance(source, str) and _is_http(source)}
    try:
        bodies = dict(zip(tasks, await asyncio.gather(*tasks.values())))
    finally:
        for task in tasks.values():
            task.cancel()  # (a no-op for those done)
    return [FetchedImage(source, bodies[i]) if i in bodies else source for i, source in enumerate(sources)]


async def fetch_image(url: str, limits: MediaLimits) -> bytes:
    """The body at the http(s) `url`: connected to, its headers and its body read within `fetch_timeout_s` in all
    (a server that trickles its headers or its body times out too), at most `max_bytes` long. ImageError
    otherwise, naming the reason but never quoting what the server sent."""
    try:
        import httpx  # noqa: F401 - (the `serve` extra's; the `vision` extra has Pillow only)
    except ImportError:
        raise ImageError(f"fetching {url} needs httpx (pip install httpx)") from None
    try:
        urllib.parse.urlsplit(url).port  # noqa: B018 - (raises for a port out of range: anyio would, in a group)
    except ValueError as error:
        raise ImageError(f"{url} is not a valid URL ({error})") from None
    try:
        return await asyncio.wait_for(_get(url, limits), limits.fetch_timeout_s)
    except asyncio.TimeoutError:  # (not yet the builtin TimeoutError on Python 3.10)
        raise ImageError(f"fetching {url} timed out after {limits.fetch_timeout_s} s") from None


def _fetch(url: str, limits: MediaLimits) -> bytes:
    """`fetch_image` for a caller without an event loop (the offline API); one that runs one in this thread (a
    notebook) has the fetch run on another thread."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(fetch_image(url, limits))
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="hybridcache-fetch") as pool:
        return pool.submit(asyncio.run, fetch_image(url, limits)).result()


async def _get(url: str, limits: MediaLimits) -> bytes:
    """The body at `url`, following at most `MAX_REDIRECTS` redirects, each hop through the proxy of its own URL
    (`_proxy`: a redirect to a host NO_PROXY names is fetched directly, one from it to an outside host through the
    proxy)."""
    import httpx

    failed = f"could not fetch {url}"
    chunks: list[bytes] = []
    size = 0
    hop = url
    cookies = httpx.Cookies()  # carried across the hops (a server may set one and redirect to check it)
    try:
        for _ in range(MAX_REDIRECTS + 1):
            async with _client(hop, failed, limits, cookies) as client, client.stream("GET", hop) as response:
                if response.next_request is not None:  # a redirect: the next hop, with its own proxy
                    hop = str(response.next_request.url)
                    cookies = httpx.Cookies(client.cookies)
                    _check_port(hop, failed)
                    continue
                if not response.is_success:  # (the standard phrase: the server's own is its text)
                    raise ImageError(f"{failed}: HTTP {response.status_code} "
                                     f"{httpx.codes.get_reason_phrase(response.status_code)}")
                length = response.headers.get("content-length", "")
                if length.isdigit() and int(length) > limits.max_bytes:
                    raise ImageError(f"the image at {url} is larger than {limits.max_bytes} bytes")
                async for chunk in response.aiter_raw():
                    chunks.append(chunk)
                    size += len(chunk)
                    if size > limits.max_bytes:
                        raise ImageError(f"the image at {url} is larger than {limits.max_bytes} bytes")
                return b"".join(chunks)
        raise ImageError(f"{failed}: more than {MAX_REDIRECTS} redirects")
    except ImageError:
        raise
    except httpx.TimeoutException:
        raise ImageError(f"fetching {url} timed out after {limits.fetch_timeout_s} s") from None
    except httpx.ConnectError as error:  # (the local reason: refused, unknown host, a certificate not trusted)
        raise ImageError(f"{failed}: could not connect ({error})") from None
    except httpx.ProtocolError as error:  # an SSH banner, too many headers, a line too long, ... (not quoted)
        raise ImageError(f"{failed}: the server did not answer with valid HTTP ({type(error).__name__})") from None
    except (httpx.HTTPError, httpx.InvalidURL, OSError, ValueError) as error:  # a read failed, a bad URL, ...
        raise ImageError(f"{failed}: {type(error).__name__}") from None


def _check_port(url: str, failed: str) -> None:
    """An ImageError for a URL whose port is out of range (anyio would raise in an exception group)."""
    try:
        urllib.parse.urlsplit(url).port  # noqa: B018
    except ValueError as error:
        raise ImageError(f"{failed}: it redirects to {url}, which is not a valid URL ({error})") from None


def _client(url: str, failed: str, limits: MediaLimits, cookies: Any = None) -> Any:
    """An `httpx.AsyncClient` for one GET of `url` through its proxy, redirects not followed (the caller follows
    them, choosing each hop's proxy). One client per hop, `cookies` those the fetch's earlier hops set (nothing is
    shared between requests); the TLS context is shared (making one takes ~50 ms). The raw body, not decoded: a
    gzip-encoded 20 MB could be gigabytes. No settings from the environment but the proxy (as urllib's): httpx's
    trust_env would build a transport for ALL_PROXY too, and one for a SOCKS proxy needs an extra, whatever the
    host."""
    import httpx

    try:
        return httpx.AsyncClient(verify=_tls_context(), proxy=_proxy(url), trust_env=False, follow_redirects=False,
                                 timeout=limits.fetch_timeout_s, cookies=cookies,
                                 headers={"User-Agent": "hybridcache", "Accept-Encoding": "identity"})
    except ImportError:  # (the proxy itself is not quoted: it may hold a password)
        raise ImageError(f"{failed}: its proxy cannot be used (a SOCKS proxy needs httpx[socks]: pip install "
                         "'httpx[socks]')") from None
    except ValueError as error:
        raise ImageError(f"{failed}: its proxy URL is not valid ({type(error).__name__})") from None


@functools.cache
def _tls_context() -> ssl.SSLContext:
    """The system's default TLS context (its CA store, as urllib's and vLLM's aiohttp: a CA installed with
    update-ca-certificates is trusted; OpenSSL reads SSL_CERT_FILE / SSL_CERT_DIR itself), made once per process."""
    return ssl.create_default_context()


def _proxy(url: str) -> str | None:
    """The proxy for `url`, as urllib picks it: its scheme's from `urllib.request.getproxies()` (http_proxy,
    https_proxy; not ALL_PROXY), none for a host that `proxy_bypass` names (NO_PROXY). A proxy without a scheme is
    an http one, as urllib takes it."""
    try:
        parts = urllib.parse.urlsplit(url)
        host = parts.hostname or ""
    except ValueError:  # (a bad URL: httpx refuses it, naming the reason)
        return None
    proxy = urllib.request.getproxies().get(parts.scheme.lower())
    if not proxy or urllib.request.proxy_bypass(host):
        return None
    return proxy if "://" in proxy else f"http://{proxy}"


def _is_http(source: str) -> bool:
    return _scheme(source) in ("http", "https")


def _scheme(source: str) -> str:
    """The scheme of the URL `source`, lowercase ("" for a path); ImageError for a URL urllib cannot split."""
    try:
        return urllib.parse.urlsplit(source).scheme.lower()
    except ValueError as error:  # ("http://[::1/": an unclosed IPv6 address)
        raise ImageError(f"{source} is not a valid URL ({error})") from None


def _read_local(path: Path, limits: MediaLimits) -> bytes:
    root = limits.allowed_local_media_path
    if root is None:
        raise ImageError(f"local image {str(path)!r} refused: local files need --allowed-local-media-path")
    resolved = path.resolve()
    if not resolved.is_relative_to(root.resolve()):
        raise ImageError(f"local image {str(path)!r} is outside the allowed media path {str(root)!r}")
    if not resolved.is_file():
        raise ImageError(f"local image {str(path)!r} does not exist")
    if resolved.stat().st_size > limits.max_bytes:
        raise ImageError(f"local image {str(path)!r} is larger than {limits.max_bytes} bytes")
    return resolved.read_bytes()


def _decode(data: bytes, limits: MediaLimits, what: str) -> Any:
    from PIL import Image

    if len(data) > limits.max_bytes:
        raise ImageError(f"{what} is larger than {limits.max_bytes} bytes")
    try:
        # only formats whose header Pillow reads without decoding the pixels: the size is checked before they are
        image = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)
    except Image.DecompressionBombError:
        raise ImageError(f"{what} has more pixels than the limit of {limits.max_pixels}") from None
    except Exception as error:  # noqa: BLE001 - Pillow raises many types for one cause: not an image
        raise ImageError(f"{what} is not an image Pillow can read in the accepted formats "
                         f"({', '.join(IMAGE_FORMATS)}; {type(error).__name__})") from None
    _check_size(image, limits, what)
    try:
        image.load()
    except Exception as error:  # noqa: BLE001 - truncated or corrupt pixel data
        raise ImageError(f"{what} is a corrupt image ({type(error).__name__}: {error})") from None
    return _rgb(image)


def _checked(image: Any, limits: MediaLimits) -> Any:
    _check_size(image, limits, "the image")
    return _rgb(image)


def _rgb(image: Any) -> Any:
    """`image` in RGB, any transparency composited onto white, as transformers' `convert_to_rgb` and vLLM's
    image loader do (a bare `convert("RGB")` shows what transparent pixels hide, usually black)."""
    from PIL import Image

    if "A" not in image.getbands() and image.info.get("transparency") is None:
        return image.convert("RGB")
    white = Image.new("RGBA", image.size, (255, 255, 255, 255))
    return Image.alpha_composite(white, image.convert("RGBA")).convert("RGB")


def _check_size(image: Any, limits: MediaLimits, what: str) -> None:
    width, height = image.size
    if width <= 0 or height <= 0:
        raise ImageError(f"{what} has size {width} x {height}: an image needs at least one pixel")
    if width * height > limits.max_pixels:
        raise ImageError(f"{what} has {width} x {height} pixels, more than the limit of {limits.max_pixels}")
