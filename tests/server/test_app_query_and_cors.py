"""The app's answers before a route runs: a bad query parameter is a 400 OpenAI error object (vLLM's answer to a
RequestValidationError), checked after the API key, and a CORS preflight from an allowed origin may ask for any
request header (the OpenAI JS SDK's X-Stainless-* ones), as vLLM's default `--allowed-headers '*'`."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from hybridcache.server.app import ServedModel, build_app
from hybridcache.server.config import ServerConfig

KEY = {"Authorization": "Bearer k"}
# what the official OpenAI JS SDK (dangerouslyAllowBrowser) asks for in its preflight
SDK_HEADERS = ("authorization,content-type,x-stainless-arch,x-stainless-lang,x-stainless-os,"
               "x-stainless-package-version,x-stainless-retry-count,x-stainless-runtime,"
               "x-stainless-runtime-version,x-stainless-timeout")


def client(**options) -> TestClient:
    loop = SimpleNamespace(running=True, healthy=True, last_error=None, state=None)
    return TestClient(build_app(loop, ServedModel(tokenizer=None, max_model_len=64), ServerConfig(**options),
                                metrics=None))


@pytest.mark.parametrize("path, param", [("/v1/cache/events?limit=abc", "limit"),
                                         ("/v1/cache/events?since=1.5", "since"),
                                         ("/debug/engine?clear_cache=maybe", "clear_cache")])
def test_a_bad_query_parameter_is_a_400_error_object_after_the_key_check(path, param):
    app = client(api_key="k", enable_debug_endpoints=True)
    refused = app.get(path)
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key", refused.text
    bad = app.get(path, headers=KEY)
    assert bad.status_code == 400, bad.text
    error = bad.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert error["message"].startswith(f"invalid query parameter '{param}'"), error
    # without an API key configured: the same 400
    assert client(enable_debug_endpoints=True).get(path).status_code == 400


def test_cors_preflight_allows_the_openai_sdk_headers_for_allowed_origins_only():
    app = client(allowed_origins=("https://app.example",))
    preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": SDK_HEADERS}
    ok = app.options("/v1/chat/completions", headers=preflight)
    assert ok.status_code == 200, ok.text
    assert ok.headers["access-control-allow-origin"] == "https://app.example"
    assert "x-stainless-timeout" in ok.headers["access-control-allow-headers"].lower()
    other = app.options("/v1/chat/completions", headers={**preflight, "Origin": "https://evil.example"})
    assert other.status_code == 400 and other.headers.get("access-control-allow-origin") is None
