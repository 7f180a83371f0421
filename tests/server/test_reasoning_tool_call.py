"""A tool call Qwen3.5 writes inside its think block without closing it: it ends the reasoning, as vLLM's qwen3
parser (its `<tool_call>` + `<function` lookahead) has it, streamed and not."""

import json
import random

import pytest

from hybridcache.server import reasoning
from hybridcache.server.chat_output import ChatOutputOptions, ChoiceStream, final_message

TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}}}}]
XML_CALL = "<tool_call>\n<function=get_time>\n<parameter=zone>\nutc\n</parameter>\n</function>\n</tool_call>"


@pytest.mark.parametrize("text, expected", [
    ("I need the time.\n" + XML_CALL, ("I need the time.", XML_CALL)),
    ("plan <tool_call>  <function name=\"get_time\">", ("plan ", "<tool_call>  <function name=\"get_time\">")),
    # a mention of the tag that no function follows stays reasoning (vLLM: "bare <tool_call> mentions")
    ("the format is <tool_call> then JSON", ("the format is <tool_call> then JSON", "")),
    ("mention <tool_call>\n{\"a\": 1}\nthen\n" + XML_CALL, ("mention <tool_call>\n{\"a\": 1}\nthen", XML_CALL)),
    # a closed block is split at </think> as before; a call after it is content
    ("plan\n</think>\n\n" + XML_CALL, ("plan", XML_CALL)),
    ("cut short <tool_call>\n<func", ("cut short <tool_call>\n<func", "")),  # finished: never became a call
])
def test_a_call_inside_the_think_block_ends_the_reasoning(text, expected):
    parts = reasoning.split(text, in_reasoning=True, finished=True)
    assert (parts.reasoning, parts.content) == expected
    opened = reasoning.split("<think>\n" + text, in_reasoning=False, finished=True)  # the model opened the block
    assert (opened.reasoning, opened.content) == expected


def test_a_mention_just_before_the_end_of_the_block_does_not_hold_back_what_follows():
    """A `<tool_call>` that `</think>` follows can no longer become a call: the content after the block streams
    (it was held back to the finishing chunk, also in /v1/responses)."""
    parts = reasoning.split("x <tool_call></think>\n\nHi", in_reasoning=True, finished=False)
    assert (parts.reasoning, parts.content) == ("x <tool_call>", "Hi")
    stream = ChoiceStream(ChatOutputOptions(split_reasoning=True, in_reasoning=True), ())
    text, content = "", ""
    for piece in ["I will emit a ", "<tool_call>", "\n</think>", "\n\nThe answer", " is four", "."]:
        text += piece
        content += stream.update(text, False).content or ""
    assert content == "The answer is four."  # every piece streamed before the end


def test_the_call_is_a_tool_call_of_the_message_streamed_and_not():
    text = "I need the time.\n" + XML_CALL
    options = ChatOutputOptions(split_reasoning=True, in_reasoning=True, parse_tools=True, tools=TOOLS)
    message = final_message(text, options)
    assert message["reasoning_content"] == "I need the time."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == [
        ("get_time", {"zone": "utc"})]
    rng = random.Random(0)
    for _ in range(50):
        stream = ChoiceStream(options)
        got_reasoning, calls, cut = "", [], 0
        while cut < len(text):
            cut = min(len(text), cut + rng.randint(1, 4))
            delta = stream.update(text[:cut], finished=cut == len(text))
            got_reasoning += delta.reasoning
            calls += [(c.name, json.loads(c.arguments)) for _, c in delta.tool_calls]
        assert got_reasoning == "I need the time."
        assert calls == [("get_time", {"zone": "utc"})]


@pytest.mark.parametrize("seed", range(20))
def test_streamed_splits_only_grow(seed):
    """`split` stays monotonic with the lookahead: each prefix's reasoning and content extend the previous ones."""
    rng = random.Random(seed)
    pieces = ["plan", " ", "\n", "<tool_call>", "<tool_", "call>", "<function=f>", "<func", "tion ", "x", "</think>",
              "{", "</tool_call>"]
    text = "".join(rng.choice(pieces) for _ in range(rng.randint(3, 25)))
    before = reasoning.ReasoningSplit("", "")
    for cut in range(1, len(text) + 1):
        now = reasoning.split(text[:cut], in_reasoning=True, finished=cut == len(text))
        assert (now.reasoning or "").startswith(before.reasoning or ""), (text[:cut], before, now)
        assert now.content.startswith(before.content), (text[:cut], before, now)
        before = now


def _reference_call_inside(text: str, finished: bool) -> tuple[int, bool]:
    """The rule spelled out: the first `<tool_call>` followed (past white space) by `<function` + space or "="
    is a call; else, while unfinished, one whose rest may still become that is undecided."""
    start = 0
    while (i := text.find("<tool_call>", start)) >= 0:
        after = text[i + len("<tool_call>"):].lstrip()
        if after.startswith("<function") and len(after) > len("<function") and after[9] in " \t\n\r=":
            return i, True
        if not finished and "<function".startswith(after):
            return i, False
        start = i + 1
    return -1, False


@pytest.mark.parametrize("seed", range(30))
def test_the_call_search_agrees_with_the_rule(seed):
    rng = random.Random(seed)
    pieces = ["a", " ", "\n", "<tool_call>", "<function", "=", " x", "<func", "tion", "\t"]
    text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 30)))
    for cut in range(len(text) + 1):
        for finished in (False, True):
            assert reasoning._call_inside(text[:cut], finished) == _reference_call_inside(text[:cut], finished), (
                text[:cut], finished)


def test_reasoning_tokens_run_to_the_call_that_ends_the_block_not_to_a_mention():
    """The count stopped at the first `<tool_call>` token, a mention the split keeps in the reasoning (21 of 51)."""
    from hybridcache.models.builtin import ensure_builtin_model
    from hybridcache.server.chat_output import ThinkMarkers, reasoning_tokens
    from hybridcache.tokenizer import Tokenizer

    tokenizer = Tokenizer(ensure_builtin_model())
    options = ChatOutputOptions(split_reasoning=True, in_reasoning=True, think_markers=ThinkMarkers.of(tokenizer))
    thought = "I will answer with a <tool_call> block, then stop.\n"
    text = thought + XML_CALL
    assert reasoning.split(text, in_reasoning=True, finished=True).reasoning == thought.strip("\n")
    assert reasoning_tokens(text, tokenizer.encode(text), options) == len(tokenizer.encode(thought))
