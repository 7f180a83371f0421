"""Image input through the offline API: loading (data: URIs, http(s) with a timeout and a size cap, allowed local
paths), bad images refused with the reason and nothing queued, `LLM.chat` image parts equal to vLLM's
`multi_modal_data` prompts, limits, video refused."""

from __future__ import annotations

import base64
import http.server
import io
import threading
import time

import numpy as np
import pytest

from hybridcache.images import ImageError, MediaLimits, load_image, media_limits
from hybridcache.llm import LLM
from hybridcache.models.vl_folders import write_tiny_vl_model
from hybridcache.sampling import SamplingParams

PIL = pytest.importorskip("PIL.Image")


def png(height: int, width: int, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    buffer = io.BytesIO()
    PIL.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()


def data_uri(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def http_images():
    """A loopback HTTP server: /ok.png, /slow.png (answers after 2 s), /trickle.png (its body in 10 pieces 0.2 s
    apart: every read is quick, the whole takes 2 s), /big.png (4 x the body: over the tests' cap)."""
    body = png(20, 30)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (the stdlib's name)
            if self.path == "/slow.png":
                time.sleep(2)
            data = body * 4 if self.path == "/big.png" else body
            self.send_response(200 if self.path != "/missing.png" else 404)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.path == "/trickle.png":
                step = -(-len(data) // 10)
                try:
                    for i in range(0, len(data), step):
                        self.wfile.write(data[i:i + step])
                        self.wfile.flush()
                        time.sleep(0.2)
                except (BrokenPipeError, ConnectionResetError):  # the client gave up, as it should
                    pass
                return
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", len(body)
    server.shutdown()


def test_sources_load_and_bad_ones_name_the_reason(tmp_path, http_images):
    base, size = http_images
    (tmp_path / "a.png").write_bytes(png(20, 30))
    limits = MediaLimits(allowed_local_media_path=tmp_path, fetch_timeout_s=0.5, max_bytes=size + 10)
    want = load_image(png(20, 30), limits)
    encoded = base64.b64encode(png(20, 30)).decode()
    for source in (data_uri(png(20, 30)), str(tmp_path / "a.png"), f"file://{tmp_path / 'a.png'}",
                   f"{base}/ok.png", PIL.open(io.BytesIO(png(20, 30))),
                   f"DATA:image/png;base64,{encoded}", f"Data:IMAGE/PNG;base64,{encoded}"):  # case-insensitive
        got = load_image(source, limits)
        assert got.size == (30, 20) and np.array_equal(np.asarray(got), np.asarray(want))
    bad = [
        (b"GIF89a-not-really", "not an image"),
        (data_uri(png(20, 30)[:70]), "corrupt"),
        ("data:image/png;base64,%%%", "base64"),
        ("data:text/plain;base64,aGk=", "not an image"),
        (PIL.new("RGB", (0, 0)), "at least one pixel"),
        (str(tmp_path / "missing.png"), "does not exist"),
        ("/etc/hostname", "outside the allowed media path"),
        (f"{base}/slow.png", "timed out"),
        (f"{base}/trickle.png", "timed out"),
        (f"{base}/big.png", "larger than"),
        (f"{base}/missing.png", "could not fetch"),
        ("gopher://x/y.png", "not supported"),
        (12, "not int"),
    ]
    for source, reason in bad:
        with pytest.raises(ImageError, match=reason):
            load_image(source, limits)
    with pytest.raises(ImageError, match="more than the limit"):
        load_image(png(40, 40), MediaLimits(max_pixels=1000))
    with pytest.raises(ImageError, match="allowed-local-media-path"):
        load_image(str(tmp_path / "a.png"), MediaLimits())


def test_media_limits_options():
    assert media_limits({"image": 3}, None).max_images == 3
    with pytest.raises(ValueError, match="only 'image'"):
        media_limits({"video": 1}, None)
    # a zero limit turns a modality off, as vLLM's docs advise (`{"video": 0}`): what this engine does anyway
    assert media_limits({"image": 4, "video": 0}, None).max_images == 4
    assert media_limits({"video": 0, "audio": 0}, None) == MediaLimits()


def test_transparency_is_composited_on_white_as_transformers_and_vllm_do():
    """A black glyph on a transparent background: `convert("RGB")` alone showed the transparent pixels' hidden
    black (the model saw an all-black picture); transformers' `convert_to_rgb` and vLLM's loader composite onto
    white. Also a palette image with a transparent index, and an opaque one unchanged."""
    pixels = np.zeros((8, 8, 4), np.uint8)
    pixels[2:6, 3:5] = (0, 0, 0, 255)
    pixels[0, 0] = (200, 0, 0, 128)  # half transparent red over white
    buffer = io.BytesIO()
    PIL.fromarray(pixels, "RGBA").save(buffer, format="PNG")
    for source in (buffer.getvalue(), PIL.fromarray(pixels, "RGBA")):
        got = np.asarray(load_image(source, MediaLimits())).astype(int)
        assert got[7, 7].tolist() == [255, 255, 255] and got[3, 3].tolist() == [0, 0, 0]
        assert abs(got[0, 0] - [227, 127, 127]).max() <= 1
    palette = PIL.fromarray(pixels[..., :3]).convert("P")
    palette.info["transparency"] = palette.getpixel((7, 7))
    assert np.asarray(load_image(palette, MediaLimits()))[7, 7].tolist() == [255, 255, 255]
    opaque = PIL.fromarray(pixels[..., :3], "RGB")
    assert np.array_equal(np.asarray(load_image(opaque, MediaLimits())), pixels[..., :3])
    with pytest.raises(ValueError, match="non-negative integer"):
        media_limits({"image": -1}, None)
    with pytest.raises(ValueError, match="not a folder"):
        media_limits(None, "/no/such/folder")


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    model = write_tiny_vl_model(tmp_path_factory.mktemp("vl"))
    return LLM(model, block_size=16, kernel_block_size=8, limit_mm_per_prompt={"image": 2})


def test_chat_image_parts_equal_multi_modal_data_prompts(llm):
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    image = png(24, 40, seed=5)
    messages = [{"role": "user", "content": [{"type": "text", "text": "look:"},
                                             {"type": "image_url", "image_url": {"url": data_uri(image)}}]}]
    chat = llm.chat(messages, params, use_tqdm=False)[0]
    rendered = llm.tokenizer.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": "look:"},
                                                                              {"type": "image"}]}])
    assert "<|vision_start|><|image_pad|><|vision_end|>" in rendered
    direct = llm.generate({"prompt": rendered, "multi_modal_data": {"image": PIL.open(io.BytesIO(image))}}, params,
                          use_tqdm=False)[0]
    assert direct.outputs[0].token_ids == chat.outputs[0].token_ids
    assert direct.num_cached_tokens == len(chat.prompt_token_ids)  # the same prompt, image included: a full hit
    # 24 x 40 pixels: 6 x 10 patches of 4, 15 merged tokens in place of the one placeholder
    assert len(chat.prompt_token_ids) == len(llm.tokenizer.encode(rendered)) - 1 + 15


def test_bad_image_prompts_raise_and_queue_nothing(llm):
    params = SamplingParams(max_tokens=2)
    placeholder = "<|vision_start|><|image_pad|><|vision_end|>"
    good = png(16, 16)
    cases = [
        ({"prompt": placeholder, "multi_modal_data": {"image": b"junk"}}, ImageError, "not an image"),
        ({"prompt": placeholder * 3, "multi_modal_data": {"image": [good] * 3}}, ImageError, "the limit is 2"),
        ({"prompt": placeholder * 2, "multi_modal_data": {"image": good}}, ValueError,
         "2 image placeholders .* for 1 images"),
        ({"prompt": placeholder, "multi_modal_data": {}}, ValueError, "1 image placeholders .* for 0 images"),
        ({"prompt": "hi", "multi_modal_data": {"video": good}}, ImageError, "not supported"),
        ({"prompt": "hi", "images": [good]}, ValueError, "not \\['images'\\]"),
    ]
    for prompt, error, reason in cases:
        with pytest.raises(error, match=reason):
            llm.generate(["fine", prompt], params, use_tqdm=False)  # the good prompt is not run either
        assert not llm.engine.has_unfinished_requests()
    with pytest.raises(ImageError, match="video input is not supported"):
        llm.chat([{"role": "user", "content": [{"type": "video_url", "video_url": {"url": "x"}}]}], params)
    llm.engine.check_integrity()
    assert llm.generate("still fine", params, use_tqdm=False)[0].outputs[0].token_ids


def test_a_text_model_refuses_images(tmp_path):
    from tests.engine.model_folders import write_tiny_model

    text_llm = LLM(write_tiny_model(tmp_path / "text", "qwen3_5_text"), block_size=16, kernel_block_size=8)
    with pytest.raises(ImageError, match="takes no images"):
        text_llm.generate({"prompt": "hi", "multi_modal_data": {"image": png(16, 16)}}, use_tqdm=False)
    # chat: refused before the chat template renders the part (a template that joins content as a string raised
    # "TypeError: can only concatenate str (not "list") to str")
    text_llm.tokenizer.chat_template = "{% for m in messages %}{{ m['role'] + ': ' + m['content'] }}{% endfor %}"
    with pytest.raises(ImageError, match="takes no images"):
        text_llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x.png"}}]}],
                      use_tqdm=False)


def test_chat_text_holding_an_image_placeholder_is_refused_as_the_server_refuses_it(llm):
    """A text-only message with the literal placeholder (`<|image_pad|>`) became a prompt holding the placeholder
    id with no image (run as text); the server's chat route refuses it, and so does LLM.chat now."""
    messages = [{"role": "user", "content": "what does <|image_pad|> mean?"}]
    with pytest.raises(ValueError, match="placeholder"):
        llm.chat(messages, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    out = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
                   use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 2
    llm.engine.check_integrity()
