"""A chat choice's text as an assistant message: reasoning split, then tool-call parsing, whole or streamed.

Pipeline for one choice: the engine's text so far -> `TextStream` (what is safe to send: no partial stop
string, no partial character) -> `reasoning.split` (when a reasoning parser is on) -> `ToolCallStream` on the
content (when the request's tools are parsed). `ChoiceStream.update` returns what is new at each step;
`final_message` does the same on a finished text in one go. Both give the same message.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hybridcache.server import reasoning
from hybridcache.server.text_stream import TextStream
from hybridcache.server.tool_parsers import ToolCall, ToolCallStream


@dataclass(frozen=True)
class ChatOutputOptions:
    """split_reasoning: a reasoning parser is on; in_reasoning: the prompt left a think block open.
    parse_tools: the request has tools and tool_choice is not "none"; tools: their definitions.
    parallel_tool_calls: false keeps only the first call (index 0), whole or streamed, as vLLM's
    `maybe_filter_parallel_tool_calls` (the rest are parsed, and dropped)."""

    split_reasoning: bool = False
    in_reasoning: bool = False
    parse_tools: bool = False
    tools: list[dict] | None = None
    parallel_tool_calls: bool = True


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
        self._tools = ToolCallStream(options.tools) if options.parse_tools else None
        self.has_reasoning = False  # the text has a think block (closed or not)

    @property
    def has_tool_calls(self) -> bool:
        return bool(self._tools and self._tools.calls)

    def update(self, text: str, finished: bool) -> ChoiceDelta:
        self._text.update(text, finished)
        stable = self._text.sent
        delta = ChoiceDelta()
        content = stable
        if self.options.split_reasoning:
            parts = reasoning.split(stable, in_reasoning=self.options.in_reasoning, finished=finished)
            self.has_reasoning = self.has_reasoning or parts.reasoning is not None
            if parts.reasoning is not None and parts.reasoning.startswith(self._reasoning_sent):
                delta.reasoning = parts.reasoning[len(self._reasoning_sent):]
                self._reasoning_sent = parts.reasoning
            content = parts.content
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
    with a reasoning parser the reasoning (None when there is none) as vLLM's `reasoning` and as
    `reasoning_content`, the name vLLM used before and many clients read. As vLLM, the content is None, not "",
    when nothing follows the choice's think block (closed or not: a choice cut inside its reasoning) or its tool
    calls."""
    stream = ChoiceStream(options)
    delta = stream.update(text, finished=True)
    empty_is_none = stream.has_reasoning or bool(delta.tool_calls)
    message: dict[str, Any] = {"role": "assistant", "content": delta.content or (None if empty_is_none else "")}
    if options.split_reasoning:
        message["reasoning"] = message["reasoning_content"] = delta.reasoning or None
    if delta.tool_calls:
        message["tool_calls"] = [call.as_openai() for _, call in delta.tool_calls]
    return message


def finish_reason(reason: str | None, has_tool_calls: bool) -> str | None:
    """OpenAI's finish reason: a choice that stopped with tool calls finished with "tool_calls"."""
    return "tool_calls" if reason == "stop" and has_tool_calls else reason
