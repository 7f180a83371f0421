"""`--reasoning-parser kimi_k2`: Kimi's tool-call section begun inside an unclosed think block ends the reasoning and
starts the content, as vLLM's kimi_k2 reasoning parser has it; at every split point the split only grows and the
streamed message is the whole one. Other reasoning parsers keep the section in the reasoning. A request without
tools, whose text is decoded with special tokens skipped, ends its reasoning at the section's token too (Kimi's tags
are special tokens), with the content shown as the default decode shows it."""

from __future__ import annotations

import json
import re
import shutil

import httpx
import pytest
from openai import OpenAI
from transformers import AutoTokenizer

from hybridcache.models.builtin import BUILTIN_NAME, ensure_builtin_model
from hybridcache.server import reasoning
from hybridcache.server.chat_output import (
    ChatOutputOptions,
    ChoiceStream,
    ThinkMarkers,
    final_message,
    reasoning_tokens,
)
from hybridcache.server.reasoning import ReasoningParser
from hybridcache.server.special_tokens import special_token_texts
from hybridcache.server.tool_formats import tool_format
from hybridcache.tokenizer import Tokenizer

from .inprocess_server import serving

SECTIONS = ReasoningParser.KIMI_K2.call_sections
SECTION_BEGIN = SECTIONS[0]
TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}}}}]
SECTION = ("<|tool_calls_section_begin|><|tool_call_begin|>functions.get_time:0<|tool_call_argument_begin|>"
           '{"zone": "utc"}<|tool_call_end|><|tool_calls_section_end|>')
SINGULAR = SECTION.replace("tool_calls_section", "tool_call_section")
XML_CALL = "<tool_call>\n<function=get_time>\n<parameter=zone>\nutc\n</parameter>\n</function>\n</tool_call>"

CASES = {  # text after the think block's opening -> (reasoning, content)
    "section": ("I need the time.\n" + SECTION, ("I need the time.", SECTION)),
    "singular": ("I need the time.\n" + SINGULAR, ("I need the time.", SINGULAR)),
    "at once": (SECTION, ("", SECTION)),
    "mention first": ("plan <tool_call> b\n" + SECTION, ("plan <tool_call> b", SECTION)),
    "closed first": ("plan\n</think>\n\nok " + SECTION, ("plan", "ok " + SECTION)),
    "qwen call first": ("plan\n" + XML_CALL + SECTION, ("plan", XML_CALL + SECTION)),
    "no section": ("plan <|tool_calls_sec", ("plan <|tool_calls_sec", "")),
}


@pytest.mark.parametrize("case", CASES)
def test_a_section_inside_the_think_block_ends_the_reasoning(case):
    text, expected = CASES[case]
    parts = reasoning.split(text, in_reasoning=True, finished=True, sections=SECTIONS)
    assert (parts.reasoning, parts.content) == expected
    opened = reasoning.split("<think>\n" + text, in_reasoning=False, finished=True, sections=SECTIONS)
    assert (opened.reasoning, opened.content) == expected


def test_other_reasoning_parsers_keep_the_section_in_the_reasoning():
    assert all(parser.call_sections == () for parser in ReasoningParser if parser is not ReasoningParser.KIMI_K2)
    parts = reasoning.split("plan\n" + SECTION, in_reasoning=True, finished=True)
    assert (parts.reasoning, parts.content) == ("plan\n" + SECTION, "")


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("opened", [False, True])
def test_at_every_split_point_the_split_only_grows_to_the_whole_one(case, opened):
    """A partial tag at the end is held back (`plan\\n<|tool_calls_sec`: reasoning "plan", no content yet), so the
    reasoning never shows a piece of the tag that later moves to the content."""
    text, expected = CASES[case]
    text = "<think>\n" + text if opened else text
    before = reasoning.ReasoningSplit("", "")
    for cut in range(len(text) + 1):
        now = reasoning.split(text[:cut], in_reasoning=not opened, finished=cut == len(text), sections=SECTIONS)
        assert (now.reasoning or "").startswith(before.reasoning or ""), (text[:cut], before, now)
        assert now.content.startswith(before.content), (text[:cut], before, now)
        before = now
    assert (before.reasoning, before.content) == expected


def test_a_partial_tag_is_held_back():
    parts = reasoning.split("plan\n<|tool_calls_sec", in_reasoning=True, finished=False, sections=SECTIONS)
    assert (parts.reasoning, parts.content) == ("plan", "")


def test_the_section_is_the_messages_calls_streamed_at_every_split_point_and_whole():
    text = "I need the time.\n" + SECTION
    options = ChatOutputOptions(split_reasoning=True, in_reasoning=True, call_sections=SECTIONS, parse_tools=True,
                                tools=TOOLS, tool_call_parser="kimi_k2")
    message = final_message(text, options)
    assert message["reasoning_content"] == "I need the time." and not message["content"]
    whole = [(c["id"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]]
    assert whole == [("functions.get_time:0", "get_time", {"zone": "utc"})]
    for cut in range(1, len(text)):
        stream = ChoiceStream(options)
        first, last = stream.update(text[:cut], finished=False), stream.update(text, finished=True)
        assert first.reasoning + last.reasoning == "I need the time.", cut
        assert first.content + last.content == ""
        calls = [(c.id, c.name, json.loads(c.arguments)) for _, c in first.tool_calls + last.tool_calls]
        assert calls == whole, cut


def test_reasoning_tokens_stop_at_the_section():
    tokenizer = Tokenizer(ensure_builtin_model())
    thought = "I will call get_time, then answer.\n"
    text = thought + SECTION
    options = ChatOutputOptions(split_reasoning=True, in_reasoning=True, call_sections=SECTIONS,
                                think_markers=ThinkMarkers.of(tokenizer, SECTIONS))
    ids = tokenizer.encode(thought) + tokenizer.encode(SECTION)
    assert reasoning_tokens(text, ids, options) == len(tokenizer.encode(thought))
    no_section = ChatOutputOptions(split_reasoning=True, in_reasoning=True, think_markers=ThinkMarkers.of(tokenizer))
    assert reasoning_tokens(text, ids, no_section) == len(ids)  # (another parser: all of it is reasoning)


def test_the_server_splits_at_the_section_with_the_kimi_k2_parsers():
    forced = {"guided_regex": re.escape("<think>\nI need the time.\n" + SECTION)}
    with serving(reasoning_parser="kimi_k2", tool_call_parser="kimi_k2") as base_url:
        client = OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)
        messages = [{"role": "user", "content": "time?"}]
        response = client.chat.completions.create(model=BUILTIN_NAME, messages=messages, tools=TOOLS,
                                                  max_tokens=300, temperature=0, extra_body=forced)
        choice = response.choices[0]
        assert choice.message.model_extra["reasoning_content"] == "I need the time."
        assert [(c.id, c.function.name) for c in choice.message.tool_calls] == [("functions.get_time:0", "get_time")]
        assert choice.finish_reason == "tool_calls" and not choice.message.content
        reasoning_text, names = "", []
        for event in client.chat.completions.create(model=BUILTIN_NAME, messages=messages, tools=TOOLS,
                                                    max_tokens=300, temperature=0, stream=True, extra_body=forced):
            if event.choices:
                delta = event.choices[0].delta
                reasoning_text += (delta.model_extra or {}).get("reasoning_content") or ""
                names += [call.function.name for call in delta.tool_calls or []]
        assert reasoning_text == "I need the time." and names == ["get_time"]


@pytest.fixture(scope="module")
def kimi_tokens_folder(tmp_path_factory) -> str:
    """A copy of the built-in model whose tokenizer has Kimi's tags as special added tokens, as Kimi's own has."""
    folder = tmp_path_factory.mktemp("kimi_reasoning_tokens") / "model"
    shutil.copytree(ensure_builtin_model(), folder)
    hf = AutoTokenizer.from_pretrained(folder)
    hf.add_special_tokens({"additional_special_tokens": list(tool_format("kimi_k2").tags)})
    hf.save_pretrained(folder)
    return str(folder)


def test_without_tools_the_sections_token_ends_the_reasoning(kimi_tokens_folder):
    """No tools: the text is decoded with special tokens skipped (vLLM's default), so the section's tags are not in
    it; the reasoning still ends at the section's token, as vLLM's kimi_k2 parser ends it on token ids
    (`is_reasoning_end`), and the content is what the default decode shows after it. Whole and streamed alike, and
    `reasoning_tokens` stops at the section's token. The tags are generated as their special tokens' ids (the
    grammar allows either spelling; logit_bias makes the special token the choice)."""
    hf = AutoTokenizer.from_pretrained(kimi_tokens_folder)
    tags = list(tool_format("kimi_k2").tags)
    ids = dict(zip(tags, hf.convert_tokens_to_ids(tags)))
    assert set(tags) <= special_token_texts(hf) and min(ids.values()) >= 259
    shown = 'functions.get_time:0{"zone": "utc"}'  # (the section as the default decode shows it)
    body = {"model": BUILTIN_NAME, "messages": [{"role": "user", "content": "time?"}], "max_tokens": 300,
            "temperature": 0, "return_token_ids": True, "logit_bias": {str(i): 100 for i in ids.values()},
            "guided_regex": re.escape("<think>\nI need the time.\n" + SECTION)}
    with serving(reasoning_parser="kimi_k2", model_path=kimi_tokens_folder) as base_url:
        response = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=120).raise_for_status().json()
        streamed = httpx.post(f"{base_url}/v1/chat/completions", json={**body, "stream": True}, timeout=120)
    choice = response["choices"][0]
    generated = choice["token_ids"]
    assert ids[SECTION_BEGIN] in generated, generated  # (the tag as its special token)
    message = choice["message"]
    assert (message["reasoning_content"], message["content"]) == ("I need the time.", shown)
    assert not message.get("tool_calls") and choice["finish_reason"] == "stop"
    think = len(hf.encode("<think>", add_special_tokens=False))
    counted = response["usage"]["completion_tokens_details"]["reasoning_tokens"]
    assert counted == generated.index(ids[SECTION_BEGIN]) - think
    reasoning_text, content = "", ""
    for line in streamed.raise_for_status().text.splitlines():
        if line.startswith("data: {"):
            for event_choice in json.loads(line[len("data: "):])["choices"]:
                reasoning_text += event_choice["delta"].get("reasoning_content") or ""
                content += event_choice["delta"].get("content") or ""
    assert (reasoning_text, content) == ("I need the time.", shown)
