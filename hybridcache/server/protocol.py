"""Request bodies of the OpenAI API (the fields this server understands) and their translation into
`SamplingParams`. Unknown fields are ignored, except those listed in body_checks.py as not implemented,
which are refused with a message that names them rather than silently dropped.

Integers are bounded (a seed fits 64 bits, a token id 31), floats must be finite, and every validation
error names the field as the client sent it (`prompt.2`, `messages.0.content.0.type`), never the schema's
internal union branch.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from hybridcache.sampling import SamplingParams
from hybridcache.server.body_checks import check_body
from hybridcache.server.errors import APIError

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_N = 128  # OpenAI's limit on choices per request

Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
TokenId = Annotated[int, Field(ge=0, lt=2**31)]
# seed + i seeds choice i (i < MAX_N), and a torch generator takes seeds below 2**64
Seed = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]

_CONFIG = ConfigDict(extra="ignore", allow_inf_nan=False)


class StreamOptions(BaseModel):
    model_config = _CONFIG
    include_usage: bool = False


class _SamplingRequest(BaseModel):
    """Fields shared by both endpoints."""

    model_config = _CONFIG

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

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def check_n(self) -> None:
        if self.n > MAX_N:
            raise APIError(400, f"n must be at most {MAX_N}, got {self.n}", param="n")

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        """SamplingParams for `max_tokens` new tokens; a bad value is an APIError(400) naming it."""
        self.check_n()
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        try:
            return SamplingParams(
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=0 if self.top_k is None else self.top_k,
                max_tokens=max_tokens,
                stop=tuple(stop),
                stop_token_ids=tuple(self.stop_token_ids or ()),
                ignore_eos=self.ignore_eos,
                seed=self.seed,
                n=self.n,
            )
        except ValueError as error:
            raise APIError(400, str(error), param=str(error).split(" ", 1)[0]) from None


class CompletionRequest(_SamplingRequest):
    """`POST /v1/completions`: `prompt` is a string or a list of token ids (one prompt per request)."""

    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]

    def single_prompt(self) -> str | list[int]:
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise APIError(400, f"batched prompts are not supported: got {len(prompt)} prompts; send one "
                               "prompt (a string or a list of token ids) per request", param="prompt")
            prompt = prompt[0]
        return prompt


class ContentPart(BaseModel):
    model_config = _CONFIG
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """A message; null content is refused before validation (body_checks.py), a missing one is ""."""

    model_config = _CONFIG
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] = ""

    def as_template_input(self) -> dict[str, str]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        return {"role": self.role, "content": content or ""}


class ChatCompletionRequest(_SamplingRequest):
    """`POST /v1/chat/completions`: messages rendered by the model folder's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int64 | None = None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def parse_request(model: type[BaseModel], data: Any) -> Any:
    """Validate a decoded JSON body; the first problem becomes an APIError(400) naming its field.

    Of several errors (a union reports one per branch) the one deepest in the body is reported, so a float in
    a token-id prompt reports `prompt.1`, not the string branch's `prompt`."""
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(data).__name__}")
    check_body(data)
    try:
        return model.model_validate(data)
    except ValidationError as error:
        errors = error.errors(include_url=False)
        paths = [_client_path(e["loc"]) for e in errors]
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
