"""`hybridcache serve`: the model argument (a hub id from a fake local Hugging Face cache), several served
names, the API key from the environment, CORS origins, the access log, the stats line and the model_name
label, against a real server."""

from __future__ import annotations

import argparse
import time

import httpx
import pytest

from hybridcache.cli import build_parser
from hybridcache.models.builtin import BUILTIN_NAME
from hybridcache.server.cli import api_keys, served_model_names, server_config
from hybridcache.server.reasoning import ReasoningParser
from tests.engine.test_model_path import fake_hub_cache
from tests.server.server_process import SMALL_ENGINE, metric_value, running_server


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


def test_served_names_default_to_the_model_argument_as_given():
    assert served_model_names(parse(), None) == (BUILTIN_NAME,)
    assert served_model_names(parse("acme/tiny"), "acme/tiny") == ("acme/tiny",)
    assert served_model_names(parse("./models/x/"), "./models/x/") == ("./models/x/",)
    args = parse("acme/tiny", "--served-model-name", "a", "b", "--served-model-name", "c")
    assert args.model_arg == "acme/tiny"
    assert served_model_names(args, "acme/tiny") == ("a", "b", "c")


def test_api_key_flag_then_environment(monkeypatch):
    monkeypatch.delenv("HYBRIDCACHE_API_KEY", raising=False)
    assert api_keys(parse()) == ()
    monkeypatch.setenv("HYBRIDCACHE_API_KEY", "from-env")
    assert api_keys(parse()) == ("from-env",)
    assert api_keys(parse("--api-key", "flag")) == ("flag",)
    monkeypatch.setenv("HYBRIDCACHE_API_KEY", "")
    assert api_keys(parse()) == ()


def test_allowed_origins_and_request_token_cap_reach_the_server_config():
    args = parse("--allowed-origins", "http://a.example", "http://b.example", "--max-request-tokens", "99")
    assert args.allowed_origins == ["http://a.example", "http://b.example"]
    assert args.max_request_tokens == 99
    assert parse().allowed_origins is None


def test_reasoning_parser_and_chat_template_kwargs_reach_the_server_config(capsys):
    config = server_config(parse("--reasoning-parser", "qwen3", "--chat-template-kwargs", '{"enable_thinking": false}'),
                           ("m",))
    assert config.reasoning_parser is ReasoningParser.QWEN3
    assert config.default_chat_template_kwargs == {"enable_thinking": False}
    defaults = server_config(parse(), ("m",))
    assert defaults.reasoning_parser is None and defaults.default_chat_template_kwargs == {}
    for bad in ("[1, 2]", "{not json"):
        with pytest.raises(SystemExit):
            parse("--chat-template-kwargs", bad)
        assert "--chat-template-kwargs" in capsys.readouterr().err


def test_serve_a_hub_id_with_access_log_stats_line_and_model_label(tmp_path, monkeypatch):
    fake_hub_cache(tmp_path / "hub", "acme/tiny-hybrid")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HYBRIDCACHE_API_KEY", "env-key")
    args = ("acme/tiny-hybrid", *SMALL_ENGINE, "--log-level", "info", "--enable-access-log",
            "--log-stats-interval", "0.2", "--allowed-origins", "http://app.example")
    with running_server(*args, tmp_dir=tmp_path) as server:
        headers = {"authorization": "Bearer env-key"}
        assert httpx.get(f"{server.base_url}/v1/models", timeout=30).status_code == 401
        models = httpx.get(f"{server.base_url}/v1/models", timeout=30,
                           headers={**headers, "origin": "http://app.example"})
        assert models.headers["access-control-allow-origin"] == "http://app.example"
        assert [card["id"] for card in models.json()["data"]] == ["acme/tiny-hybrid"]  # as given, not the hash
        body = {"model": "acme/tiny-hybrid", "prompt": "hello", "max_tokens": 3, "temperature": 0}
        r = httpx.post(f"{server.base_url}/v1/completions", json=body, headers=headers, timeout=60)
        assert r.status_code == 200 and r.json()["model"] == "acme/tiny-hybrid"
        metrics = httpx.get(f"{server.base_url}/metrics", timeout=30).text
        assert metric_value(metrics, "hybridcache_prompt_tokens_total", 'model_name="acme/tiny-hybrid"') > 0
        def stats_lines() -> list[str]:
            return [line for line in server.log().splitlines() if "Avg prompt throughput" in line]

        deadline = time.monotonic() + 30
        while not any("Running: 0 reqs" in line for line in stats_lines()) and time.monotonic() < deadline:
            time.sleep(0.1)
        idle = stats_lines()
        time.sleep(1.0)  # five intervals of an idle server
        assert stats_lines() == idle  # quiet once idle
        log = server.log()
    assert "no API key" not in log
    assert '"POST /v1/completions HTTP/1.1" 200' in log  # the access log
    assert "Running: 0 reqs" in idle[-1] and "Prefix cache hit rate: 0.0%" in idle[-1], idle
    assert sum("Prefix cache hit rate: 0.0%" in line for line in idle) == 1  # one request finished

@pytest.mark.parametrize("argv", [["serve", "acme/a", "--model", "acme/b"]])
def test_two_different_models_are_an_error(argv, capsys):
    from hybridcache.cli import main

    assert main(argv) == 2
    assert "given twice" in capsys.readouterr().err


def test_several_served_model_names(tmp_path):
    with running_server(*SMALL_ENGINE, "--served-model-name", "first", "second", tmp_dir=tmp_path) as server:
        models = httpx.get(f"{server.base_url}/v1/models", timeout=30).json()
        assert [card["id"] for card in models["data"]] == ["first", "second"]
        body = {"model": "second", "prompt": "hello", "max_tokens": 2}
        r = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["model"] == "first"
        r = httpx.post(f"{server.base_url}/v1/completions", json={**body, "model": "third"}, timeout=60)
        assert r.status_code == 404 and "'first', 'second'" in r.json()["error"]["message"]
        metrics = httpx.get(f"{server.base_url}/metrics", timeout=30).text
        assert metric_value(metrics, "hybridcache_prompt_tokens_total", 'model_name="first"') > 0
