"""Response bodies and server-sent-event chunks of the OpenAI API, built from the engine's `RequestOutput`s.

A response covers one or more engine requests (a batch of completion prompts is one engine request per
prompt): choice `prompt_index * n + i` is completion i of prompt `prompt_index`. What a choice looks like
beyond its text (reasoning split, tool calls, logprobs, echo, token ids) is the response's `Rendering`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from hybridcache.outputs import CompletionOutput, RequestOutput
from hybridcache.server.chat_output import (
    ChatOutputOptions,
    ChoiceDelta,
    final_message,
    finish_reason,
    reasoning_tokens,
)
from hybridcache.server.logprobs_format import (
    chat_logprobs,
    completion_logprobs,
    echo_logprobs,
    join_logprobs,
    prompt_logprobs_json,
)


@dataclass(frozen=True)
class Rendering:
    """How choices are rendered. chat: the chat message options (reasoning, tools). logprobs: choices carry
    their tokens' logprobs (`tokenizer` decodes their tokens). echo: completions start with their prompt's text
    (`echo_texts[prompt_index]`), and, with logprobs, their logprobs with the prompt tokens' (the prompt token
    and the `logprobs` likeliest at each position; the engine computed the prompt's logprobs for it).
    echo_only: `max_tokens: 0` with echo: the engine generated one token that no choice shows (not in the
    text, the logprobs, the token ids or the usage). prompt_logprobs: the `prompt_logprobs` the client asked
    for (None: the field is left out even where the engine computed them for echo).
    return_token_ids: each finished choice carries its token ids, and the response its prompt's (vLLM's places: each
    completion choice, the chat response; streamed, each choice's first chunk). Each choice's vLLM `stop_reason` is
    the engine's (`CompletionOutput.stop_reason`). tokens_as_ids: logprobs name each token "token_id:<id>" (vLLM's
    `return_tokens_as_token_ids`)."""

    chat: ChatOutputOptions = field(default_factory=ChatOutputOptions)
    logprobs: bool = False
    tokenizer: Any = None
    num_logprobs: int = 0
    echo_texts: tuple[str, ...] | None = None
    echo_only: bool = False
    prompt_logprobs: int | None = None
    return_token_ids: bool = False
    tokens_as_ids: bool = False

    @property
    def echoes_logprobs(self) -> bool:
        """Whether choices' logprobs start with their prompt's (echo with logprobs)."""
        return self.echo_texts is not None and self.logprobs


@dataclass(frozen=True)
class ResponseMeta:
    """What every body of one response repeats. `chat`: a chat completion (else a text completion)."""

    response_id: str
    model: str
    chat: bool
    created: int

    @classmethod
    def new(cls, response_id: str, model: str, chat: bool) -> ResponseMeta:
        return cls(response_id, model, chat, int(time.time()))

    def header(self, streaming: bool) -> dict[str, Any]:
        chat_kind = "chat.completion.chunk" if streaming else "chat.completion"
        kind = chat_kind if self.chat else "text_completion"
        return {"id": self.response_id, "object": kind, "created": self.created, "model": self.model}


def usage(outputs: Sequence[RequestOutput], chat: ChatOutputOptions | None = None) -> dict[str, Any]:
    """Token counts of a response's requests; `cached_tokens`: prompt tokens whose computation the prefix
    cache skipped. With a reasoning parser (`chat.split_reasoning`), `completion_tokens_details.reasoning_tokens`:
    the choices' reasoning tokens (`chat_output.reasoning_tokens`), as vLLM reports them."""
    prompt_tokens = sum(len(output.prompt_token_ids) for output in outputs)
    completion_tokens = sum(len(c.token_ids) for output in outputs for c in output.outputs)
    body: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": sum(output.num_cached_tokens for output in outputs)},
    }
    if chat is not None and chat.split_reasoning:
        counted = sum(reasoning_tokens(c.text, c.token_ids, chat) for output in outputs for c in output.outputs)
        body["completion_tokens_details"] = {"reasoning_tokens": counted}
    return body


def shown(output: RequestOutput, rendering: Rendering) -> RequestOutput:
    """`output` as its choices show it: with `echo_only`, each completion without its one generated token."""
    if not rendering.echo_only:
        return output
    hidden = [replace(c, text="", token_ids=[], logprobs=None if c.logprobs is None else [])
              for c in output.outputs]
    return replace(output, outputs=hidden)


def logprobs_of(rendering: Rendering, chat: bool, c: CompletionOutput, start: int = 0,
                text_offset: int = 0, echoed: RequestOutput | None = None) -> dict[str, Any] | None:
    """The logprobs of `c`'s tokens from `start` on, in the endpoint's shape (None when not asked for), the first
    token's `text_offset` at `text_offset`. `echoed`: `c`'s request, whose prompt's logprobs lead (echo): the
    offsets then run on from the prompt tokens' (as vLLM's: each the one before plus its token's text), whatever
    `text_offset` says, so streamed and whole responses agree and offsets never go back."""
    if not rendering.logprobs or c.logprobs is None:
        return None
    entries, token_ids = c.logprobs[start:], c.token_ids[start:]
    as_ids = rendering.tokens_as_ids
    if chat:
        return chat_logprobs(token_ids, entries, rendering.num_logprobs, as_ids)
    if echoed is None or echoed.prompt_logprobs is None:
        return completion_logprobs(token_ids, entries, text_offset, as_ids)
    prompt = echo_logprobs(rendering.tokenizer, echoed.prompt_token_ids, echoed.prompt_logprobs,
                           rendering.num_logprobs, as_ids)
    end = prompt["text_offset"][-1] + len(prompt["tokens"][-1]) if prompt["tokens"] else 0
    return join_logprobs(prompt, completion_logprobs(token_ids, entries, end, as_ids))


def full_response(meta: ResponseMeta, outputs: Sequence[RequestOutput], rendering: Rendering) -> dict[str, Any]:
    """The non-streaming body of finished requests (`outputs` as `shown`)."""
    choices = []
    for prompt_index, output in enumerate(outputs):
        n = len(output.outputs)
        for c in output.outputs:
            index = prompt_index * n + c.index
            if meta.chat:
                message = final_message(c.text, rendering.chat)
                reason = finish_reason(c.finish_reason, bool(message.get("tool_calls")), rendering.chat)
                choice = {"index": index, "message": message, "logprobs": logprobs_of(rendering, True, c),
                          "finish_reason": reason, "stop_reason": c.stop_reason}
            else:
                echo = rendering.echo_texts[prompt_index] if rendering.echo_texts else ""
                echoed = output if rendering.echoes_logprobs else None
                choice = {"index": index, "text": echo + c.text,
                          "logprobs": logprobs_of(rendering, False, c, text_offset=len(echo), echoed=echoed),
                          "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                if _wants_prompt_logprobs(output, rendering):  # vLLM puts them on each completion choice
                    choice["prompt_logprobs"] = prompt_logprobs_json(output.prompt_logprobs,
                                                                     rendering.prompt_logprobs)
            if rendering.return_token_ids:  # (not when they would show hidden reasoning, as vLLM)
                choice["token_ids"] = None if rendering.chat.hides_reasoning else list(c.token_ids)
                if not meta.chat:  # vLLM: on each completion choice (a chat response carries them once, below)
                    choice["prompt_token_ids"] = list(output.prompt_token_ids)
            choices.append(choice)
    body = {**meta.header(streaming=False), "choices": choices,
            "usage": usage(outputs, rendering.chat if meta.chat else None)}
    if meta.chat and rendering.return_token_ids:
        body["prompt_token_ids"] = list(outputs[0].prompt_token_ids)
    if meta.chat and _wants_prompt_logprobs(outputs[0], rendering):  # vLLM puts them on the chat response
        body["prompt_logprobs"] = prompt_logprobs_json(outputs[0].prompt_logprobs, rendering.prompt_logprobs)
    return body


def _wants_prompt_logprobs(output: RequestOutput, rendering: Rendering) -> bool:
    return output.prompt_logprobs is not None and rendering.prompt_logprobs is not None


def chunk(
    meta: ResponseMeta, index: int, *, text: str | None = None, role: bool = False,
    finish_reason: str | None = None, with_usage_field: bool = False, token_ids: list[int] | None = None,
    delta: ChoiceDelta | None = None, logprobs: dict[str, Any] | None = None, usage: dict[str, Any] | None = None,
    stop_reason: str | int | None = None, prompt_token_ids: list[int] | None = None,
) -> dict[str, Any]:
    """One streaming chunk for choice `index`: a piece of text (or, for chat, a `ChoiceDelta`: reasoning,
    content and tool calls), the assistant role (chat's first chunk), or the finish reason.
    `with_usage_field`: the client asked for usage, so every chunk carries `usage: null`. `token_ids`: every
    generated token id of the choice (on its finishing chunk, with `return_token_ids`). `logprobs`: those of the
    tokens this chunk covers. `usage`: the choice's running usage (vLLM's `continuous_usage_stats`).
    `stop_reason`: vLLM's, on the finishing chunk (null on the others). `prompt_token_ids`: the prompt's ids (on
    the choice's first chunk, with `return_token_ids`), where vLLM puts them: on the chunk (chat), on its choice
    (completions)."""
    if meta.chat:
        body: dict[str, Any] = {}
        if role:
            body["role"] = "assistant"
            body["content"] = ""
        if text:
            body["content"] = text
        if delta is not None:
            if delta.reasoning:  # vLLM's `reasoning`, and the `reasoning_content` it used to send
                body["reasoning"] = body["reasoning_content"] = delta.reasoning
            if delta.content:
                body["content"] = delta.content
            if delta.tool_calls:
                body["tool_calls"] = [call.as_openai(i) for i, call in delta.tool_calls]
        choice = {"index": index, "delta": body, "logprobs": logprobs, "finish_reason": finish_reason,
                  "stop_reason": stop_reason}
    else:
        choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason,
                  "stop_reason": stop_reason}
    if prompt_token_ids is not None and not meta.chat:
        choice["prompt_token_ids"] = prompt_token_ids
    if token_ids is not None:
        choice["token_ids"] = token_ids
    chunk_body = {**meta.header(streaming=True), "choices": [choice]}
    if prompt_token_ids is not None and meta.chat:
        chunk_body["prompt_token_ids"] = prompt_token_ids
    if with_usage_field or usage is not None:
        chunk_body["usage"] = usage
    return chunk_body


def usage_chunk(meta: ResponseMeta, outputs: Sequence[RequestOutput], rendering: Rendering) -> dict[str, Any]:
    """The last chunk when `stream_options.include_usage` is set: no choices, the response's usage (`outputs`
    as `shown`)."""
    return {**meta.header(streaming=True), "choices": [],
            "usage": usage(outputs, rendering.chat if meta.chat else None)}


def sse(data: dict[str, Any] | str) -> bytes:
    """One server-sent event: `data: <json>` and a blank line."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()
