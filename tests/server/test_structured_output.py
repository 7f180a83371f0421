"""Structured output through the server: a request's grammar compiles on a worker thread, not on the engine thread
(a slow schema stalled every other stream); the schema's property order is kept; an emoji choice is its UTF-8;
a Lark grammar is read; a schema keyword xgrammar would not enforce is a 400 naming it."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from hybridcache import guided
from hybridcache.models.builtin import BUILTIN_NAME
from tests.engine import needs_xgrammar

from .inprocess_server import serving

pytestmark = needs_xgrammar

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


@pytest.mark.parametrize("schema, keyword", [
    pytest.param({"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                  "anyOf": [{"required": ["x"]}, {"required": ["y"]}]}, "properties next to anyOf (at the root)",
                 id="anyOf-beside-properties"),
    pytest.param({"type": "object", "properties": {"q": {"type": "string", "pattern": '^say "hi"$'}}},
                 "pattern '^say \"hi\"$' (it can match a \"", id="pattern-with-a-quote"),
])
def test_a_schema_shape_xgrammar_loosens_is_a_400_naming_it(client, schema, keyword):
    """Hunt 166, bugs 1 and 2: such schemas were taken and "stop" outputs broke them (`[]` for the anyOf, invalid
    JSON for the quote)."""
    response = _chat(client, response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": schema}})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "response_format" and keyword in error["message"] and "not supported" in error["message"]
