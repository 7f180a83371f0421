"""Request bodies that used to answer 500 or were silently half-honoured: each is a 400 naming its field
(in process, no server: parse_request is what both routes call first)."""

from __future__ import annotations

import pytest

from hybridcache.server.body_checks import MAX_JSON_DEPTH, UNSUPPORTED_FIELDS
from hybridcache.server.config import ServerConfig
from hybridcache.server.errors import APIError
from hybridcache.server.protocol import MAX_N, ChatCompletionRequest, CompletionRequest, parse_request

CHAT = {"messages": [{"role": "user", "content": "hi"}]}


def _refused(body: dict, chat: bool = False) -> APIError:
    with pytest.raises(APIError) as info:
        request = parse_request(ChatCompletionRequest if chat else CompletionRequest, body)
        request.sampling_params(8)
    assert info.value.status == 400
    return info.value


def _nested(depth: int) -> dict:
    value: object = 1
    for _ in range(depth):
        value = {"a": value}
    return value  # type: ignore[return-value]


@pytest.mark.parametrize("body, chat, param", [
    ({"prompt": "a\ud800b"}, False, "prompt"),
    ({"prompt": "hi", "model": "m\udfff"}, False, "model"),
    ({"prompt": "hi", "stop": ["ok", "\ud83d"]}, False, "stop.1"),
    ({"messages": [{"role": "user", "content": "a\ud800b"}]}, True, "messages.0.content"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]}, True,
     "messages.0.content.0.text"),
    ({"prompt": "hi", "extra": {"k\ud800": 1}}, False, "extra.k\\ud800"),
    ({"prompt": "hi", "\udc00": 1}, False, "\\udc00"),
    ({"prompt": [1, 2.5]}, False, "prompt.1"),
    ({"prompt": [1, 2**40]}, False, "prompt.1"),
    ({"prompt": "hi", "seed": 2**64}, False, "seed"),
    ({"prompt": "hi", "temperature": float("nan")}, False, "temperature"),
    ({"prompt": "hi", "top_p": float("inf")}, False, "top_p"),
    ({"prompt": "hi", "stop_token_ids": [-3]}, False, "stop_token_ids.0"),
    ({"prompt": "hi", "n": MAX_N + 1}, False, "n"),
    ({"messages": [{"role": "user", "content": None}]}, True, "messages.0.content"),
    # image_url parts parse (a model without a vision tower refuses them in the route: test_hardening's image-part)
    ({"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "x"}}]}]}, True,
     "messages.0.content.0.type"),
    ({"messages": [{"role": "assistant", "content": "x", "tool_calls": [{"id": "1"}]}]}, True,
     "messages.0.tool_calls.0.function"),
])
def test_bad_field_is_a_400_naming_it(body, chat, param):
    error = _refused(body, chat)
    assert error.param == param, error.message


@pytest.mark.parametrize("part, param, reason", [
    ({"type": "image_url"}, "messages.0.content.0.image_url", "required"),
    ({"type": "image_url", "image_url": "data:image/png;base64,AAAA"}, "messages.0.content.0.image_url",
     "dictionary"),
    ({"type": "image_url", "image_url": {}}, "messages.0.content.0.image_url.url", "required"),
    ({"type": "text"}, "messages.0.content.0.text", "required"),
    ({"type": "input_audio"}, "messages.0.content.0.type", "'text', 'image_url' or 'video_url'"),
    ("hi", "messages.0.content.0.type", "an object"),
])
def test_a_malformed_content_part_is_named_by_its_own_field(part, param, reason):
    # a part is checked against the class its type names: an image part missing its image_url was reported as
    # the text part's type literal ("Input should be 'text'"), as if image parts were refused
    error = _refused({"messages": [{"role": "user", "content": [part]}]}, True)
    assert error.param == param and reason in error.message, error.message


def test_deep_nesting_names_where_it_is_too_deep():
    error = _refused({"prompt": "hi", "extra": _nested(MAX_JSON_DEPTH + 5)})
    assert error.param == "extra" and "extra.a.a.a" in error.message and str(MAX_JSON_DEPTH) in error.message


def test_a_tool_schema_as_deep_as_client_libraries_write_them_passes():
    """LangChain's bind_tools inlines a pydantic model's $defs: a tool of models eight deep (lists and Optionals
    between) is ~33 levels of body, past the old limit of 32 (a 400 where vLLM, which has no limit, serves it)."""
    schema: dict = {"type": "string"}
    for _ in range(30):  # 60 levels: 30 nested objects, each `properties` -> its field
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": [tool], "tool_choice": "required"}
    assert parse_request(ChatCompletionRequest, body).tool_dicts()[0]["function"]["parameters"] == schema


@pytest.mark.parametrize("name", sorted(UNSUPPORTED_FIELDS))
def test_every_unsupported_field_is_refused_by_name_unless_neutral(name):
    neutral = UNSUPPORTED_FIELDS[name]
    for value in neutral:  # the values that mean "off" pass
        parse_request(CompletionRequest, {"prompt": "hi", name: value})
    error = _refused({"prompt": "hi", name: {"on": True}})
    assert error.param == name and name in error.message and error.code == "unsupported_parameter"


def test_a_boolean_is_not_taken_for_a_neutral_number():
    assert _refused({"prompt": "hi", "length_penalty": True}).param == "length_penalty"
    assert _refused({"prompt": "hi", "best_of": True}).param == "best_of"
    parse_request(CompletionRequest, {"prompt": "hi", "length_penalty": 1.0, "best_of": 1})


def test_valid_requests_still_parse():
    request = parse_request(CompletionRequest, {"prompt": [1, 2, 3], "seed": -5, "n": MAX_N, "stop": "x"})
    assert request.sampling_params(4).n == MAX_N
    chat = parse_request(ChatCompletionRequest, {**CHAT, "max_completion_tokens": 3})
    assert chat.messages[0].as_template_input() == {"role": "user", "content": "hi"}
    no_content = parse_request(ChatCompletionRequest, {"messages": [{"role": "user"}]})
    assert no_content.messages[0].as_template_input()["content"] == ""


def test_server_config_validates_the_new_limits():
    assert ServerConfig(allowed_origins=["http://a"]).allowed_origins == ("http://a",)
    with pytest.raises(ValueError, match="max_request_tokens"):
        ServerConfig(max_request_tokens=0)
    assert ServerConfig(host="127.0.0.1").binds_loopback_only()
    assert not ServerConfig(host="0.0.0.0").binds_loopback_only()


def _app(config: ServerConfig):
    from types import SimpleNamespace

    from hybridcache.server.app import ServedModel, build_app

    loop = SimpleNamespace(running=True, healthy=True, last_error=None, state=None)
    return build_app(loop, ServedModel(tokenizer=None, max_model_len=64), config, metrics=None)


def test_cors_headers_only_for_allowed_origins():
    from fastapi.testclient import TestClient

    preflight = {"origin": "http://app.example", "access-control-request-method": "POST",
                 "access-control-request-headers": "authorization, content-type"}
    with_cors = TestClient(_app(ServerConfig(allowed_origins=("http://app.example",))))
    ok = with_cors.options("/v1/chat/completions", headers=preflight)
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "http://app.example"
    other = with_cors.options("/v1/chat/completions", headers={**preflight, "origin": "http://evil.example"})
    assert other.headers.get("access-control-allow-origin") is None
    plain = TestClient(_app(ServerConfig())).options("/v1/chat/completions", headers=preflight)
    assert plain.headers.get("access-control-allow-origin") is None


def test_text_plain_is_refused_before_anything_runs():
    from fastapi.testclient import TestClient

    client = TestClient(_app(ServerConfig()))
    response = client.post("/v1/completions", content='{"prompt": "hi"}', headers={"content-type": "text/plain"})
    assert response.status_code == 415 and response.json()["error"]["param"] == "content-type"


@pytest.mark.parametrize("levels, words", [(200, "nested more than 128 levels"), (5000, "nested too deeply")])
def test_a_schema_sent_as_json_text_is_checked_as_one_sent_as_an_object(levels, words):
    """`guided_json` as a string skipped the body's depth limit: 900 levels compiled for seconds, 5000 were a 500
    (RecursionError; hunt 210). It is decoded and checked as the body is."""
    schema = '{"type": "array", "items": ' * levels + '{"type": "string"}' + "}" * levels
    request = parse_request(CompletionRequest, {"prompt": "hi", "guided_json": schema})
    with pytest.raises(APIError) as refused:
        request.guided()
    assert refused.value.status == 400 and refused.value.param == "guided_json" and words in refused.value.message


def test_tool_call_arguments_nested_past_the_parser_stay_text():
    from hybridcache.mm_processor import template_arguments

    deep = '{"a": ' * 5000 + "1" + "}" * 5000
    assert template_arguments(deep) == deep  # (a RecursionError before: a 500 from the chat route)
    assert template_arguments('{"a": 1}') == {"a": 1}
