"""vLLM's `cache_salt` over HTTP: completions, chat, /v1/responses and /v1/cache/match share cached prefixes only
between requests of the same salt (tests/engine/test_cache_salt.py checks the engine's side)."""

from __future__ import annotations

import httpx
import pytest

from hybridcache.models.builtin import BUILTIN_NAME

from .inprocess_server import serving

PROMPT = "The tenant's private system prompt, long enough to fill several blocks of sixteen tokens each: " * 3


@pytest.fixture(scope="module")
def client():
    with serving() as base_url, httpx.Client(base_url=base_url, timeout=120) as http:
        yield http


def _cached(client: httpx.Client, path: str, body: dict) -> int:
    response = client.post(path, json={"model": BUILTIN_NAME, "max_tokens": 2, "temperature": 0, **body})
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    return (usage.get("prompt_tokens_details") or usage.get("input_tokens_details"))["cached_tokens"]


@pytest.mark.parametrize("path, field", [("/v1/completions", {"prompt": "c " + PROMPT}),
                                         ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}]}),
                                         ("/v1/responses", {"input": "r " + PROMPT})])
def test_only_the_same_salt_hits(client, path, field):
    body = {**field, **({"max_output_tokens": 2} if path == "/v1/responses" else {})}
    assert _cached(client, path, {**body, "cache_salt": "tenant-a"}) == 0
    assert _cached(client, path, {**body, "cache_salt": "tenant-b"}) == 0  # another tenant learns nothing
    assert _cached(client, path, body) == 0  # nor does a request without a salt
    assert _cached(client, path, {**body, "cache_salt": "tenant-a"}) > 0  # the tenant itself hits


def test_the_dry_run_match_reads_the_salted_root(client):
    body = {"model": BUILTIN_NAME, "prompt": "m " + PROMPT}
    assert _cached(client, "/v1/completions", {**body, "cache_salt": "s1"}) == 0
    matches = {salt: client.post("/v1/cache/match", json={**body, **({"cache_salt": salt} if salt else {})}).json()
               for salt in ("s1", "s2", None)}
    assert matches["s1"]["matches"][0]["cached_tokens"] > 0
    assert matches["s2"]["matches"][0]["cached_tokens"] == matches[None]["matches"][0]["cached_tokens"] == 0


@pytest.mark.parametrize("salt", ["", 7, ["a"], "x" * 1025])
def test_a_bad_salt_is_a_400_naming_it(client, salt):
    for path, body in (("/v1/completions", {"prompt": "hi"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        response = client.post(path, json={"model": BUILTIN_NAME, "max_tokens": 1, "cache_salt": salt, **body})
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "cache_salt"
