"""Response bodies and server-sent-event chunks of the OpenAI API, built from the engine's `RequestOutput`."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from hybridcache.outputs import RequestOutput


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


def usage(output: RequestOutput) -> dict[str, Any]:
    """Token counts of a request; `cached_tokens`: prompt tokens whose computation the prefix cache skipped."""
    prompt_tokens = len(output.prompt_token_ids)
    completion_tokens = sum(len(c.token_ids) for c in output.outputs)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": output.cached_tokens},
    }


def full_response(meta: ResponseMeta, output: RequestOutput, return_token_ids: bool = False) -> dict[str, Any]:
    """The non-streaming body of a finished request (`return_token_ids`: each choice carries `token_ids`)."""
    choices = []
    for c in output.outputs:
        if meta.chat:
            message = {"role": "assistant", "content": c.text}
            choice = {"index": c.index, "message": message, "logprobs": None, "finish_reason": c.finish_reason}
        else:
            choice = {"index": c.index, "text": c.text, "logprobs": None, "finish_reason": c.finish_reason}
        if return_token_ids:
            choice["token_ids"] = list(c.token_ids)
        choices.append(choice)
    return {**meta.header(streaming=False), "choices": choices, "usage": usage(output)}


def chunk(
    meta: ResponseMeta, index: int, *, text: str | None = None, role: bool = False,
    finish_reason: str | None = None, with_usage_field: bool = False, token_ids: list[int] | None = None,
) -> dict[str, Any]:
    """One streaming chunk for choice `index`: a piece of text, the assistant role (chat's first chunk), or
    the finish reason. `with_usage_field`: the client asked for usage, so every chunk carries `usage: null`.
    `token_ids`: every generated token id of the choice (on its finishing chunk, with `return_token_ids`)."""
    if meta.chat:
        delta: dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
            delta["content"] = ""
        if text:
            delta["content"] = text
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    else:
        choice = {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    body = {**meta.header(streaming=True), "choices": [choice]}
    if with_usage_field:
        body["usage"] = None
    return body


def usage_chunk(meta: ResponseMeta, output: RequestOutput) -> dict[str, Any]:
    """The last chunk when `stream_options.include_usage` is set: no choices, the request's usage."""
    return {**meta.header(streaming=True), "choices": [], "usage": usage(output)}


def sse(data: dict[str, Any] | str) -> bytes:
    """One server-sent event: `data: <json>` and a blank line."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()
