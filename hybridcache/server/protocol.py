"""Request bodies of the OpenAI API (the fields this server understands) and their translation into
`SamplingParams`. Unknown fields are ignored, except those listed in body_checks.py as not implemented,
which are refused with a message that names them rather than silently dropped.

Integers are bounded (a seed fits 64 bits, a token id 31), floats must be finite, and every validation
error names the field as the client sent it (`prompt.2`, `messages.0.content.0.type`), never the schema's
internal union branch.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable
from typing import Annotated, Any, ClassVar, Literal, NamedTuple

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    TypeAdapter,
    ValidationError,
    model_validator,
)

from hybridcache.generation_config import SamplingDefaults
from hybridcache.guided import GuidedSpec
from hybridcache.mm_processor import template_arguments, template_content
from hybridcache.sampling import MAX_LOGPROBS, SamplingParams
from hybridcache.server.body_checks import check_body
from hybridcache.server.errors import APIError
from hybridcache.server.limits import truncation_tail
from hybridcache.server.structured import STRUCTURED_OUTPUT_KEYS, guided_spec, response_format_spec, tool_choice_spec

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_N = 128  # OpenAI's limit on choices per request


def _not_a_bool(value: Any) -> Any:
    """JSON `true` is not the integer 1 (pydantic's lax mode would take it as one)."""
    if isinstance(value, bool):
        raise ValueError(f"must be an integer, got the boolean {json.dumps(value)}")
    return value


Int64 = Annotated[int, BeforeValidator(_not_a_bool), Field(ge=-(2**63), le=2**63 - 1)]
TokenId = Annotated[int, BeforeValidator(_not_a_bool), Field(ge=0, lt=2**31)]
# seed + i seeds choice i (i < MAX_N), and a torch generator takes seeds below 2**64
Seed = Annotated[int, BeforeValidator(_not_a_bool), Field(ge=-(2**63), le=2**63 - 1)]
CacheSalt = Annotated[str, Field(min_length=1, max_length=1024)]  # vLLM's bounds
MAX_TOKEN_ID_DIGITS = 10  # a token id is below 2**31

_CONFIG = ConfigDict(extra="ignore", allow_inf_nan=False)


class StreamOptions(BaseModel):
    """vLLM's `stream_options`: given at all, the stream ends with a usage chunk unless `include_usage` is false;
    `continuous_usage_stats` (with usage) puts the running usage on every chunk."""

    model_config = _CONFIG
    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False


# vLLM's "reasoning_effort" values (OpenAI's): passed to the chat template as the variable `reasoning_effort`
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]


class Truncation(NamedTuple):
    """What `truncate_prompt_tokens` keeps of a prompt: `keep` tokens, its last ones (`side` "left", the default:
    the start is cut) or its first ("right"), vLLM's `truncation_side`::

        prompt ids       a b c d e f     keep 4
        side "left"          c d e f
        side "right"     a b c d
    """

    keep: int
    side: Literal["left", "right"] = "left"

    def apply(self, prompt_ids: list[int]) -> list[int]:
        """`prompt_ids` cut to the `keep` tokens of `side`."""
        return prompt_ids[-self.keep:] if self.side == "left" else prompt_ids[:self.keep]

    def text_window(self, text: str, limit_bytes: int | None, max_model_len: int) -> str:
        """The part of a prompt `text` to tokenize: its end that holds the kept tokens and a margin
        (`limits.truncation_tail`), or for "right" as much of its start (the margin's last tokens, which the cut
        may merge otherwise, are dropped by the truncation), so that a text of any length is not tokenized whole."""
        tail = truncation_tail(text, self.keep, limit_bytes, max_model_len)
        return tail if self.side == "left" else text[:len(tail)]


class _SamplingRequest(BaseModel):
    """Fields shared by both endpoints. A field in `NULL_MEANS_DEFAULT` (vLLM declares it Optional) may be sent as
    null, which means the same as leaving it out."""

    model_config = _CONFIG
    NULL_MEANS_DEFAULT: ClassVar[frozenset[str]] = frozenset({"stream", "return_token_ids"})

    model: str | None = None
    max_tokens: Int64 | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int64 | None = None
    n: Int64 = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    seed: Seed | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False  # vLLM's extension: the generated token ids with each finished choice
    # vLLM's extension: logprobs name each token "token_id:<id>" (a token that is not valid UTF-8 is then told apart)
    return_tokens_as_token_ids: bool = False
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    min_tokens: Int64 = 0
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None
    prompt_logprobs: Int64 | None = None  # vLLM's extension: logprobs of the prompt's tokens (not with stream)
    # vLLM's extension: keep only k prompt tokens (-1: as many as the reply leaves room for); see `truncation`
    truncate_prompt_tokens: Annotated[Int64, Field(ge=-1)] | None = None
    truncation_side: Literal["left", "right"] | None = None  # vLLM's: which end is cut (None: "left")
    include_stop_str_in_output: bool = False  # vLLM's: the matched stop string stays in the text
    skip_special_tokens: bool = True  # vLLM's: special tokens are left out of the text
    # vLLM's: requests share cached prefixes only with requests of the same salt (a tenant's secret)
    cache_salt: CacheSalt | None = None

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        if isinstance(data, dict) and any(data.get(name, 0) is None for name in cls.NULL_MEANS_DEFAULT):
            return {key: value for key, value in data.items()
                    if not (value is None and key in cls.NULL_MEANS_DEFAULT)}
        return data

    def include_usage(self, forced: bool = False) -> bool:
        """Whether the stream ends with a usage chunk: `stream_options` given with `include_usage` not false
        (vLLM's default true), or `forced` (the server's `force_include_usage`)."""
        return forced or bool(self.stream_options and self.stream_options.include_usage)

    def continuous_usage(self, forced: bool = False) -> bool:
        """Whether every chunk carries the running usage (`stream_options.continuous_usage_stats`, with usage)."""
        options = self.stream_options
        return self.include_usage(forced) and bool(options and options.continuous_usage_stats)

    def truncation(self, max_model_len: int, num_output_tokens: int) -> Truncation | None:
        """What `truncate_prompt_tokens` k keeps of the prompt (None without it), by vLLM's renderer's rule: the
        prompt may hold at most `max_model_len - num_output_tokens` tokens (the room the reply leaves:
        `max_tokens`, or its default when the request leaves it out), so -1 keeps that many, and a k over it, or 0,
        is a 400. Worked example: max_model_len 256, max_tokens 16: -1 keeps 240 tokens, 241 is refused."""
        k = self.truncate_prompt_tokens
        if k is None:
            return None
        room = max_model_len - num_output_tokens
        if room < 1:
            raise APIError(400, f"max_tokens {num_output_tokens} leaves no room for a prompt in max_model_len "
                           f"{max_model_len} (truncate_prompt_tokens -1 keeps max_model_len - max_tokens tokens)",
                           param="max_tokens", code="context_length_exceeded")
        if k == 0 or k > room:
            raise APIError(400, f"truncate_prompt_tokens must be -1 or in [1, {room}] (max_model_len {max_model_len} "
                           f"- max_tokens {num_output_tokens}: the prompt room the reply leaves, as vLLM), got {k}",
                           param="truncate_prompt_tokens")
        return Truncation(room if k == -1 else k, self.truncation_side or "left")

    def num_logprobs(self) -> int | None:
        """How many top logprobs each token carries, or None when logprobs are off (each endpoint names the
        fields its own way)."""
        return None

    def engine_prompt_logprobs(self) -> int | None:
        """How many top logprobs the engine computes at each prompt position (None: none)."""
        return self.prompt_logprobs

    def guided(self) -> GuidedSpec | None:
        """The one structured-output constraint of the request (a 400 when it sets several)."""
        specs = [(name, spec) for name, spec in (
            ("response_format", response_format_spec(self.response_format)),
            ("guided_json", guided_spec(self.model_dump(include={"guided_json", "guided_regex", "guided_choice",
                                                                  "guided_grammar", "structured_outputs"}))),
        ) if spec is not None]
        if len(specs) > 1:
            raise APIError(400, "response_format and the guided_* / structured_outputs fields exclude each other",
                           param="response_format")
        return specs[0][1] if specs else None

    def engine_error_param(self, message: str) -> str | None:
        """The field that the engine's error `message` (a request it refused) is about: the field it starts
        with, the constraint field for a grammar it cannot use, else the prompt."""
        first = message.split(" ", 1)[0]
        if first in type(self).model_fields:
            return first
        if "constraint" in message:
            return self.guided_field()
        return "prompt" if "prompt" in message else None

    def guided_field(self) -> str | None:
        """The name of the field that sets the request's structured-output constraint (None: none does)."""
        nested = self.structured_outputs if isinstance(self.structured_outputs, dict) else {}
        names = ["response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar"]
        for name in names:
            if getattr(self, name) is not None:
                return name
        return next((f"structured_outputs.{key}" for key, value in nested.items()
                     if value and key in STRUCTURED_OUTPUT_KEYS), None)

    def _logit_bias(self) -> dict[int, float]:
        """The bias by token id. Keys are token ids written in ASCII digits (`"٥"` is a digit to `str.isdigit`
        and to `int`, and `int` refuses over 4,300 digits with an error of its own); the engine checks them
        against the vocabulary."""
        bias = {}
        for key, value in (self.logit_bias or {}).items():
            if not (key.isascii() and key.isdigit() and len(key) <= MAX_TOKEN_ID_DIGITS) or int(key) >= 2**31:
                raise APIError(400, f"logit_bias keys are token ids (decimal ASCII digits), got {key[:40]!r}",
                               param="logit_bias")
            bias[int(key)] = value
        return bias

    def check_n(self) -> None:
        if self.n > MAX_N:
            raise APIError(400, f"n must be at most {MAX_N}, got {self.n}", param="n")
        if self.prompt_logprobs is not None and self.stream:
            raise APIError(400, "prompt_logprobs is not available with stream: true (as in vLLM)",
                           param="prompt_logprobs")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options can only be given with stream: true (as in vLLM)",
                           param="stream_options")

    def sampling_params(self, max_tokens: int, guided: GuidedSpec | None = None,
                        defaults: SamplingDefaults | None = None) -> SamplingParams:
        """SamplingParams for `max_tokens` new tokens under the constraint `guided`; a field the request leaves
        unset takes `defaults` (the model's generation config) when they set it. A bad value is an
        APIError(400) naming it."""
        self.check_n()
        d = defaults or SamplingDefaults()
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        logit_bias = self._logit_bias()
        try:
            return SamplingParams(
                temperature=d.pick("temperature", self.temperature, 1.0),
                top_p=d.pick("top_p", self.top_p, 1.0),
                top_k=d.pick("top_k", self.top_k, 0),
                max_tokens=max_tokens,
                stop=tuple(stop),
                stop_token_ids=tuple(self.stop_token_ids or ()),
                ignore_eos=self.ignore_eos,
                seed=self.seed,
                n=self.n,
                min_p=d.pick("min_p", self.min_p, 0.0),
                min_tokens=self.min_tokens,
                presence_penalty=self.presence_penalty or 0.0,
                frequency_penalty=self.frequency_penalty or 0.0,
                repetition_penalty=d.pick("repetition_penalty", self.repetition_penalty, 1.0),
                logit_bias=logit_bias,
                logprobs=self.num_logprobs(),
                prompt_logprobs=self.engine_prompt_logprobs(),
                guided=guided,
                include_stop_str_in_output=self.include_stop_str_in_output,
                skip_special_tokens=self.skip_special_tokens,
            )
        except ValueError as error:
            raise APIError(400, str(error), param=str(error).split(" ", 1)[0]) from None


class CompletionRequest(_SamplingRequest):
    """`POST /v1/completions`: `prompt` is a string or a list of token ids (one prompt per request)."""

    NULL_MEANS_DEFAULT = _SamplingRequest.NULL_MEANS_DEFAULT | {"echo"}

    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    logprobs: Int64 | None = None
    echo: bool = False

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: one, or several (a list of strings or of token-id lists: a batch, whose
        choices are numbered prompt by prompt, `n` each)."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            return list(prompt)
        return [prompt]

    def echo_only(self) -> bool:
        """`max_tokens: 0` with `echo` (OpenAI's legacy API; older lm-eval versions send it): the choices are the
        prompts alone, with their logprobs when asked for. Without echo, 0 is a 400."""
        if self.max_tokens == 0 and not self.echo:
            raise APIError(400, "max_tokens must be at least 1 (0 is accepted only with echo: true, which "
                           "returns the prompt and its logprobs)", param="max_tokens")
        return self.max_tokens == 0

    def engine_prompt_logprobs(self) -> int | None:
        """With `echo` and `logprobs` k the prompt's logprobs are echoed, so the engine computes them with at
        least k alternatives (as vLLM, this makes the request skip the prefix cache)."""
        if self.echo and self.logprobs is not None:
            return max(self.logprobs, self.prompt_logprobs or 0)
        return self.prompt_logprobs

    def num_logprobs(self) -> int | None:
        if self.logprobs is None:
            return None
        if not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise APIError(400, f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}", param="logprobs")
        return self.logprobs


class ContentPart(BaseModel):
    model_config = _CONFIG
    type: Literal["text"]
    text: str


class ImageURL(BaseModel):
    model_config = _CONFIG
    url: str
    detail: str | None = None


class ImageURLPart(BaseModel):
    """An image (`hybridcache.server.chat_images` loads it): a data: URI, an http(s) URL or an allowed local path."""

    model_config = _CONFIG
    type: Literal["image_url"]
    image_url: ImageURL


class VideoURLPart(BaseModel):
    """A video part: parsed so that it can be refused by name (video input is not supported)."""

    model_config = _CONFIG
    type: Literal["video_url"]
    video_url: Any = None


_PART_TAGS = {"text": "ContentPart", "image_url": "ImageURLPart", "video_url": "VideoURLPart"}


def _part_tag(part: Any) -> str | None:
    """The content part class a part's `type` names (a tag `_client_path` leaves out of error locations)."""
    kind = part.get("type") if isinstance(part, dict) else getattr(part, "type", None)
    return _PART_TAGS.get(kind) if isinstance(kind, str) else None


# A part is validated against the one class its `type` names, so a malformed image part's error names its
# `image_url` field, not the text part's `type` literal; a `type` outside the three is an error of its own.
MessagePart = Annotated[
    Annotated[ContentPart, Tag("ContentPart")] | Annotated[ImageURLPart, Tag("ImageURLPart")]
    | Annotated[VideoURLPart, Tag("VideoURLPart")],
    Discriminator(_part_tag, custom_error_type="part_type",
                  custom_error_message="a content part must be an object whose type is 'text', 'image_url' or "
                                       "'video_url'")]


class FunctionCall(BaseModel):
    """An earlier call's function; `arguments` null or "" (a call without arguments, as some clients send it back)
    is `{}`, as vLLM reads it."""

    model_config = _CONFIG
    name: str
    arguments: str | dict[str, Any] | None = "{}"


class ToolCallMessage(BaseModel):
    """An assistant message's earlier tool call."""

    model_config = _CONFIG
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDefinition(BaseModel):
    model_config = _CONFIG
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = _CONFIG
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ChatMessage(BaseModel):
    """A message; null content is allowed only for an assistant message with tool calls (body_checks.py);
    a missing one is "". Assistant messages may carry `tool_calls` and `reasoning_content` (vLLM's
    `reasoning` is the same), tool messages `tool_call_id`."""

    model_config = _CONFIG
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[MessagePart] | None = ""
    name: str | None = None
    tool_calls: list[ToolCallMessage] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None

    def as_template_input(self) -> dict[str, Any]:
        """The message as chat templates take it; tool-call arguments as objects where they parse as JSON
        objects (templates that iterate over arguments need them so; `tojson` writes them back the same)."""
        content = self.content
        if isinstance(content, list):  # text parts joined; with image or video parts kept (server/chat_images.py)
            content = template_content([part.model_dump(exclude_none=True) for part in content])
        message: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        reasoning = self.reasoning_content if self.reasoning_content is not None else self.reasoning
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        if self.tool_calls:
            message["tool_calls"] = [
                {"id": call.id, "type": "function",
                 "function": {"name": call.function.name, "arguments": template_arguments(call.function.arguments)}}
                for call in self.tool_calls
            ]
        return message


class ChatCompletionRequest(_SamplingRequest):
    """`POST /v1/chat/completions`: messages rendered by the model folder's chat template."""

    NULL_MEANS_DEFAULT = _SamplingRequest.NULL_MEANS_DEFAULT | {"n", "logprobs", "parallel_tool_calls"}

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int64 | None = None
    logprobs: bool = False
    top_logprobs: Int64 | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    reasoning_effort: ReasoningEffort | None = None
    echo: bool = False  # vLLM's: the content starts with the last message's (`echo_text`)
    include_reasoning: bool = True  # vLLM's: false drops the reasoning (with a reasoning parser)

    def template_kwargs(self, defaults: dict[str, Any]) -> dict[str, Any]:
        """The chat template's variables: the server's `defaults`, then `reasoning_effort` as vLLM passes it (the
        variable itself, and `enable_thinking`: false for "none", true for any other effort, since Qwen3 templates
        read only that one), then the request's own `chat_template_kwargs`, each overriding the one before."""
        effort = {} if self.reasoning_effort is None else {"reasoning_effort": self.reasoning_effort,
                                                           "enable_thinking": self.reasoning_effort != "none"}
        return {**defaults, **effort, **(self.chat_template_kwargs or {})}

    def echo_text(self) -> str | None:
        """With `echo`, what every choice's content starts with, as vLLM: the last message's text when the reply
        continues that message's role (`add_generation_prompt` false, as with `continue_final_message`, or a last
        message by the assistant), else ""; text parts joined with "\n". None without `echo`."""
        if not self.echo:
            return None
        last = self.messages[-1]
        if self.add_generation_prompt and last.role != "assistant":
            return ""
        if isinstance(last.content, list):
            return "\n".join(part.text for part in last.content if isinstance(part, ContentPart))
        return last.content or ""

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def num_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise APIError(400, f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {self.top_logprobs}",
                           param="top_logprobs")
        if not self.logprobs:
            if self.top_logprobs:
                raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
            return None
        return self.top_logprobs or 0

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        return [tool.model_dump(exclude_none=True) for tool in self.tools] if self.tools else None

    def effective_tool_choice(self) -> str | dict[str, Any]:
        """OpenAI's default: "auto" with tools, "none" without."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    def guided_field(self) -> str | None:
        if self.effective_tool_choice() not in ("auto", "none"):
            return "tool_choice"
        return super().guided_field()

    def guided(self) -> GuidedSpec | None:
        forced = tool_choice_spec(self.tool_dicts(), self.effective_tool_choice(), self.parallel_tool_calls)
        other = super().guided()
        if forced is not None and other is not None:
            raise APIError(400, "tool_choice 'required' or a named function cannot be combined with "
                           "response_format or guided decoding", param="tool_choice")
        return forced or other


MESSAGES_PER_VALIDATION = 1024  # a longer conversation is validated this many messages at a time (see below)


def parse_request(model: type[BaseModel], data: Any) -> Any:
    """Validate a decoded JSON body; the first problem becomes an APIError(400) naming its field.

    Of several errors (a union reports one per branch) the one deepest in the body is reported, so a float in
    a token-id prompt reports `prompt.1`, not the string branch's `prompt`. A body of more than
    `MESSAGES_PER_VALIDATION` messages is validated that many messages at a time: pydantic holds the GIL for a
    whole call, so on a worker thread (app.py) the event loop then runs between two slices rather than waiting
    out the whole conversation (230,000 messages: 0.7 s)."""
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(data).__name__}")
    check_body(data)
    messages = data.get("messages")
    if "messages" not in model.model_fields or not isinstance(messages, list) \
            or len(messages) <= MESSAGES_PER_VALIDATION:
        return _validated(model.model_validate, data)
    body = _validated(model.model_validate, {**data, "messages": messages[:MESSAGES_PER_VALIDATION]})
    validate = _messages_validator(model)
    rest = [_validated(validate, messages[start:start + MESSAGES_PER_VALIDATION], ("messages", start))
            for start in range(MESSAGES_PER_VALIDATION, len(messages), MESSAGES_PER_VALIDATION)]
    body.messages = [*body.messages, *(message for part in rest for message in part)]
    return body


@functools.cache
def _messages_validator(model: type[BaseModel]) -> Callable[[Any], Any]:
    return TypeAdapter(model.model_fields["messages"].annotation).validate_python


def _validated(validate: Callable[[Any], Any], data: Any, at: tuple[str, int] | None = None) -> Any:
    """`validate(data)`, its ValidationError an APIError(400); `at`: (field, offset) when `data` is the slice of
    a list field that starts at that offset (the error then names the item in the whole list)."""
    try:
        return validate(data)
    except ValidationError as error:
        errors = error.errors(include_url=False)
        paths = [(*_client_path(e["loc"]), "type") if e["type"] == "part_type" else _client_path(e["loc"])
                 for e in errors]
        if at is not None:
            paths = [(at[0], at[1] + p[0], *p[1:]) if p and isinstance(p[0], int) else (at[0], *p) for p in paths]
        depth = max(len(p) for p in paths)
        first, path = next((e, p) for e, p in zip(errors, paths) if len(p) == depth)
        field = ".".join(str(part) for part in path) or None
        if first["type"] == "missing":
            raise APIError(400, f"'{field}' is a required field", param=field) from None
        raise APIError(400, f"invalid value for '{field}': {first['msg']} (got {first.get('input')!r})"[:500],
                       param=field) from None


_FIELD_NAME = re.compile(r"[a-z_][a-z0-9_]*")
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _client_path(loc: tuple) -> tuple:
    """A pydantic error location without its union-branch tags (`list[int]`, `str`, `ContentPart`): what
    remains are the keys and indexes of the client's body."""
    return tuple(part for part in loc
                 if isinstance(part, int) or (_FIELD_NAME.fullmatch(part) and part not in _TYPE_TAGS))
