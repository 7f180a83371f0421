"""`hybridcache serve`: the model argument (a hub id from a fake local Hugging Face cache), served names,
the API key from the environment, the exposure warning, the access log, the stats line and the model_name
label, against a real server."""

from __future__ import annotations

import argparse
import time

import httpx
import pytest

from hybridcache.cli import build_parser
from hybridcache.models.builtin import BUILTIN_NAME
from hybridcache.server.cli import api_key, exposure_warning, is_loopback, served_model_names
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
    assert api_key(parse()) is None
    monkeypatch.setenv("HYBRIDCACHE_API_KEY", "from-env")
    assert api_key(parse()) == "from-env"
    assert api_key(parse("--api-key", "flag")) == "flag"
    monkeypatch.setenv("HYBRIDCACHE_API_KEY", "")
    assert api_key(parse()) is None


def test_exposure_warning_only_for_a_keyless_non_loopback_bind():
    assert all(is_loopback(host) for host in ("127.0.0.1", "127.5.0.1", "::1", "localhost"))
    assert not any(is_loopback(host) for host in ("0.0.0.0", "::", "10.0.0.2", "example.org"))
    assert exposure_warning("127.0.0.1", None) is None
    assert exposure_warning("0.0.0.0", "key") is None
    assert "no API key" in exposure_warning("0.0.0.0", None)


def test_serve_a_hub_id_with_access_log_stats_line_and_model_label(tmp_path, monkeypatch):
    fake_hub_cache(tmp_path / "hub", "acme/tiny-hybrid")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HYBRIDCACHE_API_KEY", "env-key")
    args = ("acme/tiny-hybrid", *SMALL_ENGINE, "--log-level", "info", "--enable-access-log",
            "--log-stats-interval", "0.2")
    with running_server(*args, tmp_dir=tmp_path) as server:
        headers = {"authorization": "Bearer env-key"}
        assert httpx.get(f"{server.base_url}/v1/models", timeout=30).status_code == 401
        models = httpx.get(f"{server.base_url}/v1/models", headers=headers, timeout=30).json()
        assert [card["id"] for card in models["data"]] == ["acme/tiny-hybrid"]
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
