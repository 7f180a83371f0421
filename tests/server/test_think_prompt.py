"""Chat requests whose template opens a think block in the generation prompt (Qwen3.5, and Qwen3 with thinking
on), with a reasoning parser: constraints start after the reasoning, only the generation prompt says whether the
reply starts inside a think block, the next turn hits the whole conversation in the prefix cache, and reasoning
goes out as vLLM's `reasoning` (and `reasoning_content`). Built-in model (random weights), in-process servers."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from hybridcache.models.builtin import BUILTIN_NAME, builtin_model_dir
from hybridcache.server.app import ServedModel, _Routes
from hybridcache.server.chat_output import ChatOutputOptions, final_message
from hybridcache.server.chat_prompt import checkpoint_steps, render_chat
from hybridcache.server.config import ServerConfig
from hybridcache.server.protocol import ChatCompletionRequest, parse_request
from hybridcache.server.tool_formats import tool_format
from hybridcache.tokenizer import Tokenizer

from .inprocess_server import serving

# The built-in template's generation prompt, thinking on: empty. Qwen3.5's opens "<think>\n" (and its templates,
# as the built-in one, render earlier replies without their reasoning).
BUILTIN_THINKING = ("{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
                    "{% endif -%}")
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}},
                                       "required": ["zone"], "additionalProperties": False}}}
USER = [{"role": "user", "content": "What time is it?"}]


def think_template(tokenizer) -> str:
    template = tokenizer.chat_template
    assert BUILTIN_THINKING in template
    return template.replace(BUILTIN_THINKING, "<think>\n")


@pytest.fixture(scope="module")
def think_server(tokenizer):
    with serving(chat_template=think_template(tokenizer), reasoning_parser="qwen3") as base_url:
        yield base_url


@pytest.fixture(scope="module")
def plain_server():
    with serving(reasoning_parser="qwen3") as base_url:
        yield base_url


def _chat(base_url: str, **body) -> dict:
    response = httpx.post(f"{base_url}/v1/chat/completions", json={"model": BUILTIN_NAME, **body}, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def _prepared(thinking: bool, tool_call_parser: str | None = None, **body):
    """`_Routes.prepare_chat` of a body, with the qwen3 reasoning parser (and `tool_call_parser`) and the built-in
    template, or (`thinking`) the one whose generation prompt opens a think block (the built-in folder must exist:
    the `tokenizer` fixture)."""
    tokenizer = Tokenizer(builtin_model_dir())
    if thinking:
        tokenizer.chat_template = think_template(tokenizer)
    config = ServerConfig(reasoning_parser="qwen3", tool_call_parser=tool_call_parser)
    routes = _Routes(None, ServedModel(tokenizer=tokenizer, max_model_len=4096), config, None)
    try:
        return asyncio.run(routes.prepare_chat(parse_request(ChatCompletionRequest, {"messages": USER, **body})))
    finally:
        routes.tokenizer_pool.shutdown()


@pytest.mark.parametrize("body", [{"tools": [TIME], "tool_choice": "required"},
                                  {"response_format": {"type": "json_object"}},
                                  {"guided_choice": ["yes", "no"]}])
def test_a_constraint_starts_after_the_reasoning_when_the_prompt_opens_a_think_block(tokenizer, body):
    """The grammar used to start at the first token, inside the think block the prompt opened: a forced tool call
    or a JSON answer came back as reasoning_content. As vLLM, it applies once `</think>` has been generated."""
    thinking = _prepared(True, **body)
    assert thinking.rendering.chat.in_reasoning and thinking.params.guided.starts_after == "</think>"
    plain = _prepared(False, **body)
    assert not plain.rendering.chat.in_reasoning and plain.params.guided.starts_after == ""


@pytest.mark.parametrize("parser", ["nemotron_json", "jamba", "kimi_k2", "lfm2", "olmo3", "pythonic"])
def test_a_forced_call_in_a_familys_own_format_starts_after_the_reasoning_too(tokenizer, parser):
    """The family formats (the Python-call ones included) are gated as Qwen's block is: the reasoning the prompt
    opened is free, the call in the parser's format is forced after `</think>`."""
    guided = _prepared(True, tool_call_parser=parser, tools=[TIME], tool_choice="required").params.guided
    assert (guided.tool_format, guided.starts_after) == (tool_format(parser).forced, "</think>")
    assert _prepared(False, tool_call_parser=parser, tools=[TIME], tool_choice="required").params.guided.starts_after \
        == ""


def test_a_gated_tool_call_parses_as_tool_calls_after_the_reasoning():
    text = 'plan\n</think>\n\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "utc"}}\n</tool_call>'
    message = final_message(text, ChatOutputOptions(split_reasoning=True, in_reasoning=True, parse_tools=True,
                                                    tools=[TIME]))
    assert message["reasoning"] == message["reasoning_content"] == "plan" and message["content"] is None
    assert [json.loads(c["function"]["arguments"]) for c in message["tool_calls"]] == [{"zone": "utc"}]


def test_a_forced_tool_call_leaves_the_reasoning_free(think_server):
    """Random weights never write `</think>`: the whole completion is reasoning, unconstrained (it used to be the
    forced `<tool_call>` block, as reasoning_content)."""
    body = {"messages": USER, "tools": [TIME], "tool_choice": "required", "max_tokens": 16, "temperature": 0,
            "ignore_eos": True}
    message = _chat(think_server, **body)["choices"][0]["message"]
    assert message["reasoning"] and not message["reasoning"].startswith("<tool_call>"), message


def test_think_in_the_users_text_does_not_make_the_answer_reasoning(plain_server):
    """Whether the reply starts in a think block was read from the whole prompt: a user's "<think>" turned the
    answer into reasoning_content. Only the generation prompt counts now."""
    for text in ("What does the <think> tag do?", "What does the think tag do?"):
        body = {"messages": [{"role": "user", "content": text}], "max_tokens": 40,
                "guided_choice": ["It marks reasoning."]}
        message = _chat(plain_server, **body)["choices"][0]["message"]
        assert (message["content"], message["reasoning"]) == ("It marks reasoning.", None), text


def test_the_tail_of_the_prompt_decides_where_the_reply_starts(tokenizer):
    render = dict(add_generation_prompt=True, continue_final_message=False, tools=None, template_kwargs={})
    asked = [{"role": "user", "content": "What does <think> do?"}]
    assert not render_chat(tokenizer, asked, **render).in_reasoning
    prompt = render_chat(tokenizer, asked, **{**render, "template_kwargs": {"enable_thinking": False}})
    assert not prompt.in_reasoning and prompt.generation_prompt.endswith("</think>\n\n")
    continued = [*asked, {"role": "assistant", "content": "<think>\nhm"}]
    assert render_chat(tokenizer, continued, **{**render, "add_generation_prompt": False,
                                                "continue_final_message": True}).in_reasoning


def test_the_checkpoint_lies_where_the_next_turn_parts(tokenizer):
    """The built-in template renders a reply after the very generation prompt it opens: the next turn extends the
    whole prompt (its finish checkpoint serves it), no checkpoint is asked for. The think template's next turn
    parts after `<|im_start|>assistant\\n`: the checkpoint lies before `<think>`."""
    render = {"add_generation_prompt": True, "continue_final_message": False, "tools": None, "template_kwargs": {}}
    plain = render_chat(tokenizer, USER, **render)
    assert plain.generation_prompt and checkpoint_steps(tokenizer, tokenizer.encode(plain.text), plain) == ()
    think = Tokenizer(builtin_model_dir())
    think.chat_template = think_template(tokenizer)
    prompt = render_chat(think, USER, **render)
    ids = think.encode(prompt.text)
    assert prompt.text.endswith("<|im_start|>assistant\n<think>")
    assert checkpoint_steps(think, ids, prompt) == (len(think.encode(prompt.text[: -len("<think>")])),)
    bare = render_chat(think, USER, **{**render, "add_generation_prompt": False})
    assert checkpoint_steps(think, think.encode(bare.text), bare) == ()


def test_the_next_turn_hits_the_whole_previous_conversation(think_server, tokenizer):
    """The template opens `<think>\\n` and renders earlier replies without it: turn 2 parts from turn 1's prompt
    inside its generation prompt, where no checkpoint lay (cached_tokens 0). The server asks the engine for one
    there, as `LLM.chat` does."""
    turn1 = [{"role": "system", "content": "You answer briefly. " * 8}, {"role": "user", "content": "Why? " * 12}]
    reply = _chat(think_server, messages=turn1, max_tokens=8, temperature=0, ignore_eos=True)
    message = reply["choices"][0]["message"]
    assert message["reasoning"]  # dropped from the next turn, as Qwen3.5's templates drop earlier reasoning
    turn2 = [*turn1, {"role": "assistant", "content": message["content"]}, {"role": "user", "content": "And then?"}]
    second = _chat(think_server, messages=turn2, max_tokens=2, temperature=0)
    # turn 2 parts from turn 1's prompt after "<|im_start|>assistant\n", before "<think>\n"
    think = Tokenizer(builtin_model_dir())
    think.chat_template = think_template(tokenizer)
    prompt = think.apply_chat_template(turn1, add_generation_prompt=True)
    parting = len(think.encode(prompt[: prompt.rindex("<think>")]))
    assert parting > 150
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == parting


def test_reasoning_goes_out_as_reasoning_and_reasoning_content(plain_server):
    """vLLM renamed `reasoning_content` to `reasoning` (and later dropped the old name): both are sent."""
    body = {"messages": USER, "max_tokens": 40, "guided_choice": ["<think>\nhm\n</think>\n\nok"]}
    message = _chat(plain_server, **body)["choices"][0]["message"]
    assert (message["reasoning"], message["reasoning_content"], message["content"]) == ("hm", "hm", "ok")
    with httpx.stream("POST", f"{plain_server}/v1/chat/completions", json={"model": BUILTIN_NAME, **body,
                                                                           "stream": True}, timeout=120) as r:
        deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in r.iter_lines()
                  if line.startswith("data: {")]
    reasoning = [d for d in deltas if "reasoning" in d or "reasoning_content" in d]
    assert reasoning and all(d["reasoning"] == d["reasoning_content"] for d in reasoning)
    assert "".join(d["reasoning"] for d in reasoning) == "hm"


@pytest.mark.parametrize("answer", ["<think>\nhm, still thinking", "<think>\nhm\n</think>\n\n"])
def test_a_reply_with_nothing_after_its_reasoning_has_null_content(plain_server, answer):
    """vLLM's qwen3 parser gives content null when the reply ends inside its think block (cut short) or right after
    it; the server sent "". Streamed, only the role chunk carries a content (""), as in vLLM."""
    body = {"messages": USER, "max_tokens": 40, "guided_choice": [answer]}
    message = _chat(plain_server, **body)["choices"][0]["message"]
    assert (message["reasoning"], message["content"]) == ("hm, still thinking" if "still" in answer else "hm", None)
    with httpx.stream("POST", f"{plain_server}/v1/chat/completions", json={"model": BUILTIN_NAME, **body,
                                                                           "stream": True}, timeout=120) as r:
        deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in r.iter_lines()
                  if line.startswith("data: {")]
    assert [d.get("content") for d in deltas if "content" in d] == [""] and "role" in deltas[0]
    assert "".join(d.get("reasoning", "") for d in deltas) == message["reasoning"]
