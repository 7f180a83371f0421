"""Anthropic's Messages API request bodies, and their translation into the chat completions body they run as.

A Messages request becomes a chat request, as vLLM's `vllm/entrypoints/anthropic` makes one::

    system (a string or text blocks)        ->  a system message first (with `role: "system"` messages' text)
    user: text / image blocks               ->  a user message (text parts, `image_url` parts)
    user: tool_result blocks                ->  a `tool` message each, before the user message (its images
                                                 in a user message after it, as vLLM)
    assistant: text / thinking / tool_use   ->  an assistant message: content, `reasoning_content`, `tool_calls`
    a last assistant message (no tool_use)  ->  continued (Anthropic's prefill: `continue_final_message`)
    tools [{name, description, input_schema}]  ->  function tools (`parameters`: the input schema)
    tool_choice auto / any / tool / none    ->  "auto" / "required" / {"function": {"name"}} / "none"
    tool_choice.disable_parallel_tool_use   ->  parallel_tool_calls: false
    max_tokens, stop_sequences, temperature, top_p, top_k  ->  the chat request's sampling fields
    output_config.format (json_schema), .effort  ->  response_format, reasoning_effort

Ignored, as vLLM ignores them: `metadata`, `thinking` (a reasoning parser splits what the model thinks; the
chat template's own switch is `chat_template_kwargs`), `cache_control` on blocks (the prefix cache needs no
breakpoints), `service_tier`, a tool_result's `is_error`, `redacted_thinking` and `tool_reference` blocks, and
a thinking block's `signature`. A system text block that starts with Claude Code's `x-anthropic-billing-header`
is dropped, as vLLM drops it: it carries a per-request hash that would end every prompt's shared prefix there.
Refused (400 naming the field): a block type outside those above (`document`, `search_result`, server tool
blocks), a server tool (`{"type": "web_search_20250305"}`: it runs on Anthropic's servers), an image for a model
without a vision tower, a tool_use block in a user message or a tool_result block in an assistant one.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from hybridcache.server.errors import APIError
from hybridcache.server.protocol import CacheSalt, Int64

MESSAGES_PATH = "/v1/messages"
COUNT_TOKENS_PATH = "/v1/messages/count_tokens"
BILLING_HEADER = "x-anthropic-billing-header"
# the roles Claude Code >= 2.1.154 sends besides Anthropic's, read as vLLM reads them
ROLE_ALIASES = {"ctx": "user", "msg": "user"}
_CONFIG = ConfigDict(extra="ignore", allow_inf_nan=False)
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 409: "invalid_request_error", 413: "request_too_large",
                415: "invalid_request_error", 429: "rate_limit_error", 503: "overloaded_error"}


def anthropic_error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """Anthropic's error object, `{"type": "error", "error": {"type", "message"}}`, for an HTTP `status` (the
    type Anthropic gives that status; 5xx: `api_error`, but 503, our full queue or shutdown: `overloaded_error`).
    Anthropic's error has no field name: `param`, when the message does not already say it, leads the message."""
    if param and param not in message:
        message = f"{param}: {message}"
    kind = _ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def sent_keys(headers: Mapping[str, str]) -> list[bytes]:
    """The API keys a request sends: its `Authorization: Bearer` token, and its `x-api-key` header (Anthropic's,
    which its SDKs send); a request carries the key when either is one of the keys."""
    scheme, _, token = headers.get("authorization", "").partition(" ")
    sent = [token.strip().encode()] if scheme.lower() == "bearer" else []
    if (header := headers.get("x-api-key")) is not None:
        sent.append(header.strip().encode())
    return sent


def _role(value: Any) -> Any:
    return ROLE_ALIASES.get(value, value) if isinstance(value, str) else value


class AnthropicMessage(BaseModel):
    model_config = _CONFIG
    role: Annotated[Literal["user", "assistant", "system"], BeforeValidator(_role)]
    content: str | list[dict[str, Any]]


class AnthropicToolChoice(BaseModel):
    model_config = _CONFIG
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class OutputFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, populate_by_name=True)
    type: Literal["json_schema"]
    json_schema: dict[str, Any] = Field(alias="schema")


class OutputConfig(BaseModel):
    """`effort`: Anthropic's levels; "max" is the chat route's highest, "xhigh"."""

    model_config = _CONFIG
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: OutputFormat | None = None


class CountTokensRequest(BaseModel):
    """`POST /v1/messages/count_tokens`: what a Messages request's prompt is made of."""

    model_config = _CONFIG
    model: str = Field(min_length=1)
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: dict[str, Any] | None = None  # accepted, ignored (module docstring)
    output_config: OutputConfig | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's extension


# this server's extension: chat request fields a Messages request may carry too (handed over as they are; the chat
# request checks them), so that a client can seed or constrain a reply here as in a chat request
PASSED_TO_CHAT = ("seed", "logit_bias", "ignore_eos", "min_tokens", "min_p", "repetition_penalty",
                  "presence_penalty", "frequency_penalty", "structured_outputs", "cache_salt")


class MessagesRequest(CountTokensRequest):
    """`POST /v1/messages` (the fields this server reads; others are ignored)."""

    max_tokens: Annotated[Int64, Field(ge=1)]
    stop_sequences: list[str] | None = None
    stream: bool | None = False  # (null: off)
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int64 | None = None
    metadata: dict[str, Any] | None = None  # accepted, ignored
    seed: Any = None
    logit_bias: Any = None
    ignore_eos: Any = None
    min_tokens: Any = None
    min_p: Any = None
    repetition_penalty: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    structured_outputs: Any = None
    cache_salt: CacheSalt | None = None


def chat_request(body: CountTokensRequest, takes_images: bool) -> dict[str, Any]:
    """The chat completions body `body` runs as (module docstring); fields it leaves unset are absent.
    `takes_images`: the model has a vision tower (an image block is a 400 otherwise)."""
    messages = chat_messages(body, takes_images)
    last = messages[-1] if messages else None
    prefill = last is not None and last["role"] == "assistant" and not last.get("tool_calls")
    chat: dict[str, Any] = {"model": body.model, "messages": messages, "tools": chat_tools(body.tools),
                            "chat_template_kwargs": body.chat_template_kwargs}
    if prefill:  # the reply continues the last assistant message (Anthropic's prefill)
        chat.update(add_generation_prompt=False, continue_final_message=True)
    choice = body.tool_choice
    if choice is not None:
        if choice.type == "tool" and not choice.name:
            raise APIError(400, "tool_choice of type 'tool' needs the tool's 'name'", param="tool_choice.name")
        if choice.type in ("any", "tool") and not body.tools:
            raise APIError(400, f"tool_choice of type {choice.type!r} needs tools", param="tool_choice")
        chat["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type) or \
            {"type": "function", "function": {"name": choice.name}}
        if choice.disable_parallel_tool_use:
            chat["parallel_tool_calls"] = False
    config = body.output_config
    if config is not None:
        chat["reasoning_effort"] = "xhigh" if config.effort == "max" else config.effort
        if config.format is not None:
            chat["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": "output", "schema": config.format.json_schema}}
    if isinstance(body, MessagesRequest):
        chat.update(max_tokens=body.max_tokens, stop=body.stop_sequences, temperature=body.temperature,
                    top_p=body.top_p, top_k=body.top_k)
        chat.update((name, getattr(body, name)) for name in PASSED_TO_CHAT)
    return {k: v for k, v in chat.items() if v is not None}


def chat_messages(body: CountTokensRequest, takes_images: bool) -> list[dict[str, Any]]:
    """The request's system prompt and messages as chat messages (module docstring)."""
    system = _system_parts(body.system, "system")
    messages: list[dict[str, Any]] = []
    for i, message in enumerate(body.messages):
        param = f"messages.{i}.content"
        if message.role == "system":
            system += _system_parts(message.content, param)
        elif message.role == "user":
            messages += _user_messages(message.content, param, takes_images)
        else:
            messages.append(_assistant_message(message.content, param))
    if system:
        messages.insert(0, {"role": "system", "content": system[0]["text"] if len(system) == 1 else system})
    return messages


def _blocks(content: str | list[dict[str, Any]], param: str) -> list[tuple[str, dict[str, Any]]]:
    """(param, block) of each block of `content` (a string: one text block); a block must be an object with a
    string `type`."""
    if isinstance(content, str):
        return [(param, {"type": "text", "text": content})]
    out = []
    for j, block in enumerate(content):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise APIError(400, "a content block must be an object with a 'type'", param=f"{param}.{j}.type")
        out.append((f"{param}.{j}", block))
    return out


def _text(block: dict[str, Any], param: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise APIError(400, "a text block needs a 'text' string", param=f"{param}.text")
    return text


def _system_parts(content: str | list[dict[str, Any]] | None, param: str) -> list[dict[str, str]]:
    """The system text blocks as chat text parts (empty ones and Claude Code's billing header dropped)."""
    if content is None:
        return []
    parts = []
    for where, block in _blocks(content, param):
        if block["type"] != "text":
            raise APIError(400, f"system blocks must be text blocks, got {block['type']!r}", param=f"{where}.type")
        text = _text(block, where)
        if text and not text.startswith(BILLING_HEADER):
            parts.append({"type": "text", "text": text})
    return parts


def _image_part(block: dict[str, Any], param: str, takes_images: bool) -> dict[str, Any]:
    """An image block as a chat `image_url` part: a base64 source as a data: URI, a url source as its URL."""
    if not takes_images:
        raise APIError(400, "image blocks need a model with a vision tower; this model takes only text",
                       param=f"{param}.type")
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64" and isinstance(source.get("data"), str):
        media_type = source.get("media_type") if isinstance(source.get("media_type"), str) else "image/jpeg"
        return {"type": "image_url", "image_url": {"url": f"data:{media_type};base64,{source['data']}"}}
    if kind == "url" and isinstance(source.get("url"), str):
        return {"type": "image_url", "image_url": {"url": source["url"]}}
    raise APIError(400, "an image block's source must be {\"type\": \"base64\", \"media_type\", \"data\"} or "
                   "{\"type\": \"url\", \"url\"}", param=f"{param}.source")


def _tool_result(block: dict[str, Any], param: str, takes_images: bool) -> list[dict[str, Any]]:
    """A tool_result block as a `tool` message, its images in a user message after it (as vLLM)."""
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str):
        raise APIError(400, "a tool_result block needs the 'tool_use_id' of its tool_use", param=f"{param}.tool_use_id")
    content = block.get("content")
    texts, images = [], []
    if content is not None and not isinstance(content, (str, list)):
        raise APIError(400, "a tool_result's content must be a string or a list of blocks", param=f"{param}.content")
    for where, inner in _blocks(content or "", f"{param}.content"):
        if inner["type"] == "text":
            texts.append(_text(inner, where))
        elif inner["type"] == "image":
            images.append(_image_part(inner, where, takes_images))
        elif inner["type"] != "tool_reference":
            raise APIError(400, f"a tool_result's content blocks may be 'text' or 'image', got {inner['type']!r}",
                           param=f"{where}.type")
    out = [{"role": "tool", "tool_call_id": call_id, "content": "\n".join(texts)}]
    return out + ([{"role": "user", "content": images}] if images else [])


def _user_messages(content: str | list[dict[str, Any]], param: str, takes_images: bool) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = []
    tool_messages: list[dict[str, Any]] = []
    for where, block in _blocks(content, param):
        kind = block["type"]
        if kind == "text":
            if text := _text(block, where):
                parts.append({"type": "text", "text": text})
        elif kind == "image":
            parts.append(_image_part(block, where, takes_images))
        elif kind == "tool_result":
            tool_messages += _tool_result(block, where, takes_images)
        elif kind == "tool_use":
            raise APIError(400, "tool_use blocks belong to assistant messages", param=f"{where}.type")
        elif kind not in ("thinking", "redacted_thinking", "tool_reference"):
            raise APIError(400, _unknown_block(kind, "text, image, tool_result"), param=f"{where}.type")
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    if not parts and tool_messages:  # only tool results (as vLLM: no empty user message after them)
        return tool_messages
    if not parts:  # only empty text: an empty user turn, as content "" is (dropped, a last one made the reply a
        return [{"role": "user", "content": ""}]  # prefill of the assistant message before it)
    text_only = len(parts) == 1 and parts[0]["type"] == "text"
    return [*tool_messages, {"role": "user", "content": parts[0]["text"] if text_only else parts}]


def _assistant_message(content: str | list[dict[str, Any]], param: str) -> dict[str, Any]:
    texts, reasoning, calls = [], [], []
    for where, block in _blocks(content, param):
        kind = block["type"]
        if kind == "text":
            texts.append(_text(block, where))
        elif kind == "thinking":
            if isinstance(block.get("thinking"), str):
                reasoning.append(block["thinking"])
        elif kind == "tool_use":
            name, call_id, arguments = block.get("name"), block.get("id"), block.get("input")
            arguments = {} if arguments is None else arguments  # (vLLM reads a missing or null input as {})
            if not isinstance(name, str) or not isinstance(call_id, str) or not isinstance(arguments, dict):
                raise APIError(400, "a tool_use block needs an 'id', a 'name' and an 'input' object", param=where)
            calls.append({"id": call_id, "type": "function",
                          "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}})
        elif kind == "tool_result":
            raise APIError(400, "tool_result blocks belong to user messages", param=f"{where}.type")
        elif kind != "redacted_thinking":
            raise APIError(400, _unknown_block(kind, "text, thinking, tool_use"), param=f"{where}.type")
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if reasoning:
        message["reasoning_content"] = "".join(reasoning)
    if calls:
        message["tool_calls"] = calls
    return message


def _unknown_block(kind: str, allowed: str) -> str:
    return f"content blocks of type {kind!r} are not supported here (this message's may be {allowed})"


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Anthropic tools (`{"name", "description", "input_schema"}`) as chat function tools; a server tool (a
    `type` other than "custom") or a tool without an object `input_schema` is a 400 naming it. A schema without
    a `type` is an object's, as vLLM reads it."""
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type")
        if kind not in (None, "custom"):
            raise APIError(400, f"only client tools (a name and an input_schema) are supported; {kind!r} is a "
                           "server tool, run by Anthropic's servers", param=f"tools.{i}.type")
        name, schema = tool.get("name"), tool.get("input_schema")
        if not isinstance(name, str) or not name:
            raise APIError(400, "a tool needs a 'name'", param=f"tools.{i}.name")
        if not isinstance(schema, dict):
            raise APIError(400, "a tool needs an 'input_schema' object (a JSON schema)",
                           param=f"tools.{i}.input_schema")
        function = {"name": name, "parameters": {"type": "object", **schema}}
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


# a chat request's field (or the start of its dotted path) as the Messages request names it
_CHAT_TO_MESSAGES = (("messages", "messages"), ("max_completion_tokens", "max_tokens"), ("stop", "stop_sequences"),
                     ("response_format", "output_config.format"), ("reasoning_effort", "output_config.effort"),
                     ("tool_choice", "tool_choice"), ("parallel_tool_calls", "tool_choice.disable_parallel_tool_use"))


def messages_param(param: str | None) -> str | None:
    """The Messages request's name of a chat request's field (`messages.3.content` is `messages`: the chat
    messages also hold the system prompt, and tool results are messages of their own, so indexes differ;
    `tools.0.function.parameters` is `tools.0.input_schema`)."""
    if param is None:
        return None
    for chat, ours in _CHAT_TO_MESSAGES:
        if param == chat or param.startswith(chat + "."):
            return ours
    parts = param.split(".")
    if len(parts) >= 3 and parts[0] == "tools" and parts[2] == "function":
        rest = parts[3:]
        if rest and rest[0] == "parameters":
            rest = ["input_schema", *rest[1:]]
        return ".".join([*parts[:2], *rest])
    return param
