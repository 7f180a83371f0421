"""The server's sampling defaults come from the model folder's generation_config.json unless the request sets the
field (`--generation-config auto`, the default), or from the server's own defaults (`--generation-config vllm`)."""

import json
import shutil

import httpx
import pytest
from openai import OpenAI

from hybridcache.generation_config import SamplingDefaults
from hybridcache.models.builtin import BUILTIN_NAME, ensure_builtin_model
from hybridcache.server.protocol import ChatCompletionRequest, CompletionRequest, parse_request
from tests.server.inprocess_server import serving
from tests.server.server_process import SMALL_ENGINE, running_servers


def test_request_fields_override_the_defaults():
    defaults = SamplingDefaults(temperature=0.6, top_p=0.9, top_k=20, min_p=0.05, repetition_penalty=1.1)
    unset = parse_request(CompletionRequest, {"prompt": "hi"}).sampling_params(4, None, defaults)
    assert (unset.temperature, unset.top_p, unset.top_k, unset.min_p, unset.repetition_penalty) == (
        0.6, 0.9, 20, 0.05, 1.1)
    body = {"messages": [{"role": "user", "content": "x"}], "temperature": 0, "top_p": 1, "top_k": 0,
            "min_p": 0, "repetition_penalty": 1}
    given = parse_request(ChatCompletionRequest, body).sampling_params(4, None, defaults)
    assert (given.temperature, given.top_p, given.top_k, given.min_p, given.repetition_penalty) == (0, 1, 0, 0, 1)
    plain = parse_request(CompletionRequest, {"prompt": "hi"}).sampling_params(4)
    assert (plain.temperature, plain.top_p, plain.top_k, plain.min_p, plain.repetition_penalty) == (1, 1, 0, 0, 1)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """Two servers on a copy of the built-in model whose generation_config.json asks for greedy sampling and 3 new
    tokens: one reads the file, one ignores it."""
    tmp = tmp_path_factory.mktemp("genconfig")
    folder = tmp / "model"
    shutil.copytree(ensure_builtin_model(), folder)
    config = json.loads((folder / "generation_config.json").read_text())
    config.update(temperature=0.0, max_new_tokens=3)
    (folder / "generation_config.json").write_text(json.dumps(config))
    with running_servers((str(folder), *SMALL_ENGINE), (str(folder), *SMALL_ENGINE, "--generation-config", "vllm"),
                         tmp_dir=tmp) as (auto, ignored):
        yield [OpenAI(base_url=f"{s.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
               for s in (auto, ignored)], str(folder)


def test_the_server_takes_unset_fields_from_the_file(servers):
    (auto, ignored), model = servers
    extra = {"ignore_eos": True}
    response = auto.completions.create(model=model, prompt="Once upon", n=3, extra_body=extra)
    assert response.usage.completion_tokens == 3 * 3  # max_new_tokens 3 for each choice
    assert len({c.text for c in response.choices}) == 1  # temperature 0: greedy, every choice the same
    greedy = auto.completions.create(model=model, prompt="Once upon", temperature=0, max_tokens=3, extra_body=extra)
    assert response.choices[0].text == greedy.choices[0].text
    longer = auto.completions.create(model=model, prompt="Once upon", max_tokens=6, extra_body=extra)
    assert longer.usage.completion_tokens == 6  # the request's own value wins
    chat = auto.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], extra_body=extra)
    assert chat.usage.completion_tokens == 3
    plain = ignored.completions.create(model=model, prompt="Once upon", extra_body=extra)
    assert plain.usage.completion_tokens == 16  # the completions endpoint's own default


def test_a_completions_default_is_16_tokens_whatever_a_larger_max_new_tokens_says():
    """vLLM's completions max_tokens defaults to 16, which the generation config's max_new_tokens may lower but
    not raise (a base checkpoint's max_new_tokens 2048 made every completion without max_tokens 2048 long)."""
    with serving(sampling_defaults=SamplingDefaults(max_tokens=40)) as base_url:
        body = {"model": BUILTIN_NAME, "prompt": "Once upon", "ignore_eos": True}
        completion = httpx.post(f"{base_url}/v1/completions", json=body, timeout=120).json()
        assert completion["usage"]["completion_tokens"] == 16
        chat = httpx.post(f"{base_url}/v1/chat/completions", json={
            "model": BUILTIN_NAME, "messages": [{"role": "user", "content": "hi"}], "ignore_eos": True},
            timeout=120).json()
        assert chat["usage"]["completion_tokens"] == 40  # chat: the generation config's, as vLLM
