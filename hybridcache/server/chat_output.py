"""A chat choice's text as an assistant message: reasoning split, then tool-call parsing, whole or streamed.

Pipeline for one choice: the engine's text so far -> `TextStream` (what is safe to send: no partial stop
string, no partial character) -> `reasoning.split` (when a reasoning parser is on) -> `ToolCallStream` on the
content (when the request's tools are parsed). `ChoiceStream.update` returns what is new at each step;
`final_message` does the same on a finished text in one go. Both give the same message.
`reasoning_tokens` counts a choice's reasoning tokens for `usage.completion_tokens_details`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from hybridcache.server import reasoning
from hybridcache.server.special_tokens import strip, stripper
from hybridcache.server.text_stream import TextStream
from hybridcache.server.tool_parsers import ToolCall, ToolCallStream


@dataclass(frozen=True)
class ThinkMarkers:
    """The token ids of the think block's tags (`reasoning.THINK_START`, `THINK_END`), of `reasoning.TOOL_CALL`
    (a call written inside the block ends it) and of the reasoning parser's `call_sections` (Kimi's section tags,
    which end it too) as the tokenizer encodes them: one added token each in Qwen3 and Kimi tokenizers, several in
    a byte-level one (the built-in test model's)."""

    start_ids: tuple[int, ...]
    end_ids: tuple[int, ...]
    call_ids: tuple[int, ...] = ()
    section_ids: tuple[tuple[int, ...], ...] = ()

    @classmethod
    def of(cls, tokenizer: Any, sections: tuple[str, ...] = ()) -> ThinkMarkers:
        start, end, call = (tuple(tokenizer.encode(tag)) for tag in (reasoning.THINK_START, reasoning.THINK_END,
                                                                        reasoning.TOOL_CALL))
        return cls(start, end, call, tuple(tuple(tokenizer.encode(tag)) for tag in sections))


@dataclass(frozen=True)
class ChatOutputOptions:
    """split_reasoning: a reasoning parser is on; in_reasoning: the prompt left a think block open;
    call_sections: the tags of tool-call sections that end a think block (`ReasoningParser.call_sections`);
    include_reasoning: false drops the reasoning from the message, whole or streamed (vLLM's `include_reasoning`);
    think_markers: the tags' token ids, for `reasoning_tokens` (None: no count).
    parse_tools: the request has tools and tool_choice is not "none"; tools: their definitions.
    tool_call_parser: the server's `--tool-call-parser` (ServerConfig's): which format the calls are read in
    (`tool_formats.tool_format`; None: the Qwen blocks).
    strip_tokens: special-token texts taken out of the text before reasoning and calls are read: the text was
    decoded with special tokens kept because the parsers' tags are special (`special_tokens.strippable`).
    split_only_tags: tags kept in that text for the reasoning split only (Kimi's section tags, special tokens, in a
    request whose tools are not parsed in Kimi's format), taken out of the content after the split, so the content
    shows what the default decode (special tokens skipped) shows.
    tool_choice: "required" or "named" (a function named) force a call: as vLLM, the content is then "" rather
    than null, and a named call finishes with the engine's reason ("stop"), not "tool_calls" (OpenAI's rule too).
    parallel_tool_calls: false keeps only the first call (index 0), whole or streamed, as vLLM's
    `maybe_filter_parallel_tool_calls` (the rest are parsed, and dropped).
    echo: vLLM's chat `echo`, what the content starts with (`ChatCompletionRequest.echo_text`; None: no echo)."""

    split_reasoning: bool = False
    in_reasoning: bool = False
    call_sections: tuple[str, ...] = ()
    include_reasoning: bool = True
    think_markers: ThinkMarkers | None = None
    parse_tools: bool = False
    tools: list[dict] | None = None
    tool_call_parser: str | None = None
    strip_tokens: tuple[str, ...] = ()
    split_only_tags: tuple[str, ...] = ()
    tool_choice: Literal["auto", "required", "named"] = "auto"
    parallel_tool_calls: bool = True
    echo: str | None = None

    @property
    def hides_reasoning(self) -> bool:
        """Reasoning is split off and dropped: as vLLM, choices then carry no logprobs or token ids either (they
        would show it)."""
        return self.split_reasoning and not self.include_reasoning

    @property
    def forced_tool_call(self) -> bool:
        return self.parse_tools and self.tool_choice != "auto"


@dataclass
class ChoiceDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[tuple[int, ToolCall]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)


class ChoiceStream:
    """The streamed assistant message of one choice."""

    def __init__(self, options: ChatOutputOptions, stop: tuple[str, ...] = ()) -> None:
        self.options = options
        self._text = TextStream(stop)
        self._reasoning_sent = ""
        self._content_seen = ""
        self._tools = ToolCallStream(options.tools, options.tool_call_parser) if options.parse_tools else None
        self._stripper = stripper(options.strip_tokens)
        self._split_only = stripper(options.split_only_tags)
        self.has_reasoning = False  # the text has a think block (closed or not)

    @property
    def has_tool_calls(self) -> bool:
        return bool(self._tools and self._tools.calls)

    def update(self, text: str, finished: bool) -> ChoiceDelta:
        self._text.update(text, finished)
        stable = strip(self._text.sent, self._stripper)
        delta = ChoiceDelta()
        content = stable
        if self.options.split_reasoning:
            parts = reasoning.split(stable, in_reasoning=self.options.in_reasoning, finished=finished,
                                    sections=self.options.call_sections)
            self.has_reasoning = self.has_reasoning or parts.reasoning is not None
            if parts.reasoning is not None and parts.reasoning.startswith(self._reasoning_sent):
                delta.reasoning = parts.reasoning[len(self._reasoning_sent):]
                self._reasoning_sent = parts.reasoning
            content = strip(parts.content, self._split_only)
            if not self.options.include_reasoning:
                delta.reasoning = ""
        if self._tools is not None:
            delta.content = self._tools.feed(content, finished)
            calls = self._tools.new_calls()
            delta.tool_calls = calls if self.options.parallel_tool_calls else [c for c in calls if c[0] == 0]
        elif content.startswith(self._content_seen):
            delta.content = content[len(self._content_seen):]
            self._content_seen = content
        return delta


def final_message(text: str, options: ChatOutputOptions) -> dict[str, Any]:
    """The non-streaming assistant message of a finished choice: role, content, `tool_calls` where present, and
    with a reasoning parser the reasoning (None when there is none, or with `include_reasoning` false) as vLLM's
    `reasoning` and as `reasoning_content`, the name vLLM used before and many clients read. As vLLM, the content
    is None, not "", when nothing follows the choice's think block (closed or not: a choice cut inside its
    reasoning) or its tool calls, but "" for a forced call; with `echo` it starts with the echoed text (and is
    never None)."""
    stream = ChoiceStream(options)
    delta = stream.update(text, finished=True)
    empty_is_none = (stream.has_reasoning or bool(delta.tool_calls)) and not options.forced_tool_call
    content = delta.content or (None if empty_is_none else "")
    if options.echo is not None:
        content = options.echo + (content or "")
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if options.split_reasoning:
        message["reasoning"] = message["reasoning_content"] = delta.reasoning or None
    if delta.tool_calls:
        message["tool_calls"] = [call.as_openai() for _, call in delta.tool_calls]
    return message


def finish_reason(reason: str | None, has_tool_calls: bool, options: ChatOutputOptions | None = None) -> str | None:
    """OpenAI's finish reason: a choice that stopped with tool calls finished with "tool_calls", unless the request
    named the function (`options.tool_choice` "named": then the engine's "stop", as OpenAI and vLLM)."""
    named = options is not None and options.tool_choice == "named"
    return "tool_calls" if reason == "stop" and has_tool_calls and not named else reason


def reasoning_tokens(text: str, token_ids: Sequence[int], options: ChatOutputOptions) -> int:
    """How many of a choice's generated `token_ids` (whose text is `text`) are its reasoning, as vLLM's think-tag
    parsers count them (`count_reasoning_tokens`): the tokens inside the think block, its tags not counted. The
    block is the one `reasoning.split` finds: opened by the prompt (`options.in_reasoning`) or by the tag the text
    starts with; closed by the first closing tag after that, or by a tool call written inside it (the
    `<tool_call>` is not counted) or a tool-call section (`options.call_sections`: the first of its tags' ids, not
    counted), or running to the end (a choice cut inside its reasoning); 0 without a think
    block or without `options.think_markers`. Worked example (Qwen3 tokens)::

        <think>  \n  plan  \n  </think>  \n\n  Hi      ->  3  (\n plan \n)
    """
    markers = options.think_markers
    parts = reasoning.split(text, in_reasoning=options.in_reasoning, finished=True, sections=options.call_sections)
    if markers is None or parts.reasoning is None:
        return 0
    begin = 0
    if text.lstrip().startswith(reasoning.THINK_START):
        at = _find(token_ids, markers.start_ids, 0)
        begin = 0 if at < 0 else at + len(markers.start_ids)
    before_content = text[:len(text) - len(parts.content)]
    if parts.content.startswith(options.call_sections) and reasoning.THINK_END not in before_content:
        ends = [at for ids in markers.section_ids if (at := _find(token_ids, ids, begin)) >= 0]
        return min(ends, default=len(token_ids)) - begin
    closed_by_call = parts.content.startswith(reasoning.TOOL_CALL) and reasoning.THINK_END not in before_content
    end = _find(token_ids, markers.call_ids if closed_by_call else markers.end_ids, begin)
    if closed_by_call and end >= 0:  # the call that closes it comes after the reasoning's mentions of the tag
        hits = [end]
        while (at := _find(token_ids, markers.call_ids, hits[-1] + len(markers.call_ids))) >= 0:
            hits.append(at)
        mentions = before_content.count(reasoning.TOOL_CALL)
        if len(hits) == text.count(reasoning.TOOL_CALL) > mentions:  # (each tag in the text is one in the ids)
            end = hits[mentions]
    return (len(token_ids) if end < 0 else end) - begin


def _find(ids: Sequence[int], part: tuple[int, ...], start: int) -> int:
    """Where `part` first occurs in `ids` at or after `start` (-1: nowhere)."""
    if not part:
        return -1
    for i in range(start, len(ids) - len(part) + 1):
        if ids[i] == part[0] and tuple(ids[i:i + len(part)]) == part:
            return i
    return -1
