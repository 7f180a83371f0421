"""Request bodies of the OpenAI API (the fields this server understands) and their translation into
`SamplingParams`. Unknown fields are ignored; fields we cannot honour (logprobs, echo, penalties, ...)
are refused with a message that names them rather than silently dropped."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from hybridcache.sampling import SamplingParams
from hybridcache.server.errors import APIError

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class _SamplingRequest(BaseModel):
    """Fields shared by both endpoints."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    n: int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: Any = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    return_token_ids: bool = False  # vLLM's extension: the generated token ids with each finished choice

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def _refuse_unsupported(self) -> None:
        if self.logprobs not in (None, False, 0):
            raise APIError(400, "logprobs is not supported by this server", param="logprobs")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                raise APIError(400, f"{name} is not supported by this server (send 0 or leave it out)", param=name)
        if self.logit_bias:
            raise APIError(400, "logit_bias is not supported by this server", param="logit_bias")

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        """SamplingParams for `max_tokens` new tokens; a bad value is an APIError(400) naming it."""
        self._refuse_unsupported()
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

    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def single_prompt(self) -> str | list[int]:
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise APIError(400, f"batched prompts are not supported: got {len(prompt)} prompts; send one "
                               "prompt (a string or a list of token ids) per request", param="prompt")
            prompt = prompt[0]
        if self.echo:
            raise APIError(400, "echo is not supported by this server", param="echo")
        if self.suffix:
            raise APIError(400, "suffix is not supported by this server", param="suffix")
        if self.best_of not in (None, 1, self.n):
            raise APIError(400, "best_of is not supported by this server", param="best_of")
        return prompt


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None

    def as_template_input(self) -> dict[str, str]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        return {"role": self.role, "content": content or ""}


class ChatCompletionRequest(_SamplingRequest):
    """`POST /v1/chat/completions`: messages rendered by the model folder's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def parse_request(model: type[BaseModel], data: Any) -> Any:
    """Validate a decoded JSON body; the first problem becomes an APIError(400) naming its field."""
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as error:
        first = error.errors()[0]
        field = ".".join(str(part) for part in first["loc"]) or None
        problem = first["msg"]
        if first["type"] == "missing":
            raise APIError(400, f"'{field}' is a required field", param=field) from None
        raise APIError(400, f"invalid value for '{field}': {problem} (got {first.get('input')!r})"[:500],
                       param=field) from None
