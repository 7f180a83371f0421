"""Image chats through the openai client against `hybridcache serve` on a tiny random Qwen3.5 image-text folder:
streamed and not, the same answer as the offline API, the encoder cache across turns, and 400s with the reason for
bad images, video parts, refused local paths and too many images."""

from __future__ import annotations

import base64
import io
import json
import struct
import time
import zlib

import httpx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridcache.models.vl_folders import write_tiny_vl_model

from .server_process import SMALL_ENGINE, running_server

openai = pytest.importorskip("openai")
PIL = pytest.importorskip("PIL.Image")


def png_bytes(height: int, width: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    buffer = io.BytesIO()
    PIL.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()


def png_claiming(width: int, height: int) -> bytes:
    """A small PNG whose header claims width x height pixels (a decompression bomb's shape)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 10))
            + chunk(b"IEND", b""))


def data_uri(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def image_message(url: str, text: str = "Describe the picture in a few words.") -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": text},
                                         {"type": "image_url", "image_url": {"url": url}}]}]


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("media")
    (folder / "cat.png").write_bytes(png_bytes(40, 56, seed=1))
    return folder


@pytest.fixture(scope="module")
def vl_server(tmp_path_factory, media_dir):
    model = write_tiny_vl_model(tmp_path_factory.mktemp("vl"))
    args = (str(model), *SMALL_ENGINE, "--allowed-local-media-path", str(media_dir),
            "--limit-mm-per-prompt", '{"image": 2}', "--enable-debug-endpoints")
    with running_server(*args, tmp_dir=tmp_path_factory.mktemp("vl_server")) as server:
        yield server


@pytest.fixture(scope="module")
def client(vl_server):
    return openai.OpenAI(base_url=f"{vl_server.base_url}/v1", api_key="unused", max_retries=0)


def model_name(client) -> str:
    return client.models.list().data[0].id


def test_image_chat_streamed_and_not_agree_and_the_second_turn_hits(client, media_dir):
    name = model_name(client)
    messages = image_message(data_uri((media_dir / "cat.png").read_bytes()))
    greedy = {"max_tokens": 6, "temperature": 0, "extra_body": {"ignore_eos": True}}
    first = client.chat.completions.create(model=name, messages=messages, **greedy)
    reply = first.choices[0].message.content
    assert first.usage.completion_tokens == 6 and first.usage.prompt_tokens > 40  # the image's tokens counted
    stream = client.chat.completions.create(model=name, messages=messages, stream=True, **greedy)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices) == reply
    # turn 2 about the same image: turn 1's whole prompt, image included, comes from the cache
    turn2 = [*messages, {"role": "assistant", "content": reply}, {"role": "user", "content": "And the colours?"}]
    second = client.chat.completions.create(model=name, messages=turn2, **greedy)
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens
    # the same image as a local path: same tokens, so the same answer
    local = client.chat.completions.create(model=name, messages=image_message(str(media_dir / "cat.png")), **greedy)
    assert local.choices[0].message.content == reply
    # a different image of the same size: its own answer path (the prefix cache tells them apart)
    other = client.chat.completions.create(model=name, messages=image_message(data_uri(png_bytes(40, 56, seed=2))),
                                           **greedy)
    assert other.usage.prompt_tokens == first.usage.prompt_tokens
    # byte-level tokens: <|im_start|>, "user\n", the text's bytes, <|vision_start|>; then the image
    image_start = 1 + 5 + len(messages[0]["content"][0]["text"].encode()) + 1
    assert other.usage.prompt_tokens_details.cached_tokens <= image_start
    # two distinct images, four requests served by the encoder cache (stream, turn 2, local path; none for other)
    metrics = httpx.get(f"{vl_server_url(client)}/metrics", timeout=10).text
    assert _metric(metrics, "hybridcache_vision_encoded_images_total") == 2
    assert _metric(metrics, "hybridcache_vision_encoder_cache_hits_total") == 3


def test_concurrent_image_chats_match_their_answers_alone(client):
    """Six image chats at once (their images may share tower calls on the engine thread), each answer equal to
    the same chat sent again alone (then served from the prefix and encoder caches)."""
    from concurrent.futures import ThreadPoolExecutor

    name = model_name(client)
    greedy = {"max_tokens": 5, "temperature": 0, "extra_body": {"ignore_eos": True}}
    chats = [image_message(data_uri(png_bytes(24 + 8 * i, 40, seed=50 + i)), f"Picture {i}?") for i in range(6)]

    def ask(messages):
        return client.chat.completions.create(model=name, messages=messages, **greedy).choices[0].message.content

    with ThreadPoolExecutor(6) as pool:
        together = list(pool.map(ask, chats))
    assert together == [ask(messages) for messages in chats]


@pytest.mark.parametrize("content, reason", [
    ([{"type": "image_url", "image_url": {"url": data_uri(b"not a png at all")}}], "not an image"),
    ([{"type": "image_url", "image_url": {"url": data_uri(png_bytes(40, 56, 1)[:80])}}], "corrupt"),
    ([{"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}], "base64"),
    ([{"type": "image_url", "image_url": {"url": data_uri(png_claiming(10_000, 10_000))}}], "more than the limit"),
    ([{"type": "image_url", "image_url": {"url": data_uri(png_claiming(20_000, 20_000))}}], "more pixels than"),
    ([{"type": "image_url", "image_url": {"url": "/etc/hostname"}}], "outside the allowed media path"),
    ([{"type": "image_url", "image_url": {"url": "ftp://example.com/a.png"}}], "not supported"),
    ([{"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}], "video input is not supported"),
    ([{"type": "image_url", "image_url": {"url": data_uri(png_bytes(16, 16, s))}} for s in range(3)],
     "the limit is 2"),
])
def test_bad_images_get_a_400_with_the_reason(client, content, reason):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=model_name(client), messages=[{"role": "user", "content": content}],
                                       max_tokens=2)
    assert reason in caught.value.body["message"], caught.value.body
    # the server still answers
    ok = client.chat.completions.create(model=model_name(client), messages=[{"role": "user", "content": "hi"}],
                                        max_tokens=2, extra_body={"ignore_eos": True})
    assert ok.usage.completion_tokens == 2


_URLS = st.one_of(
    st.builds(lambda h, w, seed: data_uri(png_bytes(h, w, seed)), st.integers(1, 48), st.integers(1, 48),
              st.integers(0, 3)),
    st.builds(lambda n: data_uri(png_bytes(24, 24, 0)[:n]), st.integers(0, 120)),
    st.sampled_from(["", "x", "data:", "data:image/png;base64,", "data:text/plain;base64,aGk=", "/etc/hostname",
                     "file:///etc/hostname", "http://127.0.0.1:9/a.png", "cat.png", "ftp://x/y.png"]),
)
_PART = st.one_of(
    st.fixed_dictionaries({"type": st.just("image_url"), "image_url": st.fixed_dictionaries({"url": _URLS})}),
    st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=20)}),
    st.fixed_dictionaries({"type": st.just("video_url"), "video_url": st.fixed_dictionaries({"url": _URLS})}),
    st.fixed_dictionaries({"type": st.just("image_url")}),
)


def test_fuzzed_image_parts_never_get_a_5xx(vl_server):
    """Bounded (40 requests or 30 s): random image parts (good, truncated, tiny, refused, missing), text and video
    parts; every answer is a 200 or a 400, and the engine's integrity check passes afterwards."""
    statuses: dict[int, int] = {}
    deadline = time.monotonic() + 30

    @settings(max_examples=40, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.lists(_PART, min_size=1, max_size=3))
    def one(parts):
        if time.monotonic() > deadline:
            return
        body = {"messages": [{"role": "user", "content": parts}], "max_tokens": 2}
        response = httpx.post(f"{vl_server.base_url}/v1/chat/completions", content=json.dumps(body),
                              headers={"content-type": "application/json"}, timeout=60)
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        assert response.status_code in (200, 400), (body, response.text)

    one()
    print("image fuzz statuses:", statuses)
    assert statuses.get(200) and statuses.get(400)
    response = httpx.get(f"{vl_server.base_url}/debug/engine", timeout=30)
    assert response.status_code == 200 and response.json()["integrity"] == "ok", response.text


def vl_server_url(client) -> str:
    return str(client.base_url).removesuffix("/").removesuffix("/v1")


def _metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def test_tokenize_counts_an_image_chat_as_the_chat_bills_it(client, vl_server):
    """/tokenize of messages holding an image expands the image into its tokens, as vLLM's does: the count equals
    the chat's usage.prompt_tokens (it counted one placeholder per image)."""
    messages = image_message(data_uri(png_bytes(48, 64, seed=3)), text="What is this?")
    chat = client.chat.completions.create(model=model_name(client), messages=messages, max_tokens=1)
    counted = httpx.post(f"{vl_server.base_url}/tokenize", json={"messages": messages}, timeout=60).json()
    assert counted["count"] == chat.usage.prompt_tokens > 40
