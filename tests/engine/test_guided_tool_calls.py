"""tool_choice "required" with parallel_tool_calls: one or more calls (hunt 162), as OpenAI ("one or more tools") and
vLLM ("one or more tool calls") define it; exactly one without parallel calls, and for a named function."""

from __future__ import annotations

import dataclasses
import json

import pytest

from hybridcache import guided_kimi
from hybridcache.guided import LEAD_SPACE, GrammarCache, GuidedKind, GuidedSpec
from hybridcache.models.builtin import ensure_builtin_model
from hybridcache.server.structured import tool_choice_spec
from hybridcache.tokenizer import Tokenizer
from tests.engine import needs_xgrammar

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


def _call(name: str, arguments: dict) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


ONE = _call("get_weather", {"city": "Paris"})
TWO = ONE + "\n" + _call("get_time", {})
THREE = TWO + "\n" + _call("get_weather", {"city": "Rome"})


@pytest.fixture(scope="module")
def cache_and_tokenizer() -> tuple[GrammarCache, Tokenizer]:
    tokenizer = Tokenizer(ensure_builtin_model())
    return GrammarCache(tokenizer.hf, tokenizer.vocab_size, [tokenizer.eos_token_id]), tokenizer


def accepts(cache_and_tokenizer: tuple[GrammarCache, Tokenizer], spec: GuidedSpec, text: str) -> bool:
    """Whether `spec`'s grammar takes exactly `text` (its tokens, then EOS)."""
    cache, tokenizer = cache_and_tokenizer
    matcher = cache.matcher(spec)
    return all(matcher.accept_token(t) for t in tokenizer.encode(text)) and matcher.accept_token(
        tokenizer.eos_token_id) and matcher.is_terminated()


@needs_xgrammar
@pytest.mark.parametrize("parallel", [True, False])
def test_required_allows_several_calls_only_with_parallel_tool_calls(cache_and_tokenizer, parallel):
    """The grammar of "required" was one block whatever `parallel_tool_calls` said: a second call was never
    allowed. With parallel calls it is one or more blocks, a newline between two (as Qwen's templates write
    them); without, exactly one."""
    spec = tool_choice_spec([WEATHER, TIME], "required", parallel_tool_calls=parallel)
    assert accepts(cache_and_tokenizer, spec, ONE)
    assert accepts(cache_and_tokenizer, spec, TWO) is parallel
    assert accepts(cache_and_tokenizer, spec, THREE) is parallel
    assert not accepts(cache_and_tokenizer, spec, "")
    assert not accepts(cache_and_tokenizer, spec, ONE + ONE)  # (no newline between)
    assert not accepts(cache_and_tokenizer, spec, ONE + "\n")


@needs_xgrammar
def test_a_named_function_is_one_call_and_parallel_is_part_of_the_spec(cache_and_tokenizer):
    """A named tool_choice forces one call of that tool, parallel calls or not. The one-or-more grammar and the
    one-call grammar are distinct specs (cached apart), also once a reasoning marker starts them."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    spec = tool_choice_spec([WEATHER, TIME], named, parallel_tool_calls=True)
    assert accepts(cache_and_tokenizer, spec, ONE)
    assert not accepts(cache_and_tokenizer, spec, ONE + "\n" + ONE)
    several = GuidedSpec.tool_calls([WEATHER], parallel=True)
    one = GuidedSpec.tool_calls([WEATHER])
    assert several != one and hash(several) != hash(one)
    assert accepts(cache_and_tokenizer, several, ONE + "\n" + ONE)
    assert not accepts(cache_and_tokenizer, one, ONE + "\n" + ONE)
    cache, _ = cache_and_tokenizer
    gated = dataclasses.replace(several, starts_after="</think>")  # (its grammar takes a blank run first)
    assert cache._compile(gated) is not cache._compile(several) is not cache._compile(one)
    assert cache._compile(gated) is cache._compile(dataclasses.replace(several, starts_after="</think>"))


@pytest.mark.parametrize("parallel", [True, False, None])
def test_a_chat_request_passes_parallel_tool_calls_to_required(parallel):
    """The request's `parallel_tool_calls` (default true, as OpenAI's) reaches the "required" grammar; a named
    function is one call either way."""
    from hybridcache.server.protocol import ChatCompletionRequest, parse_request

    fields = {} if parallel is None else {"parallel_tool_calls": parallel}
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER, TIME], **fields}
    required = parse_request(ChatCompletionRequest, {**body, "tool_choice": "required"}).guided()
    assert required.parallel is (parallel is not False)
    named = {"type": "function", "function": {"name": "get_time"}}
    assert parse_request(ChatCompletionRequest, {**body, "tool_choice": named}).guided().parallel is False


LIST_FORMATS = {"nemotron": ("<TOOLCALL>", "</TOOLCALL>"), "jamba": ("<tool_calls>", "</tool_calls>")}


def _listed(tool_format: str, *calls: tuple[str, dict]) -> str:
    """NVIDIA's format (one `<TOOLCALL>` list) or AI21's (one `<tool_calls>` list), `json.dumps`'s ", " between two
    calls."""
    opening, closing = LIST_FORMATS[tool_format]
    return opening + json.dumps([{"name": name, "arguments": arguments} for name, arguments in calls]) + closing


# `multipleOf` is compiled by the llguidance fallback, the other tools by xgrammar: both write the same formats
STEP = {"type": "function", "function": {"name": "step", "parameters": {
    "type": "object", "properties": {"n": {"type": "integer", "multipleOf": 5}}, "required": ["n"]}}}
BACKENDS = {"xgrammar": ([WEATHER, TIME], ("get_weather", {"city": "Paris"}), ("get_time", {})),
            "llguidance": ([STEP], ("step", {"n": 10}), ("step", {"n": 25}))}


@needs_xgrammar
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("parallel", [True, False])
@pytest.mark.parametrize("tool_format", list(LIST_FORMATS))
def test_the_list_formats_force_one_list_of_calls(cache_and_tokenizer, backend, parallel, tool_format):
    """With `--tool-call-parser nemotron_json` (or jamba) a forced call is written as Nemotron-Nano-9B-v2 (or AI21's
    Jamba) writes calls (one `<TOOLCALL>` (`<tool_calls>`) list, ", " between two calls), not in Qwen3's blocks;
    "required" with parallel calls lets the list hold several, otherwise one. Through xgrammar and through the
    llguidance fallback alike."""
    if backend == "llguidance":
        pytest.importorskip("llguidance")
    tools, first, second = BACKENDS[backend]
    spec = GuidedSpec.tool_calls(tools, parallel=parallel, tool_format=tool_format)
    assert spec != GuidedSpec.tool_calls(tools, parallel=parallel)  # (cached apart from the Qwen grammar)
    assert accepts(cache_and_tokenizer, spec, _listed(tool_format, first))
    assert accepts(cache_and_tokenizer, spec, _listed(tool_format, first, second)) is parallel
    qwen = "<tool_call>\n" + json.dumps({"name": first[0], "arguments": first[1]}) + "\n</tool_call>"
    assert not accepts(cache_and_tokenizer, spec, qwen)
    other = next(name for name in LIST_FORMATS if name != tool_format)
    assert not accepts(cache_and_tokenizer, spec, _listed(other, first))
    assert not accepts(cache_and_tokenizer, spec, "".join(LIST_FORMATS[tool_format]).replace("><", ">[]<"))
    assert not accepts(cache_and_tokenizer, spec, _listed(tool_format, first) + "\n")
    if backend == "llguidance":  # (the schema is enforced inside the list too)
        assert not accepts(cache_and_tokenizer, spec, _listed(tool_format, ("step", {"n": 7})))


def test_an_unknown_tool_format_is_refused():
    with pytest.raises(ValueError, match="unknown tool-call format 'hermes'; known: qwen, nemotron, jamba, kimi"):
        GuidedSpec.tool_calls([WEATHER], tool_format="hermes")


def _section(*calls: tuple[str, dict], first_index: int = 0) -> str:
    """Kimi's section as its chat template writes calls back: no white space, ids counting from `first_index`."""
    return "<|tool_calls_section_begin|>" + "".join(
        f"<|tool_call_begin|>functions.{name}:{i}<|tool_call_argument_begin|>{json.dumps(arguments)}"
        "<|tool_call_end|>" for i, (name, arguments) in enumerate(calls, first_index)) + "<|tool_calls_section_end|>"


@needs_xgrammar
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("parallel", [True, False])
def test_kimis_format_forces_one_section_of_numbered_calls(cache_and_tokenizer, backend, parallel):
    """With `--tool-call-parser kimi_k2` a forced call is Kimi's section: each call's id `functions.NAME:IDX`, IDX
    counting the calls from 0, then the arguments alone (valid for that function's schema, not another's); with
    parallel calls up to `guided_kimi.MAX_CALLS` of them, otherwise one. Through xgrammar and llguidance alike."""
    if backend == "llguidance":
        pytest.importorskip("llguidance")
    tools, first, second = BACKENDS[backend]
    spec = GuidedSpec.tool_calls(tools, parallel=parallel, tool_format="kimi")
    assert accepts(cache_and_tokenizer, spec, _section(first))
    assert accepts(cache_and_tokenizer, spec, _section(first, second)) is parallel
    assert accepts(cache_and_tokenizer, spec, _section(*[first] * guided_kimi.MAX_CALLS)) is parallel
    assert not accepts(cache_and_tokenizer, spec, _section(*[first] * (guided_kimi.MAX_CALLS + 1)))
    assert not accepts(cache_and_tokenizer, spec, _section(first, first_index=1))  # (ids count from 0)
    assert not accepts(cache_and_tokenizer, spec, _section(first, second).replace(":1<", ":0<"))
    assert not accepts(cache_and_tokenizer, spec, _section(first).replace("><", ">\n<"))  # (no white space)
    assert not accepts(cache_and_tokenizer, spec, _section(first).replace("functions.", ""))
    assert not accepts(cache_and_tokenizer, spec, _section(first) + "\n")
    assert not accepts(cache_and_tokenizer, spec, "<tool_call>\n" + json.dumps(
        {"name": first[0], "arguments": first[1]}) + "\n</tool_call>")
    assert not accepts(cache_and_tokenizer, spec, _section((first[0], {"name": first[0], "arguments": first[1]})))
    if backend == "xgrammar":  # (a function's arguments are checked against its own schema)
        assert not accepts(cache_and_tokenizer, spec, _section(("get_time", {"city": "Paris"})))
        assert not accepts(cache_and_tokenizer, spec, _section(("get_weather", {})))
    else:
        assert not accepts(cache_and_tokenizer, spec, _section(("step", {"n": 7})))


@needs_xgrammar
@pytest.mark.parametrize("backend", BACKENDS)
def test_kimis_section_reads_back_as_the_calls_it_forces(cache_and_tokenizer, backend):
    """What the grammar takes is what `--tool-call-parser kimi_k2` reads back: the calls, with the ids as written."""
    from hybridcache.server.tool_parsers import parse_tool_calls

    if backend == "llguidance":
        pytest.importorskip("llguidance")
    tools, first, second = BACKENDS[backend]
    text = _section(first, second)
    assert accepts(cache_and_tokenizer, GuidedSpec.tool_calls(tools, parallel=True, tool_format="kimi"), text)
    parsed = parse_tool_calls(text, tools, "kimi_k2")
    assert [(c.id, c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [
        (f"functions.{first[0]}:0", *first), (f"functions.{second[0]}:1", *second)]


@needs_xgrammar
def test_a_tool_name_kimis_ids_cannot_carry_is_refused(cache_and_tokenizer):
    """`functions.a.b:0` reads back as the call of `b`: such a name cannot be forced in Kimi's format."""
    cache, _ = cache_and_tokenizer
    dotted = {"type": "function", "function": {"name": "search.web", "parameters": {"type": "object"}}}
    with pytest.raises(ValueError, match="'search.web' cannot be forced in Kimi's format"):
        cache.check(GuidedSpec.tool_calls([dotted], tool_format="kimi"))


@pytest.fixture(scope="module")
def kimi_special_tokenizer(tmp_path_factory) -> Tokenizer:
    """The built-in model's tokenizer with Kimi's tags added as special tokens (as Kimi's tokenizer has them)."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(ensure_builtin_model())
    hf.add_special_tokens({"additional_special_tokens": list(guided_kimi.TAGS)})
    folder = tmp_path_factory.mktemp("kimi_tokenizer")
    hf.save_pretrained(folder)
    return Tokenizer(folder)


@needs_xgrammar
@pytest.mark.parametrize("backend", BACKENDS)
def test_kimis_tags_may_be_their_special_tokens(kimi_special_tokenizer, backend):
    """Where the tags are special tokens (Kimi's tokenizer), the grammar takes each as its one token, the token the
    model was taught to write (llguidance matched only the tag's text until its grammar named the token), and as
    its text spelled out too."""
    if backend == "llguidance":
        pytest.importorskip("llguidance")
    tokenizer = kimi_special_tokenizer
    cache = GrammarCache(tokenizer.hf, tokenizer.vocab_size, [tokenizer.eos_token_id])
    tools, first, second = BACKENDS[backend]
    spec = GuidedSpec.tool_calls(tools, parallel=True, tool_format="kimi")
    text = _section(first, second)
    as_tokens = tokenizer.encode(text)
    tag_ids = set(tokenizer.hf.convert_tokens_to_ids(list(guided_kimi.TAGS)))
    assert set(as_tokens) >= tag_ids and len(tag_ids) == len(guided_kimi.TAGS)
    spelled = [token for character in text for token in tokenizer.encode(character)]
    assert not tag_ids & set(spelled)
    for token_ids in (as_tokens, spelled):
        matcher = cache.matcher(spec)
        assert all(matcher.accept_token(t) for t in token_ids) and matcher.accept_token(tokenizer.eos_token_id)


def _forced(tool_format: str, backend: str) -> tuple[GuidedSpec, str]:
    """A forced one-call spec of `backend`'s tools in `tool_format` (Qwen's blocks, a list format or Kimi's section)
    and the text of its first call, as the model writes it."""
    tools, first, _ = BACKENDS[backend]
    if tool_format == "qwen":
        return GuidedSpec.tool_calls(tools), _call(*first)
    if tool_format == "kimi":
        return GuidedSpec.tool_calls(tools, tool_format="kimi"), _section(first)
    return GuidedSpec.tool_calls(tools, tool_format=tool_format), _listed(tool_format, first)


@needs_xgrammar
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("tool_format", ["qwen", *LIST_FORMATS, "kimi"])
def test_behind_the_reasoning_gate_the_call_may_follow_a_short_blank_run(cache_and_tokenizer, backend,
                                                                         tool_format):
    """Chat templates and trained models write a blank line after `</think>` ("</think>\\n\\n<tool_call>"): behind
    the reasoning gate the forced call may follow up to `LEAD_SPACE` spaces or newlines, then is exactly as before;
    more whitespace, a tab or any other text is refused (the model cannot stall in whitespace). Without the gate
    (no think block) the call starts at the first token, as before."""
    spec, call = _forced(tool_format, backend)
    gated = dataclasses.replace(spec, starts_after="</think>")
    for lead in ("", "\n", "\n\n", " \n", " " * LEAD_SPACE):
        assert accepts(cache_and_tokenizer, gated, "plan\n</think>" + lead + call), repr(lead)
    for lead in ("\n" * (LEAD_SPACE + 1), "\t", "\nok\n"):
        assert not accepts(cache_and_tokenizer, gated, "plan\n</think>" + lead + call), repr(lead)
    assert not accepts(cache_and_tokenizer, gated, "plan\n</think>\n\n")  # (whitespace alone is not a call)
    assert accepts(cache_and_tokenizer, spec, call)
    assert not accepts(cache_and_tokenizer, spec, "\n" + call)


JSON_ANSWERS = {  # (spec, an answer it takes): xgrammar's schema, the llguidance fallback's (multipleOf), any object
    "xgrammar": (GuidedSpec.json_schema({"type": "object", "properties": {"city": {"type": "string"}},
                                         "required": ["city"]}), '{"city": "Paris"}'),
    "llguidance": (GuidedSpec.json_schema(STEP["function"]["parameters"]), '{"n": 10}'),
    "json_object": (GuidedSpec(GuidedKind.JSON_OBJECT), '{"a": 1}'),
}


@needs_xgrammar
@pytest.mark.parametrize("answer", JSON_ANSWERS)
def test_behind_the_reasoning_gate_a_json_answer_may_follow_a_short_blank_run(cache_and_tokenizer, answer):
    """`response_format` JSON behind `</think>` may follow the blank line templates write there, up to `LEAD_SPACE`
    spaces or newlines (JSON readers skip it); more, a tab or other text is refused; without the gate the JSON
    starts at the first token, as before. A regex answer still starts at the next token: its text must match as
    it is."""
    spec, text = JSON_ANSWERS[answer]
    gated = dataclasses.replace(spec, starts_after="</think>")
    for lead in ("", "\n", "\n\n", " \n", " " * LEAD_SPACE):
        assert accepts(cache_and_tokenizer, gated, "plan\n</think>" + lead + text), repr(lead)
    for lead in ("\n" * (LEAD_SPACE + 1), "\t", "\nok\n"):
        assert not accepts(cache_and_tokenizer, gated, "plan\n</think>" + lead + text), repr(lead)
    assert accepts(cache_and_tokenizer, spec, text) and not accepts(cache_and_tokenizer, spec, "\n" + text)
    regex = GuidedSpec(GuidedKind.REGEX, "[a-z]+", starts_after="</think>")
    assert accepts(cache_and_tokenizer, regex, "plan\n</think>yes")
    assert not accepts(cache_and_tokenizer, regex, "plan\n</think>\nyes")
