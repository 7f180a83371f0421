"""Chat rendering as vLLM renders: a folder's named chat templates ("tool_use" for a request with tools, as
transformers' `get_chat_template` picks) and a message's text parts joined with "\\n" for a template that takes
content as a string, through the server (`--tokenizer` a folder with named templates) and its prediction
(`body_prompt_ids`: the router, /v1/cache/match)."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest

from hybridcache.models.builtin import ensure_builtin_model
from hybridcache.server.prompt_ids import body_prompt_ids
from hybridcache.tokenizer import Tokenizer

from .conftest import MODEL
from .server_process import SMALL_ENGINE, running_server

CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TOOL_USE = "<|im_start|>system\nTOOLS:{% for t in tools %} {{ t.function.name }}{% endfor %}<|im_end|>\n" + CHATML
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the weather",
                                           "parameters": {"type": "object", "properties": {}}}}]
HI = [{"role": "user", "content": "Weather in Paris?"}]
PARTS = [{"role": "user", "content": [{"type": "text", "text": "Translate to French:"},
                                      {"type": "text", "text": "Good morning"}]}]
WITH_TOOLS = "<|im_start|>system\nTOOLS: get_weather<|im_end|>\n<|im_start|>user\nWeather in Paris?<|im_end|>\n"
JOINED = "<|im_start|>user\nTranslate to French:\nGood morning<|im_end|>\n"  # vLLM's "\n" join ("French:Good" was)
OPEN = "<|im_start|>assistant\n"


@pytest.fixture
def named_folder(tmp_path):
    """The built-in model's tokenizer with two named templates in tokenizer_config.json: "default" (ChatML, content
    read as a string) and "tool_use" (it lists the tools)."""
    folder = tmp_path / "tokenizer"
    folder.mkdir()
    source = ensure_builtin_model()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, folder / name)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "default", "template": CHATML}, {"name": "tool_use", "template": TOOL_USE}]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def test_the_prediction_renders_tools_and_text_parts_as_the_server(named_folder):
    tokenizer = Tokenizer(named_folder)
    [with_tools] = body_prompt_ids({"messages": HI, "tools": TOOLS}, tokenizer)
    assert tokenizer.decode(with_tools, skip_special_tokens=False) == WITH_TOOLS + OPEN
    [parts] = body_prompt_ids({"messages": PARTS}, tokenizer)
    assert tokenizer.decode(parts, skip_special_tokens=False) == JOINED + OPEN


def test_the_server_renders_a_request_with_tools_with_the_tool_use_template(named_folder, tmp_path):
    """A request with tools rendered with "default": the model never saw its tools (found by a bug hunt)."""
    tokenizer = Tokenizer(named_folder)
    with running_server(*SMALL_ENGINE, "--tokenizer", str(named_folder), tmp_dir=tmp_path) as server:
        url = server.base_url
        tokenized = httpx.post(f"{url}/tokenize", json={"model": MODEL, "messages": HI, "tools": TOOLS}).json()
        plain = httpx.post(f"{url}/tokenize", json={"model": MODEL, "messages": HI}).json()
        parts = httpx.post(f"{url}/tokenize", json={"model": MODEL, "messages": PARTS}).json()
        chat = httpx.post(f"{url}/v1/chat/completions", json={"model": MODEL, "messages": HI, "tools": TOOLS,
                                                              "max_tokens": 1}).json()
    assert tokenizer.decode(tokenized["tokens"], skip_special_tokens=False) == WITH_TOOLS + OPEN
    assert tokenizer.decode(plain["tokens"], skip_special_tokens=False) == WITH_TOOLS.split("<|im_end|>\n", 1)[1] + OPEN
    assert tokenizer.decode(parts["tokens"], skip_special_tokens=False) == JOINED + OPEN
    assert chat["usage"]["prompt_tokens"] == len(tokenizer.encode(WITH_TOOLS + OPEN))
