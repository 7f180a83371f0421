"""Anthropic's Messages API, as vLLM serves it, over the chat pipeline.

    POST /v1/messages                `model`, `messages`, `max_tokens`, `system`, `tools`, `tool_choice`,
                                     `stop_sequences`, `temperature`, `top_p`, `top_k`, `stream`, `output_config`
    POST /v1/messages/count_tokens   -> `{"input_tokens": N}`: the tokens the same messages' prompt holds

so that Anthropic's clients (the `anthropic` SDKs; Claude Code with `ANTHROPIC_BASE_URL`) use this server
unchanged. A request becomes the chat request it means (anthropic_protocol.py), rendered by the model folder's chat
template, so a conversation sent back turn by turn renders the same prefix each time and the prefix cache covers
it. The output's reasoning (with a reasoning parser), text and tool calls become `thinking`, `text` and `tool_use`
blocks. `stop_reason`: "max_tokens" when the limit cut the reply, "tool_use" when it has tool_use blocks,
"stop_sequence" (with `stop_sequence` the string) when one of `stop_sequences` ended it, else "end_turn".

Usage, as vLLM reports it (since its PR #40912) and as Anthropic defines it (the prompt is `input_tokens` +
`cache_read_input_tokens` + `cache_creation_input_tokens`): `cache_read_input_tokens` is what the prefix cache
skipped (the chat endpoint's `prompt_tokens_details.cached_tokens`), `input_tokens` the prompt tokens computed,
`cache_creation_input_tokens` 0 (there is no cache write to bill), `output_tokens` the tokens generated.

Streamed, the body is Anthropic's server-sent events `event: <type>` / `data: <json>`: `message_start` (the
message with no content yet, and the prompt's usage), `ping`, then per block `content_block_start`, its
`content_block_delta`s (`thinking_delta` and last a `signature_delta`; `text_delta`; one `input_json_delta` with a
tool call's whole input, sent once the call is parsed) and `content_block_stop`, then `message_delta` (the
`stop_reason`, `stop_sequence` and the usage) and `message_stop`. A timeout, an engine failure or any other error
mid-stream ends the stream with an `event: error` instead.

Errors on these routes are Anthropic's error objects (`anthropic_protocol.anthropic_error_body`) with the status
the OpenAI routes answer. The API key may be sent as `x-api-key` (Anthropic's header, what the SDK sends) or as
`Authorization: Bearer`.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from hybridcache.outputs import CompletionOutput, RequestOutput
from hybridcache.server.admission import admission_errors, until_final
from hybridcache.server.anthropic_protocol import (
    COUNT_TOKENS_PATH,
    MESSAGES_PATH,
    CountTokensRequest,
    MessagesRequest,
    anthropic_error_body,
    chat_request,
    messages_param,
)
from hybridcache.server.chat_output import ChoiceStream, final_message
from hybridcache.server.engine_loop import EngineFailure
from hybridcache.server.error_response import ErrorResponse
from hybridcache.server.errors import APIError
from hybridcache.server.limits import RequestTimeout
from hybridcache.server.protocol import ChatCompletionRequest, parse_request
from hybridcache.server.shutdown_guard import SHUTDOWN_MESSAGE
from hybridcache.server.streaming import EventStreamResponse

if TYPE_CHECKING:
    from hybridcache.server.app import PreparedChat, _Routes

logger = logging.getLogger("hybridcache.server")
KEY_MESSAGE = "invalid or missing API key: send 'x-api-key: <key>' or 'Authorization: Bearer <key>'"


def _anthropic_errors(handler: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
    """`handler` with its APIErrors answered as Anthropic's error objects (same status and headers)."""

    @functools.wraps(handler)
    async def run(request: Request) -> Response:
        try:
            return await handler(request)
        except APIError as error:
            return ErrorResponse(anthropic_error_body(error.status, error.message, error.param),
                                 status_code=error.status, headers=error.headers)

    return run


def _renamed(error: APIError) -> APIError:
    """A chat request's error with its field named as the Messages request names it."""
    return APIError(error.status, error.message, param=messages_param(error.param), code=error.code,
                    headers=error.headers)


def usage(final: RequestOutput) -> dict[str, int]:
    """Anthropic's usage of a finished (or running) request (module docstring)."""
    cached = final.num_cached_tokens
    return {"input_tokens": len(final.prompt_token_ids) - cached, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached, "output_tokens": sum(len(c.token_ids) for c in final.outputs)}


def stop_reason(c: CompletionOutput, has_tool_use: bool, stop: tuple[str, ...]) -> tuple[str, str | None]:
    """(`stop_reason`, `stop_sequence`) of a finished completion (module docstring)."""
    if c.finish_reason == "length":
        return "max_tokens", None
    if has_tool_use:
        return "tool_use", None
    if isinstance(c.stop_reason, str) and c.stop_reason in stop:
        return "stop_sequence", c.stop_reason
    return "end_turn", None


def _tool_use(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    """A `tool_use` block; its `input` is always an object (Anthropic's type, and what the request side takes back):
    the call's arguments when they are one, {} for none or null, else {"arguments": what the model wrote}."""
    try:
        parsed = json.loads(arguments) if arguments.strip() else None
    except ValueError:  # (the tool parser gives JSON text; kept whole if not)
        parsed = arguments
    if not isinstance(parsed, dict):
        parsed = {} if parsed is None else {"arguments": parsed}
    return {"type": "tool_use", "id": call_id, "name": name, "input": parsed}


def _signature() -> str:
    """A thinking block's `signature` (Anthropic's SDKs need one; nothing checks it here, as in vLLM)."""
    return uuid.uuid4().hex


def _event(kind: str, **data: Any) -> bytes:
    payload = json.dumps({"type": kind, **data}, ensure_ascii=False, separators=(",", ":"))
    return f"event: {kind}\ndata: {payload}\n\n".encode()


def error_event(status: int, message: str) -> bytes:
    """The stream's `event: error` (Anthropic's error object)."""
    body = anthropic_error_body(status, message)
    return _event("error", error=body["error"])


class _Messages:
    """The route handlers (over the chat routes' `_Routes`)."""

    def __init__(self, routes: _Routes) -> None:
        self.routes = routes

    def authorize(self, request: Request) -> None:
        if not self.routes._has_key(request):
            raise APIError(401, KEY_MESSAGE, code="invalid_api_key")

    async def as_chat(self, body: CountTokensRequest) -> ChatCompletionRequest:
        """The chat request `body` runs as (built and validated on the tokenizer threads: a long conversation)."""
        takes_images = self.routes.model.image_processor is not None

        def build() -> ChatCompletionRequest:
            chat = chat_request(body, takes_images)  # (its errors name this request's fields)
            try:
                return parse_request(ChatCompletionRequest, chat)
            except APIError as error:
                raise _renamed(error) from None

        return await self.routes.in_pool(build)

    async def create(self, request: Request) -> Response:
        routes = self.routes
        self.authorize(request)
        body: MessagesRequest = await routes.read_request(request, MessagesRequest)
        chat_body = await self.as_chat(body)
        try:
            chat = await routes.prepare_chat(chat_body)
        except APIError as error:
            raise _renamed(error) from None
        message_id = f"msg_{uuid.uuid4().hex}"
        loop = routes.engine_loop
        with admission_errors(lambda: loop.abort(message_id),
                              lambda message: messages_param(chat_body.engine_error_param(message))):
            sink = await loop.add(message_id, chat.prompt_ids, chat.params, chat.mm_inputs, chat.checkpoints_at,
                                  cache_salt=chat_body.cache_salt, final_only=not body.stream)
        from hybridcache.server.app import request_outputs  # app imports this module

        timeout = routes.config.limits.request_timeout_s
        deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout
        outputs = request_outputs(sink, chat.rendering, deadline)
        run = _Run(message_id, routes.config.served_model_name, chat)
        if body.stream:
            return EventStreamResponse(run.events(outputs), on_close=lambda: loop.abort(message_id),
                                       final_events=(error_event(503, SHUTDOWN_MESSAGE),))
        final = await until_final(request, _last(outputs), lambda: loop.abort(message_id))
        if final is None:
            return Response(status_code=499)
        return JSONResponse(run.message(final))

    async def count_tokens(self, request: Request) -> JSONResponse:
        """The prompt's tokens as the messages route renders it (images expanded into their tokens, as /tokenize
        counts them)."""
        routes = self.routes
        self.authorize(request)
        body: CountTokensRequest = await routes.read_request(request, CountTokensRequest)
        chat = await self.as_chat(body)
        routes._check_model(chat.model)
        try:
            chat_prompt, images, _ = await routes.in_pool(routes._render_chat, chat)
            routes.check_prompt_bytes([chat_prompt.text], "messages")
            tokens = (await routes._encode([chat_prompt.text]))[0]
            if images:
                tokens, _ = await routes.image_request(tokens, images)
        except APIError as error:
            raise _renamed(error) from None
        return JSONResponse({"input_tokens": len(tokens),
                             "context_management": {"original_input_tokens": len(tokens)}})  # (vLLM's too)


async def _last(outputs: AsyncIterator[RequestOutput]) -> RequestOutput:
    last = None
    async for output in outputs:
        last = output
    return last


class _Run:
    """One message: its body, whole or as the streamed events."""

    def __init__(self, message_id: str, model: str, chat: PreparedChat) -> None:
        self.message_id = message_id
        self.model = model
        self.chat = chat

    def head(self, content: list[dict[str, Any]], usage_now: dict[str, int]) -> dict[str, Any]:
        return {"id": self.message_id, "type": "message", "role": "assistant", "model": self.model,
                "content": content, "stop_reason": None, "stop_sequence": None, "usage": usage_now}

    def message(self, final: RequestOutput) -> dict[str, Any]:
        """The body of a finished (non-streamed) message."""
        c = final.outputs[0]
        message = final_message(c.text, self.chat.rendering.chat)
        content: list[dict[str, Any]] = []
        if message.get("reasoning"):
            content.append({"type": "thinking", "thinking": message["reasoning"], "signature": _signature()})
        if message.get("content"):
            content.append({"type": "text", "text": message["content"]})
        for call in message.get("tool_calls") or []:
            function = call["function"]
            content.append(_tool_use(call["id"], function["name"], function["arguments"]))
        body = self.head(content, usage(final))
        has_tool_use = any(block["type"] == "tool_use" for block in content)
        body["stop_reason"], body["stop_sequence"] = stop_reason(c, has_tool_use, self.chat.params.stop)
        return body

    async def events(self, outputs: AsyncIterator[RequestOutput]) -> AsyncIterator[bytes]:
        """The server-sent events of a streamed message (module docstring)."""
        stream = ChoiceStream(self.chat.rendering.chat, self.chat.params.stop)
        final = None
        num_blocks = 0
        open_kind: str | None = None  # the open block's type: "thinking" or "text" (receiving deltas), "tool_use"
        has_tool_use = False

        def close() -> list[bytes]:
            nonlocal open_kind
            if open_kind is None:
                return []
            events = []
            if open_kind == "thinking":
                events.append(_event("content_block_delta", index=num_blocks - 1,
                                     delta={"type": "signature_delta", "signature": _signature()}))
            open_kind = None
            return [*events, _event("content_block_stop", index=num_blocks - 1)]

        def open_new(block: dict[str, Any]) -> list[bytes]:
            nonlocal num_blocks, open_kind
            events = close()
            num_blocks += 1
            open_kind = block["type"]
            return [*events, _event("content_block_start", index=num_blocks - 1, content_block=block)]

        try:
            async for output in outputs:
                if final is None:  # the prompt's usage is known once the engine has run it
                    yield _event("message_start", message=self.head([], {**usage(output), "output_tokens": 0}))
                    yield _event("ping")
                final = output
                c = output.outputs[0]
                delta = stream.update(c.text, c.finish_reason is not None)
                if delta.reasoning:
                    if open_kind != "thinking":
                        for event in open_new({"type": "thinking", "thinking": "", "signature": ""}):
                            yield event
                    yield _event("content_block_delta", index=num_blocks - 1,
                                 delta={"type": "thinking_delta", "thinking": delta.reasoning})
                if delta.content:
                    if open_kind != "text":
                        for event in open_new({"type": "text", "text": ""}):
                            yield event
                    yield _event("content_block_delta", index=num_blocks - 1,
                                 delta={"type": "text_delta", "text": delta.content})
                for _, call in delta.tool_calls:
                    has_tool_use = True
                    block = _tool_use(call.id, call.name, call.arguments)
                    for event in open_new({**block, "input": {}}):
                        yield event
                    yield _event("content_block_delta", index=num_blocks - 1,
                                 delta={"type": "input_json_delta", "partial_json": json.dumps(block["input"])})
                    for event in close():
                        yield event
            for event in close():
                yield event
        except RequestTimeout as error:
            yield error_event(503, str(error))
            return
        except EngineFailure as error:
            yield error_event(500, str(error))
            return
        except Exception as error:  # a bug while building an event: an error event, not a cut connection
            logger.exception("streaming %s failed", self.message_id)
            yield error_event(500, f"internal error: {type(error).__name__}: {error}")
            return
        if final is None:
            return
        reason, sequence = stop_reason(final.outputs[0], has_tool_use, self.chat.params.stop)
        yield _event("message_delta", delta={"stop_reason": reason, "stop_sequence": sequence}, usage=usage(final))
        yield _event("message_stop")


def add_anthropic_routes(app: FastAPI, routes: _Routes) -> None:
    """Register POST /v1/messages and POST /v1/messages/count_tokens on `app`."""
    handlers = _Messages(routes)
    app.add_api_route(MESSAGES_PATH, _anthropic_errors(handlers.create), methods=["POST"])
    app.add_api_route(COUNT_TOKENS_PATH, _anthropic_errors(handlers.count_tokens), methods=["POST"])
