"""Completions and chat against a real server with the `openai` client: streaming and not, n > 1, stop
strings, seeds, usage, /v1/models, /health, /metrics, and every validation error."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.server.conftest import MODEL
from tests.server.server_process import SMALL_ENGINE, metric_value, running_server

API_KEY = "test-key"
MAX_REQUEST_BYTES = 20_000


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    args = (*SMALL_ENGINE, "--api-key", API_KEY, "--max-request-bytes", str(MAX_REQUEST_BYTES))
    with running_server(*args, tmp_dir=tmp_path_factory.mktemp("api")) as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


def _stream_texts(chunks) -> tuple[dict[int, str], dict[int, str], object]:
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    usage = None
    for chunk in chunks:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            piece = choice.text if hasattr(choice, "text") else (choice.delta.content or "")
            texts[choice.index] = texts.get(choice.index, "") + piece
            if choice.finish_reason is not None:
                reasons[choice.index] = choice.finish_reason
    return texts, reasons, usage


def test_completion_streamed_text_equals_non_streamed_greedy(client, tokenizer):
    prompt = "The quick brown fox jumps over"
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
    assert full.choices[0].finish_reason in ("length", "stop")
    assert full.usage.prompt_tokens == len(tokenizer.encode(prompt))
    assert full.usage.prompt_tokens_details.cached_tokens >= 0
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    texts, reasons, usage = _stream_texts(chunks)
    assert texts == {0: full.choices[0].text}
    assert reasons == {0: full.choices[0].finish_reason}
    assert usage.completion_tokens == full.usage.completion_tokens
    assert usage.prompt_tokens == full.usage.prompt_tokens
    assert chunks[-1].choices == []  # the usage chunk comes last and alone


def test_completion_prompt_as_token_ids(client, tokenizer):
    ids = tokenizer.encode("Hello there, general")
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=10, temperature=0)
    by_text = client.completions.create(model=MODEL, prompt="Hello there, general", max_tokens=10, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)


def test_chat_streamed_equals_non_streamed_and_uses_the_template(client, tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a color."}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    expected_prompt = tokenizer.encode(tokenizer.apply_chat_template(messages))
    assert full.usage.prompt_tokens == len(expected_prompt)
    assert full.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    texts, reasons, usage = _stream_texts(chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert texts == {0: full.choices[0].message.content}
    assert reasons == {0: full.choices[0].finish_reason}
    assert usage.prompt_tokens == full.usage.prompt_tokens
    assert usage.total_tokens == full.usage.total_tokens


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_n_choices_seeded_streamed_equals_non_streamed(client, chat):
    kwargs = dict(model=MODEL, max_tokens=12, temperature=1.0, top_p=0.9, seed=11, n=3,
                  extra_body={"top_k": 50, "ignore_eos": True})
    if chat:
        kwargs["messages"] = [{"role": "user", "content": "Tell me three things."}]
        create = client.chat.completions.create
    else:
        kwargs["prompt"] = "Three things:"
        create = client.completions.create
    full = create(**kwargs)
    assert sorted(c.index for c in full.choices) == [0, 1, 2]
    full_texts = {c.index: (c.message.content if chat else c.text) for c in full.choices}
    assert all(c.finish_reason == "length" for c in full.choices)
    assert full.usage.completion_tokens == 3 * 12
    assert len(set(full_texts.values())) > 1  # three different samples
    texts, reasons, _ = _stream_texts(create(**kwargs, stream=True))
    assert texts == full_texts
    assert reasons == {0: "length", 1: "length", 2: "length"}


def test_stop_strings_cut_the_text_streamed_and_not(client):
    prompt = "Once upon a time"
    free = client.completions.create(model=MODEL, prompt=prompt, max_tokens=32, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    # a two-character stop string from the middle of the greedy text (ASCII, so no partial characters)
    start = next(i for i in range(3, len(free) - 1) if free[i:i + 2].isascii() and free[i:i + 2].isprintable())
    stop = free[start:start + 2]
    expected = free[: free.find(stop)]
    cut = client.completions.create(model=MODEL, prompt=prompt, max_tokens=32, temperature=0, stop=[stop, "\x00zz"],
                                    extra_body={"ignore_eos": True})
    assert cut.choices[0].text == expected
    assert cut.choices[0].finish_reason == "stop"
    texts, reasons, _ = _stream_texts(client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=32, temperature=0, stop=[stop, "\x00zz"], stream=True,
        extra_body={"ignore_eos": True}))
    assert texts == {0: expected}
    assert reasons == {0: "stop"}


def test_models_and_health(client, server):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    health = httpx.get(f"{server.base_url}/health").json()
    assert health == {"status": "ok"}  # without the key: healthy or not, no engine internals
    wrong = httpx.get(f"{server.base_url}/health", headers={"authorization": "Bearer nope"}).json()
    assert wrong == {"status": "ok"}
    keyed = httpx.get(f"{server.base_url}/health", headers={"authorization": f"Bearer {API_KEY}"}).json()
    assert keyed["status"] == "ok" and keyed["engine"]["num_blocks"] == 2048 and keyed["last_error"] is None
    assert keyed["engine"]["weights"] == "dense" and keyed["engine"]["kv_cache_dtype"] == "float32"


def test_metrics_hit_tokens_move_by_exactly_the_reported_cached_tokens(client, server):
    def scrape() -> str:
        return httpx.get(f"{server.base_url}/metrics").text

    before = scrape()
    base = "A shared document that several requests start with, long enough to span blocks. " * 2
    reported_cached, reported_prompt, requests_hit = 0, 0, 0
    for suffix in ("", " First question?", " Second question, longer than the first?", " First question?"):
        r = client.completions.create(model=MODEL, prompt=base + suffix, max_tokens=4, temperature=0)
        reported_cached += r.usage.prompt_tokens_details.cached_tokens
        reported_prompt += r.usage.prompt_tokens
        requests_hit += r.usage.prompt_tokens_details.cached_tokens > 0
    after = scrape()
    assert reported_cached > 0
    # one restored checkpoint per request that reported cached tokens (a hybrid model needs its state)
    assert (metric_value(after, "hybridcache_checkpoint_hits_total")
            - metric_value(before, "hybridcache_checkpoint_hits_total")) == requests_hit
    hits = "hybridcache_prefix_cache_hit_tokens_total"
    queries = "hybridcache_prefix_cache_queries_tokens_total"
    assert metric_value(after, hits) - metric_value(before, hits) == reported_cached
    assert metric_value(after, queries) - metric_value(before, queries) == reported_prompt
    assert metric_value(after, "hybridcache_checkpoint_saves_total", 'reason="prefill_end"') > 0
    assert metric_value(after, "hybridcache_time_to_first_token_seconds_count") > metric_value(
        before, "hybridcache_time_to_first_token_seconds_count")
    for name in ("hybridcache_kv_blocks_used", "hybridcache_state_slots_used", "hybridcache_inter_token_latency_"
                 "seconds_bucket", "hybridcache_request_finished_total", "hybridcache_checkpoint_evictions_total",
                 "hybridcache_checkpoint_saves_declined_total"):
        assert name in after


def _post(server, path: str, body: bytes | str, key: str | None = API_KEY) -> httpx.Response:
    headers = {"content-type": "application/json"}
    if key is not None:
        headers["authorization"] = f"Bearer {key}"
    return httpx.post(f"{server.base_url}{path}", content=body, headers=headers, timeout=30)


VALIDATION_CASES = [
    # (id, path, body, api key, status, words the message must contain)
    ("malformed-json", "/v1/completions", '{"model": "x", "prompt": ', API_KEY, 400, "not valid JSON"),
    ("not-an-object", "/v1/completions", "[1, 2]", API_KEY, 400, "JSON object"),
    ("unknown-model", "/v1/completions", '{"model": "gpt-9", "prompt": "hi"}', API_KEY, 404, "gpt-9"),
    ("missing-prompt", "/v1/completions", f'{{"model": "{MODEL}"}}', API_KEY, 400, "prompt"),
    ("empty-prompt", "/v1/completions", f'{{"model": "{MODEL}", "prompt": ""}}', API_KEY, 400, "empty"),
    ("empty-ids", "/v1/completions", f'{{"model": "{MODEL}", "prompt": []}}', API_KEY, 400, "empty"),
    # vLLM's wording for a request that does not fit the context, which clients match
    ("prompt-too-long", "/v1/completions", f'{{"model": "{MODEL}", "prompt": "{"x" * 600}"}}', API_KEY, 400,
     "This model's maximum context length is 512 tokens. However, your request has 600 input tokens."),
    ("max-tokens-over-limit", "/v1/completions", f'{{"model": "{MODEL}", "prompt": "hi", "max_tokens": 600}}',
     API_KEY, 400, "This model's maximum context length is 512 tokens. However, you requested 602 tokens (2 in the "
     "messages, 600 in the completion)."),
    ("max-tokens-zero", "/v1/completions", f'{{"model": "{MODEL}", "prompt": "hi", "max_tokens": 0}}', API_KEY,
     400, "max_tokens"),
    ("token-id-out-of-range", "/v1/completions", f'{{"model": "{MODEL}", "prompt": [1, 2, 99999]}}', API_KEY,
     400, "99999"),
    ("negative-token-id", "/v1/completions", f'{{"model": "{MODEL}", "prompt": [5, -1]}}', API_KEY, 400, "-1"),
    ("temperature", "/v1/completions", f'{{"model": "{MODEL}", "prompt": "hi", "temperature": -0.5}}', API_KEY,
     400, "temperature"),
    ("top-p", "/v1/completions", f'{{"model": "{MODEL}", "prompt": "hi", "top_p": 1.5}}', API_KEY, 400, "top_p"),
    ("top-k", "/v1/completions", f'{{"model": "{MODEL}", "prompt": "hi", "top_k": -7}}', API_KEY, 400, "top_k"),
    ("n-zero", "/v1/completions", f'{{"model": "{MODEL}", "prompt": "hi", "n": 0}}', API_KEY, 400, "n must"),
    ("temperature-type", "/v1/completions", f'{{"model": "{MODEL}", "prompt": "hi", "temperature": "hot"}}',
     API_KEY, 400, "temperature"),
    ("empty-stop", "/v1/completions", f'{{"model": "{MODEL}", "prompt": "hi", "stop": [""]}}', API_KEY, 400, "stop"),
    ("batch-with-an-empty-prompt", "/v1/completions", f'{{"model": "{MODEL}", "prompt": ["a", ""]}}', API_KEY, 400,
     "empty"),
    ("chat-no-messages", "/v1/chat/completions", f'{{"model": "{MODEL}", "messages": []}}', API_KEY, 400,
     "messages"),
    ("chat-bad-role", "/v1/chat/completions",
     f'{{"model": "{MODEL}", "messages": [{{"role": "wizard", "content": "x"}}]}}', API_KEY, 400, "role"),
    ("chat-max-tokens", "/v1/chat/completions",
     f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": "x"}}], "max_tokens": 5000}}', API_KEY, 400,
     "This model's maximum context length is 512 tokens. However, you requested"),
    ("wrong-api-key", "/v1/completions", f'{{"model": "{MODEL}", "prompt": "hi"}}', "wrong", 401, "API key"),
    ("missing-api-key", "/v1/chat/completions", f'{{"model": "{MODEL}", "messages": []}}', None, 401, "API key"),
    ("body-too-large", "/v1/completions", f'{{"model": "{MODEL}", "prompt": "{"y" * MAX_REQUEST_BYTES}"}}', API_KEY,
     413, "limit"),
]


@pytest.mark.parametrize("path, body, key, status, words", [c[1:] for c in VALIDATION_CASES],
                         ids=[c[0] for c in VALIDATION_CASES])
def test_validation_errors_are_openai_error_objects(server, path, body, key, status, words):
    response = _post(server, path, body, key)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert words in error["message"]


def test_unknown_route_is_an_error_object(server):
    response = httpx.get(f"{server.base_url}/v1/nothing-here")
    assert response.status_code == 404
    assert "error" in response.json()


def test_openai_client_raises_on_bad_requests_and_the_server_keeps_serving(client, server):
    with pytest.raises(openai.BadRequestError, match="top_p"):
        client.completions.create(model=MODEL, prompt="hi", top_p=0)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="hi")
    bad = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    ok = client.completions.create(model=MODEL, prompt="still alive?", max_tokens=3, temperature=0)
    assert ok.usage.completion_tokens >= 1
    assert httpx.get(f"{server.base_url}/health").json()["status"] == "ok"
