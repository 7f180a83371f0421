"""The grammar of a forced call in the Python-call formats (`guided_python`, `--tool-call-parser` lfm2, olmo3,
pythonic): which texts it takes, token by token on the built-in tokenizer (and that what it takes, the server's
parser reads back as calls whose JSON arguments the schema validates), the text it writes (`python_values`,
`python_rules`), and the schemas it refuses with a reason."""

from __future__ import annotations

import dataclasses
import json

import jsonschema
import pytest

from hybridcache.guided import GrammarCache, GuidedSpec
from hybridcache.guided_python import PYTHON_FORMATS, arguments_of, python_literal, python_rules, python_values
from hybridcache.models.builtin import ensure_builtin_model
from hybridcache.server.structured import tool_choice_spec
from hybridcache.server.tool_parsers import parse_tool_calls
from hybridcache.tokenizer import Tokenizer
from tests.engine import needs_xgrammar, test_guided_tool_calls
from tests.engine.test_guided_tool_calls import accepts

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "flag": {"type": ["boolean", "null"]}, "tags": {"type": "array", "items": {"type": "string"}},
        "o": {"enum": [{"a": True}, None]}, "code": {"type": "string", "pattern": "^t[a-z]+$"},
        "where": {"$ref": "#/$defs/Place"}},
    "required": ["city"],
    "$defs": {"Place": {"type": "object", "properties": {"lat": {"type": "number"}}, "required": ["lat"]}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}

# (a call, whether the grammar takes it)
CALLS = [
    ('get_weather(city="Paris")', True),
    ('get_weather(city="Pa\\"ris", days=3, flag=True, tags=["a", "b"], o={"a": True})', True),
    ('get_weather(city="P", flag=None, o=None, code="true", where={"lat": -1.5e3})', True),
    ('get_weather(city="\\u00e9\\n")', True),
    ("get_time()", True),
    ('get_weather(city="P", flag=true)', False),  # (JSON's constants are no Python)
    ('get_weather(city="P", o={"a": true})', False),
    ("get_weather(city='P')", False),  # (strings in JSON's quotes, as a schema's grammar writes them)
    ("get_weather(days=2)", False),  # (city is required)
    ('get_weather(days=2, city="P")', False),  # (the schema's order)
    ('get_weather(city="P", days=15)', False),  # (maximum)
    ('get_weather(city="P", code="yes")', False),  # (pattern)
    ('get_weather(city="P", where={})', False),  # (required inside a $ref)
    ('get_weather(city="P",days=2)', False),
    ('get_weather(city="a\\/b")', False),  # (Python reads \/ as two characters)
    ('get_weather(city="\\ud83d\\ude00")', False),  # (Python reads a surrogate pair as two lone surrogates)
    ("get_time(x=1)", False),
    ("get_weather()", False),
]

cache_and_tokenizer = test_guided_tool_calls.cache_and_tokenizer  # the fixture, shared


def _written(tool_format: str, *calls: str) -> str:
    opening, separator, closing = PYTHON_FORMATS[tool_format]
    return opening + separator.join(calls) + closing


@needs_xgrammar
@pytest.mark.parametrize("tool_format", list(PYTHON_FORMATS))
def test_the_grammar_takes_python_calls_valid_for_the_schema_and_the_parser_reads_them_back(cache_and_tokenizer,
                                                                                              tool_format):
    spec = GuidedSpec.tool_calls(TOOLS, parallel=False, tool_format=tool_format)
    for call, taken in CALLS:
        text = _written(tool_format, call)
        assert accepts(cache_and_tokenizer, spec, text) is taken, text
        if taken:
            parsed = parse_tool_calls(text, TOOLS, tool_format)
            assert parsed.content == "" and len(parsed.tool_calls) == 1, text
            jsonschema.validate(json.loads(parsed.tool_calls[0].arguments), SCHEMAS[parsed.tool_calls[0].name])


@needs_xgrammar
@pytest.mark.parametrize("parallel", [True, False])
@pytest.mark.parametrize("tool_format", list(PYTHON_FORMATS))
def test_several_calls_only_with_parallel_calls_in_the_formats_wrapper(cache_and_tokenizer, tool_format, parallel):
    spec = GuidedSpec.tool_calls(TOOLS, parallel=parallel, tool_format=tool_format)
    one, two = 'get_weather(city="Paris")', "get_time()"
    assert accepts(cache_and_tokenizer, spec, _written(tool_format, one, two)) is parallel
    assert accepts(cache_and_tokenizer, spec, _written(tool_format, one, two, one)) is parallel
    assert not accepts(cache_and_tokenizer, spec, _written(tool_format))
    assert not accepts(cache_and_tokenizer, spec, one)  # (the wrapper is the format's)
    for other in PYTHON_FORMATS:
        if PYTHON_FORMATS[other][0] != PYTHON_FORMATS[tool_format][0]:
            assert not accepts(cache_and_tokenizer, spec, _written(other, one))
    assert not accepts(cache_and_tokenizer, spec, _written(tool_format, one) + "\n")
    parsed = parse_tool_calls(_written(tool_format, one, two), TOOLS, tool_format)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [("get_weather", {"city": "Paris"}),
                                                                             ("get_time", {})]


@needs_xgrammar
def test_a_named_function_is_that_functions_call_only(cache_and_tokenizer):
    named = {"type": "function", "function": {"name": "get_time"}}
    spec = tool_choice_spec(TOOLS, named, parallel_tool_calls=True)
    spec = GuidedSpec.tool_calls(json.loads(spec.spec), parallel=spec.parallel, tool_format="lfm2")
    assert accepts(cache_and_tokenizer, spec, _written("lfm2", "get_time()"))
    assert not accepts(cache_and_tokenizer, spec, _written("lfm2", 'get_weather(city="P")'))
    assert not accepts(cache_and_tokenizer, spec, _written("lfm2", "get_time()", "get_time()"))


@needs_xgrammar
@pytest.mark.parametrize("tool_format", list(PYTHON_FORMATS))
def test_behind_the_reasoning_gate_the_reasoning_is_free_and_the_call_forced_after_it(cache_and_tokenizer,
                                                                                      tool_format):
    """A prompt that opens a think block gates the grammar at `</think>` (`GuidedSpec.starts_after`): any reasoning,
    then the call in the format; a reasoning that is never closed is never done."""
    spec = dataclasses.replace(GuidedSpec.tool_calls(TOOLS, tool_format=tool_format), starts_after="</think>")
    call = _written(tool_format, "get_time()")
    assert accepts(cache_and_tokenizer, spec, "plan: call get_time(x=1) <tool_call>\n</think>" + call)
    assert not accepts(cache_and_tokenizer, spec, "plan\n</think>get_time(x=1)")
    assert not accepts(cache_and_tokenizer, spec, "plan\n</think>" + _written(tool_format, "get_time(x=1)"))
    assert not accepts(cache_and_tokenizer, spec, "plan " + call)  # (the grammar never started)
    assert accepts(cache_and_tokenizer, spec, "plan\n</think>\n\n" + call)  # (the blank line templates write)
    assert not accepts(cache_and_tokenizer, spec, "plan\n</think>\n\n\n\n\n" + call)  # (at most LEAD_SPACE)


@needs_xgrammar
def test_lfm2s_tags_may_be_their_special_tokens(tmp_path):
    """LFM2's tokenizer has `<|tool_call_start|>` and `<|tool_call_end|>` as special tokens: the grammar takes each
    as its one token, the one the model was taught to write."""
    from transformers import AutoTokenizer

    tags = ["<|tool_call_start|>", "<|tool_call_end|>"]
    hf = AutoTokenizer.from_pretrained(ensure_builtin_model())
    hf.add_special_tokens({"additional_special_tokens": tags})
    hf.save_pretrained(tmp_path)
    tokenizer = Tokenizer(tmp_path)
    cache = GrammarCache(tokenizer.hf, tokenizer.vocab_size, [tokenizer.eos_token_id])
    token_ids = tokenizer.encode(_written("lfm2", 'get_weather(city="Paris")'))
    assert set(tokenizer.hf.convert_tokens_to_ids(tags)) <= set(token_ids)
    matcher = cache.matcher(GuidedSpec.tool_calls(TOOLS, tool_format="lfm2"))
    assert all(matcher.accept_token(t) for t in token_ids) and matcher.accept_token(tokenizer.eos_token_id)


def test_json_values_are_written_as_python_literals():
    assert python_literal({"a": [True, False, None, 1, 2.5, "x\"y"]}) == '{"a": [True, False, None, 1, 2.5, "x\\"y"]}'
    grammar = "\n".join([
        'basic_escape ::= (([\\"\\\\/bfnrt]) | ("u" [A-Fa-f0-9] [A-Fa-f0-9] [A-Fa-f0-9] [A-Fa-f0-9]))',
        'basic_string_sub ::= (("\\"") | ([^\\0-\\x1f\\"\\\\\\r\\n] basic_string_sub) | ("\\\\" basic_escape '
        'basic_string_sub)) (=([ \\n\\r\\t]* [,}\\]:]))',
        'basic_boolean ::= (("true") | ("false"))',
        'basic_null ::= (("null"))',
        'root ::= (("[1,true]") | ("{\\"k\\":null}") | ("\\"true\\"") | ("{" "\\"true\\"" ": " basic_null "}"))',
        'root_1 ::= Regex("^(true|null)$", json_string=true)',
    ])
    lines = python_values(grammar).splitlines()
    assert lines[0] == ('basic_escape ::= (([\\"\\\\bfnrt]) | ("u" [0-9A-Ca-cE-Fe-f] [A-Fa-f0-9] [A-Fa-f0-9] '
                        '[A-Fa-f0-9]) | ("u" [Dd] [0-7] [A-Fa-f0-9] [A-Fa-f0-9]))')
    assert lines[1].endswith("(=([ \\n\\r\\t]* [,}\\]:)]))")  # (a string may end before a call's `)`)
    assert lines[2:] == [
        'basic_boolean ::= (("True") | ("False"))',
        'basic_null ::= (("None"))',
        'root ::= (("[1, True]") | ("{\\"k\\": None}") | ("\\"true\\"") | ("{" "\\"true\\"" ": " basic_null "}"))',
        'root_1 ::= Regex("^(true|null)$", json_string=true)',  # (a string's regex: left alone)
    ]


def test_a_json_constant_left_inside_a_piece_is_an_error_not_a_wrong_grammar():
    with pytest.raises(RuntimeError, match="cannot write"):
        python_values('root ::= (("[1,true" "]"))')
    with pytest.raises(RuntimeError, match="lookahead"):
        python_values('root ::= (("a") (=("b")))')


def test_the_call_rules_write_required_and_optional_keywords_in_order():
    root, rules = python_rules([("f", [("a", "va"), ("b", "vb")], {"b"}), ("g", [], set())], True, "olmo3",
                               prefix="py0")
    assert root == "py0_calls"
    assert rules == [
        'py0_0_first_2 ::= ""', 'py0_0_rest_2 ::= ""',
        'py0_0_first_1 ::= "b=" vb py0_0_rest_2', 'py0_0_rest_1 ::= ", b=" vb py0_0_rest_2',
        'py0_0_first_0 ::= "a=" va py0_0_rest_1 | py0_0_first_1', 'py0_0_rest_0 ::= ", a=" va py0_0_rest_1 | '
        "py0_0_rest_1",
        'py0_call_0 ::= "f(" py0_0_first_0 ")"',
        'py0_1_first_0 ::= ""', 'py0_1_rest_0 ::= ""', 'py0_call_1 ::= "g(" py0_1_first_0 ")"',
        "py0_call ::= py0_call_0 | py0_call_1",
        'py0_calls ::= "<function_calls>" py0_call ("\\n" py0_call)* "</function_calls>"',
    ]


@pytest.mark.parametrize(("name", "parameters", "problem"), [
    ("get-time", {"type": "object"}, "the tool name 'get-time' cannot be forced"),
    ("f", {"type": "object", "properties": {"from": {}}}, "the argument of 'f' 'from' cannot be forced"),
    ("f", {"type": "object", "properties": {"a b": {}}}, "'a b' cannot be forced"),
    ("f", {"type": "object", "properties": {"a": {}}, "minProperties": 1}, "keyword 'minProperties'"),
    ("f", {"anyOf": [{"type": "object"}]}, "keyword 'anyOf'"),
    ("f", {"type": "array"}, "not an object schema"),
    ("f", {"type": "object", "properties": {"a": {}}, "required": ["b"]}, "requires 'b'"),
    ("f", {"type": "object", "properties": {"a": False}}, "allows no value"),
])
def test_what_a_python_call_cannot_carry_is_refused_by_name(name, parameters, problem):
    with pytest.raises(ValueError, match=problem.replace("(", r"\(")):
        arguments_of(name, parameters)


@needs_xgrammar
def test_a_keyword_only_llguidance_enforces_is_refused_in_the_python_formats(cache_and_tokenizer):
    """`multipleOf` goes to the llguidance fallback for the JSON formats; llguidance writes JSON values only, so a
    Python call cannot be forced with it: a ValueError naming the keyword, not an unenforced grammar."""
    cache, _ = cache_and_tokenizer
    step = {"type": "function", "function": {"name": "step", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "multipleOf": 5}}, "required": ["n"]}}}
    with pytest.raises(ValueError, match=r"multipleOf \(at \S+\) is not supported in a forced call of the Python-call"):
        cache.check(GuidedSpec.tool_calls([step], tool_format="pythonic"))
    with pytest.raises(ValueError, match="'get-time' cannot be forced in the Python-call format"):
        cache.check(GuidedSpec.tool_calls([{"name": "get-time"}], tool_format="lfm2"))
