"""OpenAI's Responses API, as vLLM serves it, over the chat pipeline.

    POST /v1/responses        `input` (a string, or message / function_call / function_call_output / reasoning
                              items), `instructions`, function `tools`, `tool_choice`, `text.format`,
                              `max_output_tokens`, sampling fields, `stream`, `store`, `previous_response_id`,
                              `include: ["message.output_text.logprobs"]` with `top_logprobs`
    GET  /v1/responses/{id}   a stored response

A request becomes a chat request: its items become chat messages (function calls an assistant message's
`tool_calls`, their outputs `tool` messages), rendered by the model folder's chat template, so a conversation sent
back turn by turn renders the same prefix each time and the prefix cache covers it. The output's reasoning
(with a reasoning parser), text and tool calls become `reasoning`, `message` and `function_call` items.

Stored responses (`store`, the default, as in OpenAI's API) are kept in memory, the newest `MAX_STORED`, with the
conversation that produced them: `previous_response_id` continues it (the earlier `instructions` are not carried
over, as in OpenAI's API); an unknown id is a 404. `store: false` keeps nothing.

Streamed, the body is server-sent events `event: <type>` / `data: <json>`: `response.created`,
`response.in_progress`, then per output item `response.output_item.added`, its deltas
(`response.reasoning_text.delta`, `response.content_part.added` + `response.output_text.delta` + `.done` +
`response.content_part.done`, `response.function_call_arguments.delta` + `.done`) and
`response.output_item.done`, and last `response.completed` with the whole response (as vLLM sends it, also when
`max_output_tokens` cut the answer: its `status` is then "incomplete"); every event carries a `sequence_number`.
A timeout, an engine failure or any other error mid-stream ends the stream with an `error` event instead.

Logprobs (asked for with `include: ["message.output_text.logprobs"]`, `top_logprobs` the likeliest tokens to list
at each position, 0 by default, as vLLM): the message's `output_text` part carries `{"token", "logprob", "bytes",
"top_logprobs"}` per token, the chat endpoint's entries. Non-streamed, they cover every output token (reasoning
and tool-call tokens too, as vLLM's); streamed, each `response.output_text.delta` carries the tokens generated
since the previous delta of any kind (a reasoning or tool-call delta takes its own tokens, which no event lists).

Usage: `input_tokens` (with `input_tokens_details.cached_tokens`: what the prefix cache skipped),
`output_tokens` (with `output_tokens_details.reasoning_tokens`: the generated tokens inside the think block, as
the chat endpoint counts them: `chat_output.reasoning_tokens`),
`total_tokens`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from hybridcache.outputs import CompletionOutput, RequestOutput
from hybridcache.server.admission import admission_errors, until_final
from hybridcache.server.chat_output import ChoiceStream, final_message, reasoning_tokens
from hybridcache.server.engine_loop import EngineFailure
from hybridcache.server.errors import APIError
from hybridcache.server.limits import RequestTimeout
from hybridcache.server.protocol import CacheSalt, ChatCompletionRequest, Int64, ReasoningEffort, parse_request
from hybridcache.server.responses import logprobs_of
from hybridcache.server.shutdown_guard import SHUTDOWN_MESSAGE
from hybridcache.server.streaming import EventStreamResponse

if TYPE_CHECKING:
    from hybridcache.sampling import SamplingParams
    from hybridcache.server.app import _Routes
    from hybridcache.server.responses import Rendering

logger = logging.getLogger("hybridcache.server")
MAX_STORED = 1024
MAX_STORED_BYTES = 1 << 30  # the stored responses' text at most, in memory (a body may be up to --max-request-bytes)
OUTPUT_LOGPROBS = "message.output_text.logprobs"
_EMPTY_STR_BYTES = sys.getsizeof("")
_TEXT_PARTS = ("input_text", "output_text", "text")
# Fields whose "off" value is all this endpoint implements (a 400 names them otherwise).
# OpenAI's metadata: at most 16 pairs of strings, keys of at most 64 characters, values of at most 512 (it is kept
# with a stored response: unbounded, a client could hold the server's memory)
_Metadata = Annotated[dict[Annotated[str, StringConstraints(max_length=64)],
                           Annotated[str, StringConstraints(max_length=512)]], Field(max_length=16)]
_OFF_VALUES = {"background": (None, False), "conversation": (None,), "prompt": (None,)}


class ResponsesReasoning(BaseModel):
    """`reasoning` of a Responses request: its `effort` reaches the chat template as `reasoning_effort`, as a chat
    request's does (`summary` and the rest are accepted and ignored)."""

    model_config = ConfigDict(extra="ignore")
    effort: ReasoningEffort | None = None


class ResponsesRequest(BaseModel):
    """`POST /v1/responses` (the fields this server reads; others are ignored)."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: Int64 | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: Int64 | None = None
    include: list[str] | None = None
    cache_salt: CacheSalt | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    stream: bool | None = False  # (null: off, as vLLM's Optional[bool])
    store: bool = True
    reasoning: ResponsesReasoning | None = None
    previous_response_id: str | None = None
    text: dict[str, Any] | None = None
    metadata: _Metadata | None = None
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    truncation: Literal["auto", "disabled"] | None = None
    # vLLM's sampling and rendering fields, handed to the chat request as they are (it checks them)
    top_k: Any = None
    min_p: Any = None
    repetition_penalty: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    seed: Any = None
    stop: Any = None
    ignore_eos: Any = None
    logit_bias: Any = None
    skip_special_tokens: Any = None
    include_stop_str_in_output: Any = None
    structured_outputs: Any = None
    chat_template_kwargs: Any = None
    priority: Any = None

    def check_unsupported(self) -> None:
        for name, off in _OFF_VALUES.items():
            if getattr(self, name) not in off:
                raise APIError(400, f"'{name}' is not supported by this server", param=name,
                               code="unsupported_parameter")

    @property
    def wants_logprobs(self) -> bool:
        """Whether the output text's logprobs are asked for (`include`, as OpenAI's and vLLM's)."""
        return OUTPUT_LOGPROBS in (self.include or ())


def _text(content: Any, param: str) -> str | list[dict[str, str]]:
    """An item's content as the chat request takes it: a string, or its text parts (`input_text`,
    `output_text`) as chat text parts (one part: its text), which the chat template joins as the chat endpoint's
    own (with a newline for a template that takes strings: `tokenizer.TextParts`)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"'{param}' must be a string or a list of text parts", param=param)
    texts = []
    for i, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise APIError(400, f"content parts must be text ('input_text' or 'output_text'), got {kind!r}",
                           param=f"{param}.{i}")
        texts.append(part["text"])
    return texts[0] if len(texts) == 1 else [{"type": "text", "text": text} for text in texts] if texts else ""


def _reasoning_text(item: dict[str, Any], param: str) -> str:
    """A reasoning item's text: its `content` parts' texts, else its `summary` parts'; a part must be an object
    whose `text` is a string (400 naming it otherwise)."""
    key = "content" if item.get("content") else "summary"
    parts = item.get(key) or []
    if not isinstance(parts, list):
        raise APIError(400, f"a reasoning item's '{key}' must be a list of parts", param=f"{param}.{key}")
    for j, part in enumerate(parts):
        if not isinstance(part, dict) or not isinstance(part.get("text"), str):
            raise APIError(400, f"a reasoning item's {key} parts must be objects with a string 'text'",
                           param=f"{param}.{key}.{j}.text")
    return "".join(part["text"] for part in parts)


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The request's `input` as chat messages (the chat completions request's `messages`). A function call joins
    the assistant message just before it (an assistant text's or an earlier call's: one turn's `[message,
    function_call, ...]` output items are one assistant message, as vLLM merges them and as the chat request
    sends that turn); a reasoning item's text goes with the next assistant message (a function call after one
    starts a new message)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        param = f"input.{i}"
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise APIError(400, f"a message's role must be user, system, developer or assistant, got {role!r}",
                               param=f"{param}.role")
            message = {"role": role, "content": _text(item.get("content"), f"{param}.content")}
            if role == "assistant" and reasoning:
                message["reasoning_content"], reasoning = "".join(reasoning), []
            messages.append(message)
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}
            if not isinstance(call["function"]["name"], str) or not isinstance(call["id"], str):
                raise APIError(400, "a function_call item needs 'call_id' and 'name'", param=param)
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and not reasoning:
                last.setdefault("tool_calls", []).append(call)
            else:
                message = {"role": "assistant", "content": None, "tool_calls": [call]}
                if reasoning:
                    message["reasoning_content"], reasoning = "".join(reasoning), []
                messages.append(message)
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise APIError(400, "a function_call_output item needs 'call_id'", param=f"{param}.call_id")
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": _text(item.get("output"), f"{param}.output")})
        elif kind == "reasoning":
            reasoning.append(_reasoning_text(item, param))
        else:
            raise APIError(400, f"input items of type {kind!r} are not supported (message, function_call, "
                           "function_call_output and reasoning are)", param=f"{param}.type")
    return messages


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses function tools (`{"type": "function", "name", "parameters", ...}`) in the chat shape."""
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise APIError(400, f"only function tools are supported, got {tool.get('type')!r}",
                           param=f"tools.{i}.type")
        function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(tool_choice: Any) -> Any:
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function" and "name" in tool_choice:
        return {"type": "function", "function": {"name": tool_choice["name"]}}
    return tool_choice


def response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """`text.format` as chat's `response_format`; a `format` that is not an object is a 400."""
    fmt = (text or {}).get("format")
    if fmt is not None and not isinstance(fmt, dict):
        raise APIError(400, f"text.format must be an object such as {{\"type\": \"json_object\"}}, got "
                       f"{json.dumps(fmt)[:80]}", param="text.format")
    if not fmt or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name", "output"), "schema": fmt.get("schema")}}
    return fmt


# the Responses fields that vLLM's ResponsesRequest takes into its SamplingParams (and `min_p`), and its
# chat_template_kwargs and priority: the chat request has each under the same name
PASSED_TO_CHAT = ("top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "seed", "stop",
                  "ignore_eos", "logit_bias", "skip_special_tokens", "include_stop_str_in_output",
                  "structured_outputs", "chat_template_kwargs", "priority")


def chat_request(body: ResponsesRequest, conversation: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat completions body a Responses request runs as: `conversation` (a stored conversation's messages,
    then `input_messages(body.input)`) after the instructions as a system message, with the request's sampling
    fields (`PASSED_TO_CHAT` too), tools and output format (fields left unset are absent); `truncation: "auto"`
    keeps the prompt's last tokens that fit, as vLLM's."""
    messages = ([{"role": "system", "content": body.instructions}] if body.instructions else []) + conversation
    chat = {"model": body.model, "messages": messages, "temperature": body.temperature, "top_p": body.top_p,
            "max_completion_tokens": body.max_output_tokens, "tools": chat_tools(body.tools),
            "tool_choice": chat_tool_choice(body.tool_choice), "parallel_tool_calls": body.parallel_tool_calls,
            "response_format": response_format(body.text),
            "reasoning_effort": body.reasoning.effort if body.reasoning is not None else None}
    chat.update((name, getattr(body, name)) for name in PASSED_TO_CHAT)
    if body.truncation == "auto":  # as vLLM's: drop the oldest tokens to fit, not a 400
        chat["truncate_prompt_tokens"] = -1
    if body.wants_logprobs:
        chat.update(logprobs=True, top_logprobs=body.top_logprobs or 0)
    return {k: v for k, v in chat.items() if v is not None}


_CHAT_TO_RESPONSES = (("messages", "input"), ("max_completion_tokens", "max_output_tokens"),
                      ("max_tokens", "max_output_tokens"), ("response_format", "text.format"))


def responses_param(param: str | None) -> str | None:
    """A chat request's field name as the Responses request spells it (`messages.3.content` is `input`: the
    chat messages also hold the instructions and a stored conversation, so indexes differ)."""
    if param is None:
        return "input"
    for chat, responses in _CHAT_TO_RESPONSES:
        if param == chat or param.startswith(chat + "."):
            return responses
    parts = param.split(".")
    if len(parts) >= 3 and parts[0] == "tools" and parts[2] == "function":  # tools.0.function.name
        return ".".join([*parts[:2], *parts[3:]])
    return param


# chat's response_format fields as `text.format` spells them, most specific first
_FORMAT_FIELDS = (("response_format.json_schema.schema", "text.format.schema"),
                  ("response_format.json_schema", "text.format"), ("response_format", "text.format"))


def responses_message(message: str, param: str | None) -> str:
    """A chat request's error message about its `response_format` with the fields named as `text.format` has
    them (`response_format.json_schema.schema must be ...` is `text.format.schema must be ...`)."""
    if param is None or not (param == "response_format" or param.startswith("response_format.")):
        return message
    for chat, responses in _FORMAT_FIELDS:
        message = message.replace(chat, responses)
    return message


@dataclass
class _Stored:
    messages: list[dict[str, Any]]  # the conversation without instructions, this response's output included
    body: dict[str, Any]

    def size(self) -> int:
        """About the bytes it holds: its strings' memory (1, 2 or 4 bytes a character, as CPython stores them)
        plus 8 per other value."""
        return _size(self.messages) + _size(self.body)


def _size(value: Any) -> int:
    if isinstance(value, str):
        return sys.getsizeof(value) - _EMPTY_STR_BYTES
    if isinstance(value, dict):
        return sum(_size(key) + _size(item) for key, item in value.items())
    if isinstance(value, (list, tuple)):
        return sum(_size(item) for item in value)
    return 8


class ResponseStore:
    """The newest stored responses, by id (event-loop side only): at most `capacity` of them and `max_bytes` of
    their text (`_Stored.size`), the oldest dropped first; the newest is kept whatever its size. Bounded by count
    alone, 1,024 responses of 20 MB each (text a prompt never renders, such as a function_call's call_id, passes
    the prompt-length check) held 20 GB."""

    def __init__(self, capacity: int = MAX_STORED, max_bytes: int = MAX_STORED_BYTES) -> None:
        self.capacity = capacity
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self._items: OrderedDict[str, tuple[_Stored, int]] = OrderedDict()

    def put(self, response_id: str, stored: _Stored) -> None:
        if response_id in self._items:
            self.num_bytes -= self._items.pop(response_id)[1]
        size = stored.size()
        self._items[response_id] = (stored, size)
        self.num_bytes += size
        while len(self._items) > 1 and (len(self._items) > self.capacity or self.num_bytes > self.max_bytes):
            self.num_bytes -= self._items.popitem(last=False)[1][1]

    def get(self, response_id: str, param: str) -> _Stored:
        stored = self._items.get(response_id)
        if stored is None:
            raise APIError(404, f"no stored response has the id {response_id!r}", param=param)
        return stored[0]


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class _Output:
    """A response's output items as they are built, and the assistant message they add to the conversation."""

    items: list[dict[str, Any]] = field(default_factory=list)
    reasoning: str = ""
    content: str = ""
    calls: list[dict[str, Any]] = field(default_factory=list)

    def assistant_message(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": self.content or (None if self.calls else "")}
        if self.reasoning:
            message["reasoning_content"] = self.reasoning
        if self.calls:
            message["tool_calls"] = [{"id": c["call_id"], "type": "function",
                                      "function": {"name": c["name"], "arguments": c["arguments"]}}
                                     for c in self.calls]
        return message


def reasoning_item(text: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": _new_id("rs"), "summary": [], "status": "completed",
            "content": [{"type": "reasoning_text", "text": text}]}


def message_item(text: str, status: str = "completed", logprobs: list[dict[str, Any]] | None = None
                 ) -> dict[str, Any]:
    return {"type": "message", "id": _new_id("msg"), "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}]}


def call_item(call: dict[str, Any]) -> dict[str, Any]:
    function = call["function"]
    return {"type": "function_call", "id": _new_id("fc"), "call_id": call["id"], "name": function["name"],
            "arguments": function["arguments"], "status": "completed"}


class _Responses:
    """The route handlers (over the chat routes' `_Routes`)."""

    def __init__(self, routes: _Routes) -> None:
        self.routes = routes
        self.store = ResponseStore()

    async def create(self, request: Request) -> Response:
        routes = self.routes
        routes._authorize(request)
        body: ResponsesRequest = await routes.read_request(request, ResponsesRequest)
        body.check_unsupported()
        history = self.store.get(body.previous_response_id, "previous_response_id").messages \
            if body.previous_response_id else []

        def as_chat() -> tuple[list[dict[str, Any]], ChatCompletionRequest]:
            conversation = history + input_messages(body.input)
            return conversation, parse_request(ChatCompletionRequest, chat_request(body, conversation))

        try:
            conversation, chat_body = await routes.in_pool(as_chat)  # (a long input: seconds, off the event loop)
            chat = await routes.prepare_chat(chat_body)
        except APIError as error:  # named as the chat request has it: rename to this request's field
            raise APIError(error.status, responses_message(error.message, error.param),
                           param=responses_param(error.param), code=error.code) from None
        response_id = _new_id("resp")
        run = _Run(self, body, response_id, conversation, chat.params, chat.rendering)
        loop = routes.engine_loop
        with admission_errors(lambda: loop.abort(response_id), lambda _: "input"):
            sink = await loop.add(response_id, chat.prompt_ids, chat.params, chat.mm_inputs, chat.checkpoints_at,
                                  cache_salt=body.cache_salt, final_only=not body.stream)
        from hybridcache.server.app import request_outputs  # app imports this module

        timeout = routes.config.limits.request_timeout_s
        deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout
        outputs = request_outputs(sink, chat.rendering, deadline)
        if body.stream:  # a stream the shutdown cuts ends with an error event numbered after the last one sent
            return EventStreamResponse(run.events(outputs), on_close=lambda: loop.abort(response_id),
                                       final_events=lambda: (run.error_event("server_shutdown", SHUTDOWN_MESSAGE),))
        final = await until_final(request, _last(outputs), lambda: loop.abort(response_id))
        if final is None:
            return Response(status_code=499)
        return JSONResponse(run.finish(final, run.output_from(final)))

    async def retrieve(self, request: Request, response_id: str) -> JSONResponse:
        self.routes._authorize(request)
        return JSONResponse(self.store.get(response_id, "response_id").body)


async def _last(outputs: AsyncIterator[RequestOutput]) -> RequestOutput:
    last = None
    async for output in outputs:
        last = output
    return last


def _sse(event: str, data: dict[str, Any]) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n".encode()


class _Run:
    """One response: its body around the output, the stored conversation, and the streamed events."""

    def __init__(self, owner: _Responses, body: ResponsesRequest, response_id: str,
                 conversation: list[dict[str, Any]], params: SamplingParams, rendering: Rendering) -> None:
        self.owner = owner
        self.body = body
        self.response_id = response_id
        self.conversation = conversation
        self.params = params
        self.rendering = rendering
        self.created_at = int(time.time())
        self.sequence_number = 0

    def response_body(self, status: str, output: list[dict[str, Any]], final: RequestOutput | None
                      ) -> dict[str, Any]:
        body = self.body
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        usage = None
        if final is not None:
            input_tokens = len(final.prompt_token_ids)
            output_tokens = sum(len(c.token_ids) for c in final.outputs)
            thinking = sum(reasoning_tokens(c.text, c.token_ids, self.rendering.chat) for c in final.outputs)
            usage = {"input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": final.num_cached_tokens},
                     "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": thinking},
                     "total_tokens": input_tokens + output_tokens}
        return {
            "id": self.response_id, "object": "response", "created_at": self.created_at, "status": status,
            "model": self.owner.routes.config.served_model_name, "output": output, "usage": usage,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "temperature": self.params.temperature, "top_p": self.params.top_p, "top_logprobs": body.top_logprobs,
            "tools": body.tools or [], "tool_choice": body.tool_choice or "auto",
            "parallel_tool_calls": body.parallel_tool_calls, "previous_response_id": body.previous_response_id,
            "text": body.text or {"format": {"type": "text"}}, "truncation": "disabled", "store": body.store,
            "metadata": body.metadata or {}, "background": False, "reasoning": None, "error": None,
            "incomplete_details": incomplete,
        }

    def logprobs(self, c: CompletionOutput, start: int) -> list[dict[str, Any]]:
        """The entries of `c`'s tokens from `start` on, as the output text's `logprobs` (none unless asked)."""
        logprobs = logprobs_of(self.rendering, True, c, start)
        return [] if logprobs is None else logprobs["content"]

    def output_from(self, final: RequestOutput) -> _Output:
        """The output items of a finished (non-streamed) response."""
        message = final_message(final.outputs[0].text, self.rendering.chat)
        out = _Output(reasoning=message.get("reasoning_content") or "", content=message.get("content") or "")
        if out.reasoning:
            out.items.append(reasoning_item(out.reasoning))
        if out.content:
            out.items.append(message_item(out.content, logprobs=self.logprobs(final.outputs[0], 0)))
        for call in message.get("tool_calls") or []:
            item = call_item(call)
            out.calls.append(item)
            out.items.append(item)
        return out

    def finish(self, final: RequestOutput, out: _Output) -> dict[str, Any]:
        """The finished response's body; stored (with its conversation) unless `store` is false."""
        status = "incomplete" if final.outputs[0].finish_reason == "length" else "completed"
        body = self.response_body(status, out.items, final)
        if self.body.store:
            self.owner.store.put(self.response_id, _Stored(self.conversation + [out.assistant_message()], body))
        return body

    def _event(self, kind: str, **data: Any) -> bytes:
        payload = {"type": kind, **data, "sequence_number": self.sequence_number}
        self.sequence_number += 1
        return _sse(kind, payload)

    def error_event(self, code: str, message: str) -> bytes:
        """The stream's `error` event, numbered after the events sent before it."""
        return self._event("error", code=code, message=message, param=None)

    async def events(self, outputs: AsyncIterator[RequestOutput]) -> AsyncIterator[bytes]:
        """The server-sent events of a streamed response (module docstring)."""
        yield self._event("response.created", response=self.response_body("in_progress", [], None))
        yield self._event("response.in_progress", response=self.response_body("in_progress", [], None))
        stream = ChoiceStream(self.rendering.chat, self.params.stop)
        out = _Output()
        open_item: dict[str, Any] | None = None  # the reasoning or message item receiving deltas
        final = None
        logprobs_sent = 0  # the tokens whose logprobs a delta carried (or that went to reasoning or a tool call)

        def close() -> list[bytes]:
            nonlocal open_item
            if open_item is None:
                return []
            item, open_item = open_item, None
            index = len(out.items) - 1
            if item["type"] == "reasoning":
                text = item["content"][0]["text"]
                return [self._event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                    content_index=0, text=text),
                        self._event("response.output_item.done", output_index=index, item=item)]
            part = item["content"][0]
            item["status"] = "completed"
            return [self._event("response.output_text.done", item_id=item["id"], output_index=index,
                                content_index=0, text=part["text"], logprobs=part["logprobs"]),
                    self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                content_index=0, part=part),
                    self._event("response.output_item.done", output_index=index, item=item)]

        def open_new(item: dict[str, Any]) -> list[bytes]:
            nonlocal open_item
            events = close()
            open_item = item
            out.items.append(item)
            index = len(out.items) - 1
            if item["type"] == "reasoning":
                added = {**item, "content": []}
                return [*events, self._event("response.output_item.added", output_index=index, item=added)]
            empty = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            return [*events,
                    self._event("response.output_item.added", output_index=index,
                                item={**item, "status": "in_progress", "content": []}),
                    self._event("response.content_part.added", item_id=item["id"], output_index=index,
                                content_index=0, part=empty)]

        try:
            async for output in outputs:
                final = output
                c = output.outputs[0]
                delta = stream.update(c.text, c.finish_reason is not None)
                if delta:
                    logprobs, logprobs_sent = self.logprobs(c, logprobs_sent), len(c.token_ids)
                if delta.reasoning:
                    if open_item is None or open_item["type"] != "reasoning":
                        for event in open_new(reasoning_item("")):
                            yield event
                    open_item["content"][0]["text"] += delta.reasoning
                    out.reasoning += delta.reasoning
                    yield self._event("response.reasoning_text.delta", item_id=open_item["id"],
                                      output_index=len(out.items) - 1, content_index=0, delta=delta.reasoning)
                if delta.content:
                    if open_item is None or open_item["type"] != "message":
                        for event in open_new(message_item("", status="in_progress")):
                            yield event
                    open_item["content"][0]["text"] += delta.content
                    open_item["content"][0]["logprobs"] += logprobs
                    out.content += delta.content
                    yield self._event("response.output_text.delta", item_id=open_item["id"],
                                      output_index=len(out.items) - 1, content_index=0, delta=delta.content,
                                      logprobs=logprobs)
                for _, call in delta.tool_calls:
                    for event in close():
                        yield event
                    item = call_item({"id": call.id, "function": {"name": call.name, "arguments": call.arguments}})
                    out.items.append(item)
                    out.calls.append(item)
                    index = len(out.items) - 1
                    yield self._event("response.output_item.added", output_index=index,
                                      item={**item, "arguments": "", "status": "in_progress"})
                    yield self._event("response.function_call_arguments.delta", item_id=item["id"],
                                      output_index=index, delta=item["arguments"])
                    yield self._event("response.function_call_arguments.done", item_id=item["id"],
                                      output_index=index, name=item["name"], arguments=item["arguments"])
                    yield self._event("response.output_item.done", output_index=index, item=item)
            for event in close():
                yield event
        except RequestTimeout as error:
            yield self.error_event("request_timeout", str(error))
            return
        except EngineFailure as error:
            yield self.error_event("engine_failure", str(error))
            return
        except Exception as error:  # a bug while building an event: an error event, not a cut connection
            logger.exception("streaming %s failed", self.response_id)
            yield self.error_event("internal_error", f"internal error: {type(error).__name__}: {error}")
            return
        if final is None:
            return
        # as vLLM: the last event is response.completed whatever the status (the openai client's stream helper
        # waits for it); an answer cut by max_output_tokens has status "incomplete" in it
        yield self._event("response.completed", response=self.finish(final, out))


def add_responses_routes(app: FastAPI, routes: _Routes) -> None:
    """Register POST /v1/responses and GET /v1/responses/{response_id} on `app`."""
    handlers = _Responses(routes)
    app.add_api_route("/v1/responses", handlers.create, methods=["POST"])
    app.add_api_route("/v1/responses/{response_id}", handlers.retrieve, methods=["GET"])
