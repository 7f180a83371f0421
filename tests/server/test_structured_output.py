"""Structured output through the server: a request's grammar compiles on a worker thread, not on the engine thread
(a slow schema stalled every other stream); the schema's property order is kept; an emoji choice is its UTF-8;
a Lark grammar is read; a schema keyword xgrammar would not enforce is compiled with llguidance (pydantic's
`HttpUrl`, `constr(min_length=..., pattern=...)`...), or a 400 naming it where llguidance refuses it too."""

from __future__ import annotations

import importlib.util
import json
import re
import threading
import time
from typing import Annotated

import httpx
import jsonschema
import pytest
from pydantic import UUID4, AnyUrl, BaseModel, Field, HttpUrl, IPvAnyAddress, SecretStr, StringConstraints

from hybridcache import guided
from hybridcache.models.builtin import BUILTIN_NAME, ensure_builtin_model
from hybridcache.tokenizer import Tokenizer
from tests.engine import needs_xgrammar

from .inprocess_server import serving

pytestmark = needs_xgrammar
needs_llguidance = pytest.mark.skipif(importlib.util.find_spec("llguidance") is None,
                                      reason="needs llguidance (guided)")

SLOW = {"enum": ["slow to compile"]}


class _Compiles:
    """Wraps `guided._grammar` (what every compile calls): records the thread of each compile; the `SLOW` schema
    takes `slow_s` more."""

    def __init__(self, slow_s: float) -> None:
        self.threads: list[str] = []
        self.slow_window: tuple[float, float] | None = None
        self._slow_s = slow_s
        self._build = guided._grammar

    def __call__(self, xgr, spec):
        self.threads.append(threading.current_thread().name)
        if spec.spec == json.dumps(SLOW):
            start = time.monotonic()
            time.sleep(self._slow_s)
            self.slow_window = (start, time.monotonic())
        return self._build(xgr, spec)


@pytest.fixture(scope="module")
def compiles():
    with pytest.MonkeyPatch.context() as patch:
        recorder = _Compiles(slow_s=1.5)
        patch.setattr(guided, "_grammar", recorder)
        yield recorder


@pytest.fixture(scope="module")
def client(compiles):
    with serving() as base_url, httpx.Client(base_url=base_url, timeout=120) as http:
        yield http


def _chat(client: httpx.Client, **fields) -> httpx.Response:
    return client.post("/v1/chat/completions", json={"model": BUILTIN_NAME, "max_tokens": 40, "temperature": 0,
                                                     "messages": [{"role": "user", "content": "hi"}], **fields})


def test_a_slow_grammar_compiles_off_the_engine_thread_while_other_streams_go_on(client, compiles):
    """The grammar was compiled inside `LLMEngine.add_request` on the engine thread: a schema that took seconds
    froze every other stream meanwhile. Now the handler compiles it on a worker thread first; the engine thread
    finds it compiled."""
    stamps: list[float] = []
    started = threading.Event()
    stop = threading.Event()

    def stream() -> None:
        body = {"model": BUILTIN_NAME, "prompt": "hello", "max_tokens": 2000, "ignore_eos": True, "temperature": 0,
                "stream": True}
        with client.stream("POST", "/v1/completions", json=body) as response:
            for line in response.iter_lines():
                if line.startswith("data:"):
                    stamps.append(time.monotonic())
                    if len(stamps) == 3:
                        started.set()
                if stop.is_set():
                    return

    streamer = threading.Thread(target=stream)
    streamer.start()
    try:
        assert started.wait(60)
        compiles.threads.clear()
        response = client.post("/v1/completions", json={"model": BUILTIN_NAME, "prompt": "x", "max_tokens": 40,
                                                        "temperature": 0, "guided_json": SLOW})
    finally:
        stop.set()
        streamer.join(60)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == '"slow to compile"'
    assert compiles.threads and "hybridcache-engine" not in compiles.threads  # compiled once, not on the engine
    start, end = compiles.slow_window
    assert sum(start < stamp < end for stamp in stamps) >= 3  # the other stream went on meanwhile


def test_a_bad_grammar_is_still_a_400_naming_its_field(client):
    response = client.post("/v1/completions", json={"model": BUILTIN_NAME, "prompt": "x", "max_tokens": 4,
                                                    "guided_regex": "(unclosed"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "guided_regex"
    response = _chat(client, structured_outputs={"grammar": "root ::= x\nx ::= x"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "structured_outputs.grammar"
    assert "no first token" in response.json()["error"]["message"]


@pytest.mark.parametrize("fields, param", [
    pytest.param({"guided_json": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}}, "guided_json",
                 id="guided_json"),
    pytest.param({"response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": {
        "type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}}}}, "response_format",
        id="response_format"),
    pytest.param({"tools": [{"type": "function", "function": {"name": "tag", "parameters": {
        "type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}}}],
        "tool_choice": "required"}, "tool_choice", id="tool_choice"),
])
def test_a_schema_keyword_xgrammar_would_not_enforce_is_a_400_naming_it(client, fields, param):
    response = _chat(client, **fields)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert "uniqueItems" in error["message"] and "not supported" in error["message"]


def test_the_schema_property_order_an_emoji_choice_and_a_lark_grammar(client):
    schema = {"type": "object", "properties": {"reasoning": {"enum": ["short"]}, "answer": {"enum": [1, 2]}},
              "required": ["reasoning", "answer"], "additionalProperties": False}
    response = _chat(client, response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": schema}})
    content = response.json()["choices"][0]["message"]["content"]
    assert list(json.loads(content)) == ["reasoning", "answer"]  # (was alphabetical: answer first)
    for fields, allowed in (({"guided_choice": ["👍", "👎"]}, {"👍", "👎"}),
                            ({"structured_outputs": {"grammar": 'start: "yes" | "no"'}}, {"yes", "no"})):
        response = _chat(client, **fields)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        assert (choice["message"]["content"] in allowed, choice["finish_reason"]) == (True, "stop"), choice


@pytest.mark.parametrize("options", [{"disable_any_whitespace": True}, {"disable_any_whitespace": False},
                                     {"backend": "xgrammar", "disable_fallback": True}])
def test_vllm_options_that_hold_here_are_taken(client, options):
    """vLLM clients send `structured_outputs: {"json": ..., "disable_any_whitespace": true}` for JSON without free
    whitespace (what this server's JSON grammars always write, as `json.dumps` spaces it) or name the xgrammar
    backend: the request runs, constrained."""
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    response = _chat(client, structured_outputs={"json": schema, **options})
    assert response.status_code == 200, response.text
    text = response.json()["choices"][0]["message"]["content"]
    if response.json()["choices"][0]["finish_reason"] == "stop":
        assert isinstance(json.loads(text)["n"], int) and text == json.dumps(json.loads(text))
    else:
        assert text.startswith('{"n":')


@pytest.mark.parametrize("options, param", [
    ({"backend": "outlines"}, "structured_outputs.backend"),
    ({"disable_any_whitespace": "yes"}, "structured_outputs.disable_any_whitespace"),
    ({"whitespace_pattern": r"[ ]?"}, "structured_outputs.whitespace_pattern"),
])
def test_vllm_options_that_do_not_hold_here_are_400s_naming_them(client, options, param):
    response = _chat(client, structured_outputs={"regex": "[ab]+", **options})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


@needs_llguidance
@pytest.mark.parametrize("schema, keyword", [
    pytest.param({"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                  "oneOf": [{"required": ["x"]}, {"required": ["y"]}]}, "properties next to oneOf (at the root)",
                 id="oneOf-beside-properties"),
    pytest.param({"type": "object", "properties": {"q": {"type": "integer", "not": {"const": 3}}}},
                 "not (at /properties/q)", id="not"),
])
def test_a_schema_shape_xgrammar_loosens_is_a_400_naming_it(client, schema, keyword):
    """Hunt 166, bugs 1 and 2: such schemas were taken and "stop" outputs broke them (`null` for the oneOf, 3 for
    the `not`). llguidance, the fallback, refuses them too (as vLLM's guidance backend does)."""
    response = _chat(client, response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": schema}})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "response_format" and keyword in error["message"] and "not supported" in error["message"]
    assert "llguidance refuses the schema" in error["message"]


# --------------------------------------------------------------- pydantic field types (hunt 202): llguidance serves
Word = Annotated[str, StringConstraints(min_length=2, max_length=4, pattern=r"^[a-z]+$")]


class Served(BaseModel):
    word: Word
    half: Annotated[float, Field(multiple_of=0.5, ge=0, le=10)]
    url: HttpUrl
    home: AnyUrl


_URI = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*:[^\s]*")  # (HttpUrl's http(s) is not in its schema: pydantic's own check)


def _quote_bias() -> dict[str, float]:
    """Push the model to close every string at once (an empty URL, a word of no letters): the grammar holds. (`:`
    next: a URL's scheme ends there, and the quote may follow.)"""
    tokenizer = Tokenizer(ensure_builtin_model())
    (quote,), (colon,) = tokenizer.encode('"'), tokenizer.encode(":")
    return {str(quote): 60.0, str(colon): 30.0}


def _check_served(text: str) -> None:
    fields = json.loads(text)
    jsonschema.validate(fields, Served.model_json_schema())
    for key in ("url", "home"):
        url = fields.pop(key)
        assert _URI.fullmatch(url) and len(url) >= 1 and (key != "url" or len(url) <= 2083), url
    word = fields["word"]
    assert 2 <= len(word) <= 4 and word.isalpha() and fields["half"] % 0.5 == 0


@needs_llguidance
def test_pydantic_types_vllm_serves_are_served_through_response_format(client):
    """`HttpUrl`, `AnyUrl` (`format: uri` with `minLength`), `constr(min_length, max_length, pattern)`,
    `confloat(multiple_of=0.5)` were a 400 from every client library's structured output; vLLM serves them (its
    guidance fallback), and so does this server: the output keeps to the whole schema."""
    response = _chat(client, max_tokens=200, logit_bias=_quote_bias(), response_format={
        "type": "json_schema", "json_schema": {"name": "Served", "schema": Served.model_json_schema()}})
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    _check_served(choice["message"]["content"])


@needs_llguidance
@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "save"}}])
def test_pydantic_types_vllm_serves_are_served_in_a_forced_tool_call(client, tool_choice):
    """pydantic-ai forces `tool_choice: required` over all tools: one tool taking an `HttpUrl` made every run
    a 400. Now the call is made, its arguments valid for the tool's schema."""
    tools = [{"type": "function", "function": {"name": "save", "parameters": Served.model_json_schema()}},
             {"type": "function", "function": {"name": "fetch_page", "parameters": {
                 "type": "object", "properties": {"url": {"type": "string", "format": "uri", "minLength": 1,
                                                          "maxLength": 2083}}, "required": ["url"]}}}]
    response = _chat(client, max_tokens=200, logit_bias=_quote_bias(), tools=tools, tool_choice=tool_choice)
    assert response.status_code == 200, response.text
    calls = response.json()["choices"][0]["message"]["tool_calls"]
    assert calls, response.json()
    for call in calls:
        arguments = call["function"]["arguments"]
        if call["function"]["name"] == "save":
            _check_served(arguments)
        else:
            assert call["function"]["name"] == "fetch_page" and _URI.fullmatch(json.loads(arguments)["url"])


@needs_llguidance
@pytest.mark.parametrize("annotation, reason", [
    pytest.param(UUID4, "Unknown format: uuid4", id="UUID4"),
    pytest.param(bytes, "Unknown format: binary", id="bytes"),
    pytest.param(SecretStr, "Unknown format: password", id="SecretStr"),
    pytest.param(IPvAnyAddress, "Unknown format: ipvanyaddress", id="IPvAnyAddress"),
    pytest.param(set[str], "uniqueItems", id="set"),
])
@pytest.mark.parametrize("mode", ["response_format", "tool_choice"])
def test_pydantic_types_vllm_refuses_are_a_400_naming_the_keyword(client, annotation, reason, mode):
    """vLLM refuses these too (its guidance fallback: llguidance does not know the format, or does not implement
    `uniqueItems`): a 400 naming the keyword and llguidance's reason."""
    schema = type("S", (BaseModel,), {"__annotations__": {"x": annotation}}).model_json_schema()
    fields = ({"response_format": {"type": "json_schema", "json_schema": {"name": "S", "schema": schema}}}
              if mode == "response_format" else
              {"tools": [{"type": "function", "function": {"name": "f", "parameters": schema}}],
               "tool_choice": "required"})
    response = _chat(client, **fields)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == mode and "not supported" in error["message"] and reason in error["message"], error
