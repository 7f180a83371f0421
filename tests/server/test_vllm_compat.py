"""Where the server's API used to differ from vLLM's (a bug hunt compared the two): each test fails on the old
behaviour. Routes run against one in-process server on the built-in model with max_model_len 256; the rest is in
process without a server."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from hybridcache.config import EngineConfig
from hybridcache.images import MediaLimits
from hybridcache.sampling import SamplingParams
from hybridcache.server.app import ServedModel, _Routes
from hybridcache.server.config import ServerConfig
from hybridcache.server.errors import APIError
from hybridcache.server.limits import DEFAULT_MAX_REQUEST_BYTES, media_request_bytes
from hybridcache.server.metrics import ServerMetrics
from hybridcache.server.protocol import ChatCompletionRequest, CompletionRequest, parse_request
from hybridcache.server.vllm_metrics import token_count_buckets
from tests.server.conftest import MODEL
from tests.server.inprocess_server import serving

MAX_MODEL_LEN = 256
ENGINE = EngineConfig(block_size=16, max_model_len=MAX_MODEL_LEN, num_blocks=512)
CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def client():
    with serving(ENGINE) as url, httpx.Client(base_url=url, timeout=60) as http:
        yield http


def _error(response: httpx.Response, status: int = 400) -> dict:
    assert response.status_code == status, response.text
    return response.json()["error"]


# ------------------------------------------------------------------------------------ context length (vLLM's words)
def test_a_prompt_that_fills_the_context_is_refused_in_vllm_words(client):
    error = _error(client.post("/v1/completions", json={"model": MODEL, "prompt": [5] * MAX_MODEL_LEN}))
    assert error["message"] == (f"This model's maximum context length is {MAX_MODEL_LEN} tokens. However, your "
                                f"request has {MAX_MODEL_LEN} input tokens. Please reduce the length of the input "
                                "messages.")
    assert error["code"] == "context_length_exceeded" and error["param"] == "prompt"


def test_prompt_plus_max_tokens_over_the_context_is_refused_in_vllm_words(client):
    error = _error(client.post("/v1/completions", json={"model": MODEL, "prompt": [5] * 200, "max_tokens": 100}))
    assert error["message"] == (f"This model's maximum context length is {MAX_MODEL_LEN} tokens. However, you "
                                "requested 300 tokens (200 in the messages, 100 in the completion). Please reduce "
                                "the length of the messages or completion.")
    assert error["code"] == "context_length_exceeded" and error["param"] == "max_tokens"


def test_a_prompt_text_refused_by_its_size_opens_with_vllm_words(client):
    error = _error(client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "word " * 200_000}]}))
    assert error["message"].startswith(f"This model's maximum context length is {MAX_MODEL_LEN} tokens. However,")
    assert error["code"] == "context_length_exceeded" and error["param"] == "messages"


# ------------------------------------------------------------------------------------ fields vLLM takes
def test_reasoning_effort_reaches_the_chat_template_under_the_request_kwargs():
    seen = []

    class Recording:
        backend = None

        def encode(self, text: str) -> list[int]:
            return [1, 2, 3]

        def apply_chat_template(self, messages, **kwargs):
            seen.append(kwargs["template_kwargs"])
            return "text"

    routes = _Routes(None, ServedModel(tokenizer=Recording(), max_model_len=64),
                     ServerConfig(default_chat_template_kwargs={"a": 1, "reasoning_effort": "low"}), None)
    # (an effort also sets enable_thinking, as vLLM: `test_vllm_protocol_fields.py`)
    for extra, wanted in (({"reasoning_effort": "high"}, {"a": 1, "reasoning_effort": "high", "enable_thinking": True}),
                          ({}, {"a": 1, "reasoning_effort": "low"}),
                          ({"reasoning_effort": "high", "chat_template_kwargs": {"reasoning_effort": "medium"}},
                           {"a": 1, "reasoning_effort": "medium", "enable_thinking": True})):
        body = parse_request(ChatCompletionRequest, {"messages": CHAT, **extra})
        asyncio.run(routes.prepare_chat(body))
        assert seen[-1] == wanted
    with pytest.raises(Exception, match="reasoning_effort"):
        parse_request(ChatCompletionRequest, {"messages": CHAT, "reasoning_effort": "extreme"})


def test_truncate_prompt_tokens_keeps_the_last_tokens(client, tokenizer):
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 8)
    assert len(ids) > 20
    body = {"model": MODEL, "prompt": ids, "max_tokens": 1, "echo": True, "truncate_prompt_tokens": 20}
    response = client.post("/v1/completions", json=body).raise_for_status().json()
    assert response["usage"]["prompt_tokens"] == 20
    assert response["choices"][0]["text"].startswith(tokenizer.decode(ids[-20:], skip_special_tokens=False))
    # a text prompt too long for the context fits once truncated
    long_text = "word " * 1000
    chat = {"model": MODEL, "messages": [{"role": "user", "content": long_text}], "max_tokens": 1,
            "truncate_prompt_tokens": 100}
    assert client.post("/v1/chat/completions", json=chat).raise_for_status().json()["usage"]["prompt_tokens"] == 100
    # -1: as many as the reply leaves room for, max_model_len - max_tokens (16, the default), as vLLM's renderer
    response = client.post("/v1/completions", json={"model": MODEL, "prompt": long_text, "truncate_prompt_tokens": -1})
    assert response.raise_for_status().json()["usage"]["prompt_tokens"] == MAX_MODEL_LEN - 16
    error = _error(client.post("/v1/completions", json={"model": MODEL, "prompt": "hi",
                                                         "truncate_prompt_tokens": MAX_MODEL_LEN + 1}))
    assert error["param"] == "truncate_prompt_tokens"


def test_a_truncated_prompt_is_tokenized_by_its_end_only(client, tokenizer):
    """With truncate_prompt_tokens a prompt passes no size check, and was tokenized whole before it was cut: a 32 MB
    prompt took 21 s and 5 GB of memory (found by a review). Only its end is tokenized (`truncation_tail`), with the
    same last tokens as the whole text's."""
    from hybridcache.server.limits import TRUNCATION_MARGIN_TOKENS, max_token_bytes, truncation_tail

    token_bytes = max_token_bytes(tokenizer)
    text = "".join(f"w{i} é€ " for i in range(50_000))
    for keep in (1, 7, 100):
        tail = truncation_tail(text, keep, MAX_MODEL_LEN * token_bytes, MAX_MODEL_LEN)
        assert len(tail) == (keep + TRUNCATION_MARGIN_TOKENS) * token_bytes
        assert tokenizer.encode(tail)[-keep:] == tokenizer.encode(text)[-keep:]
    assert truncation_tail("short", 7, MAX_MODEL_LEN * token_bytes, MAX_MODEL_LEN) == "short"
    body = {"model": MODEL, "prompt": text, "max_tokens": 1, "truncate_prompt_tokens": 100, "echo": True}
    response = client.post("/v1/completions", json=body).raise_for_status().json()
    assert response["usage"]["prompt_tokens"] == 100
    kept = tokenizer.decode(tokenizer.encode(text)[-100:], skip_special_tokens=False)
    assert response["choices"][0]["text"].startswith(kept)


@pytest.mark.parametrize("field, value, param_value", [
    ("include_stop_str_in_output", True, True), ("skip_special_tokens", False, False)])
def test_vllm_detokenizer_fields_pass_into_sampling_params(field, value, param_value):
    for request_type, base in ((CompletionRequest, {"prompt": "hi"}), (ChatCompletionRequest, {"messages": CHAT})):
        params = parse_request(request_type, {**base, field: value}).sampling_params(8)
        assert isinstance(params, SamplingParams) and getattr(params, field) == param_value
        assert getattr(parse_request(request_type, base).sampling_params(8), field) == (not param_value)


@pytest.mark.parametrize("name, words", [("chat_template", "--trust-request-chat-template"),
                                         ("bad_words", "logit_bias"), ("allowed_token_ids", "logit_bias")])
def test_a_vllm_field_still_refused_says_why(name, words):
    with pytest.raises(APIError) as info:
        parse_request(ChatCompletionRequest, {"messages": CHAT, name: ["x"]})
    assert info.value.param == name and words in info.value.message


@pytest.mark.parametrize("request_type, base, nulls", [
    (CompletionRequest, {"prompt": "hi"}, {"stream": None, "echo": None, "return_token_ids": None}),
    (ChatCompletionRequest, {"messages": CHAT},
     {"n": None, "stream": None, "logprobs": None, "parallel_tool_calls": None, "return_token_ids": None}),
])
def test_null_means_the_default_where_vllm_declares_the_field_optional(request_type, base, nulls):
    request = parse_request(request_type, {**base, **nulls})
    default = parse_request(request_type, base)
    assert {name: getattr(request, name) for name in nulls} == {name: getattr(default, name) for name in nulls}
    if request_type is CompletionRequest:  # vLLM's completions n is not Optional: null stays a 400 there
        with pytest.raises(APIError):
            parse_request(request_type, {**base, "n": None})


def test_null_n_and_stream_are_served(client):
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 2, "n": None, "stream": None, "logprobs": None,
            "parallel_tool_calls": None}
    assert len(client.post("/v1/chat/completions", json=body).raise_for_status().json()["choices"]) == 1


# ------------------------------------------------------------------------------------ limits
def test_the_default_body_limit_takes_the_images_the_docs_allow():
    assert media_request_bytes(MediaLimits()) < ServerConfig().max_request_bytes == DEFAULT_MAX_REQUEST_BYTES
    assert MediaLimits().max_bytes >= 20 * 10**6  # docs/server.md: images of up to 20 MB


def test_a_two_megabyte_body_is_read(client):
    # refused for its length (400), no longer for its body size (413)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "w" * (2 << 20)}]}
    assert _error(client.post("/v1/chat/completions", json=body))["code"] == "context_length_exceeded"


def test_no_token_budget_beyond_max_model_len_unless_asked_for():
    long_context = 1 << 20
    routes = _Routes(None, ServedModel(tokenizer=None, max_model_len=long_context), ServerConfig(), None)
    assert routes._max_tokens(None, 10, None, "messages", 1) == long_context - 10  # all the room, as vLLM
    assert routes._max_tokens(None, 10, None, "messages", 4) == long_context - 10
    assert routes._max_tokens(100_000, 10, None, "messages", 128) == 100_000
    budgeted = _Routes(None, ServedModel(tokenizer=None, max_model_len=long_context),
                       ServerConfig(max_request_tokens=100), None)
    assert budgeted._max_tokens(None, 10, None, "messages", 4) == 25


# ------------------------------------------------------------------------------------ streaming usage
def _chunks(client: httpx.Client, path: str, body: dict) -> list[dict]:
    with client.stream("POST", path, json={**body, "stream": True}) as response:
        response.raise_for_status()
        lines = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_stream_options_given_means_usage_by_default(client):
    chunks = _chunks(client, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 3,
                                                 "stream_options": {}})
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] >= 1
    chunks = _chunks(client, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 3,
                                                 "stream_options": {"include_usage": False}})
    assert all("usage" not in c for c in chunks)


@pytest.mark.parametrize("path, base", [("/v1/completions", {"prompt": "hi"}),
                                        ("/v1/chat/completions", {"messages": CHAT})])
def test_continuous_usage_stats_put_the_running_usage_on_every_chunk(client, path, base):
    body = {"model": MODEL, **base, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    chunks = _chunks(client, path, body)
    final = chunks[-1]["usage"]
    assert final["completion_tokens"] == 4
    running = [c["usage"] for c in chunks[:-1]]
    assert all(u is not None and u["prompt_tokens"] == final["prompt_tokens"] for u in running)
    counts = [u["completion_tokens"] for u in running]
    assert counts == sorted(counts) and counts[-1] == 4
    assert all(u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] for u in running)


# ------------------------------------------------------------------------------------ metrics
def test_vllm_token_histograms_are_observed_when_a_request_ends():
    assert token_count_buckets(256) == (1, 2, 5, 10, 20, 50, 100, 200)
    metrics = ServerMetrics(model_name="m", max_model_len=256)
    metrics.request_finished(7, ["stop", "length"], 0.5, generation_lens=[3, 9])
    registry = metrics.registry
    labels = {"model_name": "m", "engine": "0"}
    assert registry.get_sample_value("vllm:request_prompt_tokens_count", labels) == 2
    assert registry.get_sample_value("vllm:request_prompt_tokens_sum", labels) == 14
    assert registry.get_sample_value("vllm:request_generation_tokens_sum", labels) == 12
    assert registry.get_sample_value("vllm:request_max_num_generation_tokens_sum", labels) == 9
    assert registry.get_sample_value("vllm:request_max_num_generation_tokens_bucket", {**labels, "le": "200.0"}) == 1


def test_the_server_observes_the_vllm_token_histograms(client):
    client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2, "n": 2}).raise_for_status()
    text = client.get("/metrics").text
    for name in ("vllm:request_prompt_tokens_count", "vllm:request_generation_tokens_count",
                 "vllm:request_max_num_generation_tokens_count"):
        line = next(line for line in text.splitlines() if line.startswith(name))
        assert float(line.rsplit(" ", 1)[1]) >= 1, line


# ------------------------------------------------------------------------------------ completions logprobs and echo
def test_completion_top_logprobs_lead_with_the_sampled_token(client):
    # named by id: tokens that decode alike (parts of characters, all "") would share a key, which holds the later
    # one's logprob, as vLLM's dict comprehension (test_logprobs_format.py)
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 4, "logprobs": 2, "temperature": 1.0, "seed": 3,
            "return_tokens_as_token_ids": True}
    logprobs = client.post("/v1/completions", json=body).raise_for_status().json()["choices"][0]["logprobs"]
    for token, lp, top in zip(logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"]):
        assert next(iter(top.items())) == (token, lp) and 2 <= len(top) <= 3
    del body["return_tokens_as_token_ids"]
    logprobs = client.post("/v1/completions", json=body).raise_for_status().json()["choices"][0]["logprobs"]
    for token, top in zip(logprobs["tokens"], logprobs["top_logprobs"]):
        assert next(iter(top)) == token and 1 <= len(top) <= 3
    body["logprobs"] = 0
    logprobs = client.post("/v1/completions", json=body).raise_for_status().json()["choices"][0]["logprobs"]
    assert logprobs["top_logprobs"] == [{t: lp} for t, lp in zip(logprobs["tokens"], logprobs["token_logprobs"])]


def test_echo_of_token_ids_keeps_special_tokens(client, tokenizer):
    ids = tokenizer.encode("<|im_start|>user")
    assert tokenizer.decode(ids) != tokenizer.decode(ids, skip_special_tokens=False)  # it holds a special token
    body = {"model": MODEL, "prompt": ids, "max_tokens": 1, "echo": True, "logprobs": 0}
    choice = client.post("/v1/completions", json=body).raise_for_status().json()["choices"][0]
    assert choice["text"].startswith("<|im_start|>user")
    offsets, tokens = choice["logprobs"]["text_offset"], choice["logprobs"]["tokens"]
    assert all(choice["text"][o:o + len(t)] == t for o, t in zip(offsets, tokens))


def test_echoed_prompt_tokens_inside_a_character_add_up_to_the_text(client):
    """"€" is three byte tokens of the built-in tokenizer: as vLLM's, the first two read "" and the third "€", so
    the echoed tokens join into the text and each offset points at its token (each read "\ufffd" before)."""
    body = {"model": MODEL, "prompt": "x€y", "max_tokens": 1, "echo": True, "logprobs": 0, "temperature": 0}
    choice = client.post("/v1/completions", json=body).raise_for_status().json()["choices"][0]
    tokens, offsets = choice["logprobs"]["tokens"], choice["logprobs"]["text_offset"]
    assert tokens[:5] == ["x", "", "", "€", "y"] and offsets[:5] == [0, 1, 1, 1, 2]
    assert all(choice["text"][o:o + len(t)] == t for o, t in zip(offsets, tokens))


# ------------------------------------------------------------------------------------ other routes
def test_ping_answers_get_and_post(client):
    assert client.get("/ping").status_code == 200
    assert client.post("/ping").status_code == 200  # no body, no content type: nothing is read


def test_detokenize_takes_the_ids_completions_takes(client, tokenizer):
    token = tokenizer.vocab_size + 3  # past the tokenizer's vocabulary, inside the model's
    assert client.post("/v1/completions", json={"model": MODEL, "prompt": [5, token], "max_tokens": 1}).is_success
    response = client.post("/detokenize", json={"model": MODEL, "tokens": [5, token]})
    assert response.status_code == 200, response.text


def test_detokenize_keeps_special_tokens_as_vllm_does(client, tokenizer):
    """vLLM decodes /detokenize's ids with special tokens kept: a chat prompt's round trip keeps its role markers
    (they were dropped)."""
    text = "<|im_start|>user\nhi there<|im_end|>\n"
    ids = client.post("/tokenize", json={"model": MODEL, "prompt": text}).json()["tokens"]
    assert client.post("/detokenize", json={"model": MODEL, "tokens": ids}).json() == {"prompt": text}


# ------------------------------------------------------------------------------------ detokenizer fields end to end
@pytest.mark.parametrize("stream", [False, True])
def test_include_stop_str_in_output_keeps_the_stop_string(client, tokenizer, stream):
    x = tokenizer.encode("x")
    assert len(x) == 1
    body = {"model": MODEL, "prompt": "a", "max_tokens": 8, "logit_bias": {str(x[0]): 100}, "stop": ["xx"]}

    def text(extra: dict) -> str:
        if stream:
            chunks = _chunks(client, "/v1/completions", {**body, **extra})
            return "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
        return client.post("/v1/completions", json={**body, **extra}).raise_for_status().json()["choices"][0]["text"]

    assert text({}) == ""
    assert text({"include_stop_str_in_output": True}) == "xx"


def test_skip_special_tokens_false_shows_special_tokens(client, tokenizer):
    special = tokenizer.encode("<|im_start|>")
    assert len(special) == 1
    body = {"model": MODEL, "prompt": "a", "max_tokens": 2, "logit_bias": {str(special[0]): 100}}
    shown = client.post("/v1/completions", json={**body, "skip_special_tokens": False}).raise_for_status().json()
    assert shown["choices"][0]["text"] == "<|im_start|>" * 2
    hidden = client.post("/v1/completions", json=body).raise_for_status().json()
    assert hidden["choices"][0]["text"] == ""



# ------------------------------------------------------------------------------------ stop_reason
@pytest.mark.parametrize("path, base", [("/v1/completions", {"prompt": "a"}),
                                        ("/v1/chat/completions", {"messages": CHAT})])
@pytest.mark.parametrize("stops, include, wanted", [
    ({"stop": ["yy", "xx"]}, False, "xx"), ({"stop": ["yx", "xx"]}, True, "xx"),
    ({"stop_token_ids": ["X"]}, False, "X"), ({}, False, None)])
def test_stop_reason_names_the_stop_that_ended_a_choice(client, tokenizer, path, base, stops, include, wanted):
    x = tokenizer.encode("x")[0]
    stops = {key: [x if value == "X" else value for value in values] for key, values in stops.items()}
    wanted = x if wanted == "X" else wanted
    body = {"model": MODEL, **base, "max_tokens": 4, "logit_bias": {str(x): 100}, **stops,
            "include_stop_str_in_output": include}
    choice = client.post(path, json=body).raise_for_status().json()["choices"][0]
    assert choice["stop_reason"] == wanted and choice["finish_reason"] == ("length" if wanted is None else "stop")
    chunks = [c for c in _chunks(client, path, body) if c["choices"]]
    assert [c["choices"][0]["stop_reason"] for c in chunks] == [None] * (len(chunks) - 1) + [wanted]


@pytest.mark.parametrize("path, base", [("/v1/completions", {"prompt": "a"}),
                                        ("/v1/chat/completions", {"messages": CHAT})])
def test_stop_reason_is_null_on_the_tokenizer_eos_and_names_the_other_eos_ids(client, tokenizer, path, base):
    """vLLM's scheduler checks the tokenizer's EOS before `stop_token_ids` (a stop on it has stop_reason null, listed
    or not), and adds generation_config.json's other EOS ids to `stop_token_ids` (a stop on one names it). The
    server named the EOS id when the client listed it, and said null for the others."""
    eos = tokenizer.eos_token_id  # <|im_end|>
    (other,) = tokenizer.encode("<|endoftext|>")  # generation_config.json's other EOS id
    cases = [({"logit_bias": {str(eos): 100}, "stop_token_ids": [eos]}, None),
             ({"logit_bias": {str(eos): 100}}, None),
             ({"logit_bias": {str(other): 100}}, other),
             ({"logit_bias": {str(other): 100}, "stop_token_ids": [other]}, other),
             ({"logit_bias": {str(eos): 100}, "stop_token_ids": [eos], "ignore_eos": True}, eos)]
    for extra, wanted in cases:
        body = {"model": MODEL, **base, "max_tokens": 4, **extra}
        choice = client.post(path, json=body).raise_for_status().json()["choices"][0]
        assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", wanted), extra
        last = [c for c in _chunks(client, path, body) if c["choices"]][-1]["choices"][0]
        assert (last["finish_reason"], last["stop_reason"]) == ("stop", wanted), extra


def test_return_token_ids_gives_the_prompt_ids_where_vllm_does(client, tokenizer):
    """vLLM's return_token_ids puts the prompt's ids on each completion choice and on the chat response, beside each
    choice's `token_ids` (only the latter came back; found by a review)."""
    ids = tokenizer.encode("The quick brown fox")
    body = {"model": MODEL, "prompt": ids, "max_tokens": 2, "n": 2, "return_token_ids": True, "ignore_eos": True}
    response = client.post("/v1/completions", json=body).raise_for_status().json()
    assert [c["prompt_token_ids"] for c in response["choices"]] == [ids, ids]
    assert all(len(c["token_ids"]) == 2 for c in response["choices"])
    chat = {"model": MODEL, "messages": CHAT, "max_tokens": 2, "return_token_ids": True, "ignore_eos": True}
    response = client.post("/v1/chat/completions", json=chat).raise_for_status().json()
    assert response["prompt_token_ids"] == tokenizer.encode(tokenizer.apply_chat_template(CHAT))
    assert "prompt_token_ids" not in response["choices"][0] and len(response["choices"][0]["token_ids"]) == 2


def test_return_token_ids_streamed_sends_the_prompt_ids_on_each_choice_first_chunk(client, tokenizer):
    """vLLM's streams send the prompt's ids once per choice, on its first chunk: in the choice (`prompt_token_ids`)
    for completions, at the chunk's top level (beside `choices`) for chat; they were not sent at all."""
    ids = tokenizer.encode("The quick brown fox")
    chat_ids = tokenizer.encode(tokenizer.apply_chat_template(CHAT))
    for path, base, prompt_ids in (("/v1/completions", {"prompt": ids}, ids),
                                   ("/v1/chat/completions", {"messages": CHAT}, chat_ids)):
        body = {"model": MODEL, **base, "max_tokens": 3, "n": 2, "return_token_ids": True, "ignore_eos": True}
        chunks = [c for c in _chunks(client, path, body) if c["choices"]]
        for index in (0, 1):
            mine = [c for c in chunks if c["choices"][0]["index"] == index]
            sent = [c.get("prompt_token_ids") if "messages" in base else c["choices"][0].get("prompt_token_ids")
                    for c in mine]
            assert sent == [prompt_ids] + [None] * (len(mine) - 1), path
        assert all("prompt_token_ids" not in c["choices"][0] for c in chunks if "messages" in base)
        assert all("prompt_token_ids" not in c for c in chunks if "prompt" in base)
        unasked = _chunks(client, path, {**body, "return_token_ids": False})
        assert not any("prompt_token_ids" in c or "prompt_token_ids" in (c["choices"] or [{}])[0] for c in unasked)


def test_return_token_ids_streamed_sends_each_chunks_new_ids(client):
    """vLLM's stream chunks carry the ids generated since the choice's previous chunk (they came whole on the
    finishing chunk): joined, each choice's ids equal the non-streamed choice's."""
    for path, base in (("/v1/completions", {"prompt": "The quick brown fox"}),
                       ("/v1/chat/completions", {"messages": CHAT})):
        body = {"model": MODEL, **base, "max_tokens": 6, "n": 2, "seed": 5, "return_token_ids": True,
                "ignore_eos": True, "structured_outputs": {"regex": "[a-z]{40}"}}  # (text at every token)
        whole = client.post(path, json=body).raise_for_status().json()["choices"]
        chunks = [c["choices"][0] for c in _chunks(client, path, body) if c["choices"]]
        for index in (0, 1):
            carried = [c.get("token_ids") for c in chunks if c["index"] == index]
            streamed = [t for ids in carried if ids for t in ids]
            assert streamed == whole[index]["token_ids"] and len(streamed) == 6, path
            assert sum(1 for ids in carried if ids) > 1, path  # not all on one chunk


def test_stream_options_without_a_stream_is_refused_as_vllm_does(client):
    for path, base in (("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions", {"messages": CHAT})):
        body = {"model": MODEL, "max_tokens": 1, **base, "stream_options": {"include_usage": True}}
        error = _error(client.post(path, json=body))
        assert error["param"] == "stream_options" and "stream: true" in error["message"]
        assert client.post(path, json={**body, "stream": True}).status_code == 200


def test_continue_final_message_with_an_explicit_generation_prompt_is_refused_as_vllm_does(client):
    """vLLM refuses the pair when the client sends both true; `continue_final_message` alone (the generation
    prompt's default left out) continues the final message, here and there."""
    messages = [*CHAT, {"role": "assistant", "content": "Hel"}]
    body = {"model": MODEL, "max_tokens": 1, "messages": messages, "continue_final_message": True}
    for route in ("/v1/chat/completions", "/tokenize"):
        error = _error(client.post(route, json={**body, "add_generation_prompt": True}))
        assert error["param"] == "add_generation_prompt" and "continue_final_message" in error["message"], route
        assert client.post(route, json=body).status_code == 200, route
        assert client.post(route, json={**body, "add_generation_prompt": False}).status_code == 200, route


@pytest.mark.parametrize(("path", "base"), [("/v1/completions", {"prompt": "naïve", "echo": True, "logprobs": 2}),
                                            ("/v1/chat/completions", {"messages": CHAT, "logprobs": True,
                                                                      "top_logprobs": 2})])
def test_return_tokens_as_token_ids_names_each_logprob_token_by_its_id(client, tokenizer, path, base):
    """vLLM's `return_tokens_as_token_ids`: a logprob's token is "token_id:<id>" (the part of a character that
    decodes to U+FFFD is then told apart); the field was ignored."""
    body = {"model": MODEL, "max_tokens": 3, "temperature": 0, **base}
    plain = client.post(path, json=body).json()["choices"][0]
    named = client.post(path, json={**body, "return_tokens_as_token_ids": True}).json()["choices"][0]
    assert named["text" if "prompt" in base else "message"] == plain["text" if "prompt" in base else "message"]
    if "prompt" in base:
        logprobs = named["logprobs"]
        ids = tokenizer.encode(base["prompt"])
        assert logprobs["tokens"][:len(ids)] == [f"token_id:{i}" for i in ids]
        assert all(t.startswith("token_id:") for t in logprobs["tokens"])
        assert all(k.startswith("token_id:") for top in logprobs["top_logprobs"][1:] for k in top)
        assert logprobs["text_offset"][1] == len(f"token_id:{ids[0]}")  # offsets count the names, as vLLM's
    else:
        content = named["logprobs"]["content"]
        assert all(c["token"].startswith("token_id:") and c["bytes"] == list(c["token"].encode()) for c in content)
        assert all(t["token"].startswith("token_id:") for c in content for t in c["top_logprobs"])


# ------------------------------------------------------------------------------------ SageMaker's /invocations
def test_invocations_answers_as_the_chat_or_completions_route(client):
    """vLLM's SageMaker route (POST /invocations): a chat request (`messages`) or a completion request (`prompt`),
    answered as its own route answers it; it was a 404 here."""
    greedy = {"model": MODEL, "max_tokens": 5, "temperature": 0, "seed": 0}
    for path, body in (("/v1/chat/completions", {**greedy, "messages": CHAT}),
                       ("/v1/completions", {**greedy, "prompt": "hello there"})):
        direct = client.post(path, json=body)
        invoked = client.post("/invocations", json=body)
        assert direct.status_code == invoked.status_code == 200, invoked.text
        a, b = direct.json(), invoked.json()
        assert (a["object"], a["choices"], a["usage"]["completion_tokens"]) == \
               (b["object"], b["choices"], b["usage"]["completion_tokens"])
    streamed = client.post("/invocations", json={**greedy, "messages": CHAT, "stream": True})
    assert streamed.status_code == 200 and streamed.text.rstrip().endswith("data: [DONE]")
    neither = _error(client.post("/invocations", json={"model": MODEL, "input": "hi"}))
    assert "messages" in neither["message"] and "prompt" in neither["message"]
    assert _error(client.post("/invocations", json={"model": MODEL, "messages": []}))["param"] == "messages"
    assert client.get("/load").json()["server_load"] == 0
